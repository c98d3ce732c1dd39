"""Checking a drafter checkpoint's tensors: the keys an EAGLE-3 drafter has, the shapes its config implies, a
consistent draft vocabulary (``d2t`` / ``t2d``), and the fit with the target it is to serve.

Every check raises ``ValueError`` naming the key, what it holds and what was expected. The state checked here is
already in SpecFit's key spelling (``formats`` normalises the layouts first).
"""

from __future__ import annotations

import torch

from .drafter import Eagle3Config

REQUIRED_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
OPTIONAL_KEYS = {"embed_tokens.weight"}  # an owned embedding; otherwise the target's is shared


def _expected_shapes(c: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, how to read it) implied by the config."""
    h, i, d, ht = c.hidden_size, c.intermediate_size, c.head_dim, c.target_hidden_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes = {
        "fc.weight": ((h, 3 * ht), f"(hidden_size={h}, 3*target_hidden_size={3 * ht})"),
        "midlayer.input_layernorm.weight": ((h,), f"(hidden_size={h},)"),
        "midlayer.hidden_norm.weight": ((h,), f"(hidden_size={h},)"),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * h), f"(heads*head_dim={q}, 2*hidden_size={2 * h})"),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * h), f"(kv_heads*head_dim={kv}, 2*hidden_size={2 * h})"),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * h), f"(kv_heads*head_dim={kv}, 2*hidden_size={2 * h})"),
        "midlayer.self_attn.o_proj.weight": ((h, q), f"(hidden_size={h}, heads*head_dim={q})"),
        "midlayer.post_attention_layernorm.weight": ((h,), f"(hidden_size={h},)"),
        "midlayer.mlp.gate_proj.weight": ((i, h), f"(intermediate_size={i}, hidden_size={h})"),
        "midlayer.mlp.up_proj.weight": ((i, h), f"(intermediate_size={i}, hidden_size={h})"),
        "midlayer.mlp.down_proj.weight": ((h, i), f"(hidden_size={h}, intermediate_size={i})"),
        "norm.weight": ((h,), f"(hidden_size={h},)"),
        "lm_head.weight": ((c.draft_vocab_size, h), f"(draft_vocab_size={c.draft_vocab_size}, hidden_size={h})"),
        "d2t": ((c.draft_vocab_size,), f"(draft_vocab_size={c.draft_vocab_size},)"),
        "t2d": ((c.vocab_size,), f"(vocab_size={c.vocab_size},)"),
        "embed_tokens.weight": ((c.vocab_size, h), f"(vocab_size={c.vocab_size}, hidden_size={h})"),
    }
    return shapes


def check_keys(state: dict) -> None:
    """The required keys are all there, and no key outside ``REQUIRED_KEYS`` and ``OPTIONAL_KEYS``."""
    required = REQUIRED_KEYS
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"drafter checkpoint is missing required key(s): {', '.join(missing)}")
    unexpected = sorted(k for k in state if k not in required and k not in OPTIONAL_KEYS)
    if unexpected:
        hint = " (only one decoder layer is supported)" if any(k.startswith("layers.") for k in unexpected) else ""
        raise ValueError(f"drafter checkpoint has unexpected key(s): {', '.join(unexpected)}{hint}")


def check_shapes(state: dict, c: Eagle3Config) -> None:
    """Every tensor has the shape its own ``config.json`` implies."""
    for key, (shape, how) in _expected_shapes(c).items():
        if key in state and tuple(state[key].shape) != shape:
            raise ValueError(
                f"drafter checkpoint does not match its config.json: {key} has shape {tuple(state[key].shape)}, "
                f"expected {how}"
            )


def check_vocab_maps(state: dict, c: Eagle3Config) -> None:
    """eagle3.md §2.2: t2d marks exactly Vd ids and d2t lists them in increasing order."""
    d2t, t2d = state["d2t"], state["t2d"]
    marked = int(t2d.sum())
    if marked != c.draft_vocab_size:
        raise ValueError(f"t2d marks {marked} target ids, expected draft_vocab_size={c.draft_vocab_size}")
    ids = torch.arange(c.draft_vocab_size) + d2t  # [Vd] target ids of the draft vocab
    if c.draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        bad = int((ids[1:] <= ids[:-1]).nonzero()[0]) + 1
        raise ValueError(f"d2t: arange(Vd)+d2t must be strictly increasing, but draft id {bad} maps to {int(ids[bad])}")
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
        raise ValueError(f"d2t maps draft ids to target ids in [{int(ids.min())}, {int(ids.max())}], outside "
                         f"[0, vocab_size={c.vocab_size})")
    if not bool(t2d[ids].all()):
        raise ValueError("d2t and t2d disagree: some target id reached through d2t is not marked in t2d")


def fit_error(message: str) -> ValueError:
    """The error for a drafter that does not fit its target (also raised by ``formats`` for aux-layer ids)."""
    return ValueError(f"drafter does not fit the target: {message}")


def check_fit(state: dict, c: Eagle3Config, target) -> None:
    """The drafter fits ``target``: ``fc`` reads 3x its hidden size, ``t2d`` spans its vocab, the embedding matches."""
    hidden = target.config.hidden_size
    embedding = target.get_input_embeddings().weight
    vocab = embedding.shape[0]
    fc = tuple(state["fc.weight"].shape)
    if fc[1] != 3 * hidden:
        raise fit_error(f"fc.weight has shape {fc}, expected ({fc[0]}, 3*target_hidden={3 * hidden})")
    t2d = tuple(state["t2d"].shape)
    if t2d[0] != vocab:
        raise fit_error(
            f"t2d has shape {t2d} (vocab_size={c.vocab_size}), expected (target_vocab={vocab},) (rows of the target "
            "embedding)"
        )
    if "embed_tokens.weight" in state:
        own = tuple(state["embed_tokens.weight"].shape)
        if own[0] != vocab:
            raise fit_error(f"embed_tokens.weight has shape {own}, expected (target_vocab={vocab}, {own[1]})")
    elif tuple(embedding.shape) != (c.vocab_size, c.hidden_size):
        raise fit_error(
            f"the shared target embedding has shape {tuple(embedding.shape)}, expected "
            f"(vocab_size={c.vocab_size}, hidden_size={c.hidden_size}) (the checkpoint has no embed_tokens.weight)"
        )
