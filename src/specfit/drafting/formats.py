"""Read public EAGLE-3 drafter checkpoints as they are, check them against the target, and write the SpecForge layout.

Layouts read (a folder with ``config.json`` and ``model.safetensors``, a safetensors index or ``pytorch_model.bin``):

* SpecForge / EAGLE / SGLang: flat Llama-style ``config.json`` (``LlamaForCausalLMEagle3``), keys ``fc.*``,
  ``midlayer.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d``, optionally ``embed_tokens.weight``.
* vLLM / speculators: keys ``layers.0.*`` instead of ``midlayer.*``; speculators configs have a top-level
  ``speculators_model_type: "eagle3"`` and the layer fields nested in ``transformer_layer_config`` (written as a diff
  against ``LlamaConfig``, so missing fields take the Llama defaults).
* EAGLE trainer (``traineagle3``): a flat ``LlamaForCausalLM`` config and an unprefixed ``pytorch_model.bin``.
* Any key may carry a ``model.`` prefix. ``head_dim`` comes from the config or else from ``q_proj`` rows / heads.
  ``draft_vocab_size`` absent means the full vocab. A full-vocab drafter's ``d2t`` / ``t2d`` are the identity: absent
  maps are filled in, and maps over fewer ids (the EAGLE trainer saves them over the ids it saw) are dropped with a
  warning, as EAGLE's own loader drops them. ``target_hidden_size`` absent means ``hidden_size``.

Norm flags, read as the tool that writes the format means them:

* ``norm_output``, flat configs (SpecForge, default true): whether ``lm_head`` reads the final ``norm`` of the
  midlayer output (``lm_head_norm``). vLLM reads a flat ``norm_output`` with the speculators meaning; SpecForge, which
  writes flat configs, is followed here.
* ``norm_output``, speculators configs (default false): true feeds the normed state back to the next step
  (``normed_feedback``); the logits are ``lm_head(norm(h))`` either way (speculators, vLLM ``llama_eagle3.py``).
* ``norm_before_residual``: the first residual is ``hidden_norm(hidden)``. A speculators config without the field
  means true (vLLM ``update_eagle3`` in ``speculators/algos.py``); a flat config without it means false (vLLM).
* ``fc_norm`` and ``norm_before_fc`` (extra norms before ``fc``) are refused.

Aux-layer ids. SpecFit stores ONE convention: the 0-based index of the target decoder layer whose OUTPUT is captured
(SpecForge's). The ids found in checkpoints (notes: eagle3.md §1.1) are converted:

* ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge / SGLang drafter configs): output-of-layer ids, kept.
  SpecForge ``resolve_eagle_capture_layers`` defaults to (1, N//2-1, N-4); SGLang ``set_eagle3_layers_to_capture``
  shifts explicit ids by +1 because it captures the *input* of a layer.
* top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM ``_get_eagle3_aux_layers_from_config``, speculators
  ``Eagle3SpeculatorConfig``): HF ``output_hidden_states`` indices, where index j is the output of layer j-1 (index 0
  is the embeddings), so id j becomes j-1. vLLM's default (2, N//2, N-3) is the same physical tensors as SpecForge's.
* absent: the EAGLE reference default, outputs of layers (1, N//2-1, N-4) of the N-layer target (it captures the
  input of layers 2, N//2, N-3 in ``modeling_*_kv.py``).

``aux_layer_convention="output"`` or ``"hidden_states"`` overrides where-found detection (sglang#25454 and vllm#43671
document checkpoints written for the other reader).

Finding and reading the files is ``checkpoint_files``; checking the tensors against the config and the target is
``checkpoint_checks``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from .checkpoint_checks import check_fit, check_keys, check_shapes, check_vocab_maps, fit_error
from .checkpoint_files import CONFIG_NAME, SAFETENSORS_NAME, locate, read_json, read_weights
from .drafter import Eagle3Config, Eagle3Drafter

# speculators writes transformer_layer_config with to_diff_dict(): fields equal to these LlamaConfig defaults are absent
_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}
IGNORED_KEYS = {"verifier_lm_head.weight", "verifier_norm.weight"}  # speculators: copies of the target's head / norm
# variants with extra norms before fc; their weights would not be used by this module
UNSUPPORTED_FLAGS = ("fc_norm", "norm_before_fc")
AUX_CONVENTIONS = ("auto", "output", "hidden_states")


def load_drafter(
    path_or_dir,
    target=None,
    aux_layer_convention: str = "auto",
    dtype: torch.dtype | None = None,
    device=None,
    num_target_layers: int | None = None,
) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter checkpoint and, when ``target`` is given, check that it fits and share its embedding.

    Args:
        path_or_dir: checkpoint folder, a weights file inside one, or a hub repo id (downloaded when not a local path).
        target: the transformers causal LM the drafter serves; its hidden size, layer count and vocab are checked.
        aux_layer_convention: "auto" (by where the ids are found, see the module docstring), "output" or
            "hidden_states".
        dtype: cast floating tensors to this dtype; None keeps the dtype of ``fc.weight`` in the checkpoint.
        device: where to put the drafter.
        num_target_layers: N for the default aux layers and the range check when no ``target`` is given.

    Raises:
        ValueError: missing / unexpected keys, shapes that contradict the config, or a drafter that does not fit the
            target (the message names the key and both shapes); an unreadable (truncated / corrupt) weights or config
            file (the message names the file).
        FileNotFoundError: no such folder or file, and (for an ``owner/name`` path) no hub repo that can be reached.
        NotImplementedError: a variant this module does not implement (norms before ``fc``, non-default RoPE,
            >1 layer).
    """
    if aux_layer_convention not in AUX_CONVENTIONS:
        raise ValueError(f"aux_layer_convention={aux_layer_convention!r}, expected one of {AUX_CONVENTIONS}")
    folder, weights_path = locate(path_or_dir)
    raw = read_json(folder / CONFIG_NAME)
    state = _normalize_keys(read_weights(weights_path))
    fields, ids, found_convention = _parse_config(raw)
    if fields["head_dim"] is None:
        q = state.get("midlayer.self_attn.q_proj.weight")
        if q is None:
            raise ValueError("drafter checkpoint lacks midlayer.self_attn.q_proj.weight")
        fields["head_dim"] = q.shape[0] // fields["num_attention_heads"]

    n_layers = target.config.num_hidden_layers if target is not None else num_target_layers
    convention = found_convention if aux_layer_convention == "auto" else aux_layer_convention
    if ids is not None and aux_layer_convention == "auto" and found_convention == "output" and ids[0] == 2:
        warnings.warn(
            f"eagle_config.eagle_aux_hidden_state_layer_ids={list(ids)} starts at 2: read as output-of-layer ids; "
            "if the checkpoint was written for capture-before readers (vLLM, sglang#25454) pass "
            "aux_layer_convention='hidden_states'",
            stacklevel=2,
        )
    config = Eagle3Config(**fields, aux_layer_ids=_resolve_aux_ids(ids, convention, n_layers))

    _complete_vocab_maps(state, config)
    check_keys(state)
    check_shapes(state, config)
    check_vocab_maps(state, config)
    if target is not None:
        check_fit(state, config, target)

    with torch.device("meta"):  # no random init of weights about to be replaced
        drafter = Eagle3Drafter(config, own_embedding="embed_tokens.weight" in state)
    dtype = dtype or state["fc.weight"].dtype
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    if device is not None:
        drafter.to(device)
    if target is not None and drafter.embed_tokens is None:
        drafter.set_embedding(target.get_input_embeddings())
    drafter.name_or_path = str(path_or_dir)  # where it came from, as transformers' models keep it (for remedies)
    return drafter


def save_drafter(drafter: Eagle3Drafter, out_dir, dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the SpecForge layout (``midlayer.*``, no shared embedding);
    ``dtype``: the floating-point weights in that dtype (e.g. ``torch.bfloat16`` to halve the file), else as they are.

    Raises:
        NotImplementedError: ``normed_feedback`` or ``norm_before_residual``, which SpecForge's EAGLE-3 model has no
            field for (a flat config's ``norm_output`` means ``lm_head_norm``).
    """
    from safetensors.torch import save_file

    c = drafter.config
    for name, field in (("normed_feedback", "norm_output"), ("norm_before_residual", "norm_before_residual")):
        if getattr(c, name):
            raise NotImplementedError(
                f"save_drafter writes the SpecForge layout, which has no field for {name}=true (speculators configs "
                f"write it as {field}); SpecForge's EAGLE-3 model would load this drafter without it"
            )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().to(dtype if dtype is not None and v.is_floating_point() else v.dtype).contiguous()
             for k, v in drafter.state_dict().items()}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype or drafter.fc.weight.dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True},
    }
    if not c.lm_head_norm:  # SpecForge's default is true; written only when false, as vLLM reads the field otherwise
        config["norm_output"] = False
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state, str(out / SAFETENSORS_NAME), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------------- layouts


def _normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``model.``, rename ``layers.0.`` to ``midlayer.``, drop the speculators copies of the target's head."""
    out = {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if name in IGNORED_KEYS or name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE table
            continue
        if name in out:
            raise ValueError(f"drafter checkpoint has {name} twice (keys {key!r} and another spelling)")
        out[name] = value
    return out


def _parse_config(raw: dict) -> tuple[dict, tuple[int, ...] | None, str]:
    """config.json -> (Eagle3Config fields except aux_layer_ids, raw aux ids or None, their convention)."""
    speculators = raw.get("speculators_model_type")
    if speculators is not None:
        if speculators != "eagle3":
            raise NotImplementedError(f"speculators_model_type={speculators!r}; only 'eagle3' is supported")
        layer = raw.get("transformer_layer_config") or {}
        ids, convention = raw.get("eagle_aux_hidden_state_layer_ids"), "hidden_states"
    else:
        layer = raw
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise NotImplementedError("eagle_config.use_aux_hidden_state=false is an EAGLE-1/2 drafter, not EAGLE-3")
        if eagle.get("eagle_aux_hidden_state_layer_ids") is not None:
            ids, convention = eagle["eagle_aux_hidden_state_layer_ids"], "output"
        else:  # vLLM-style flat configs put the HF hidden-state indices at the top level
            ids, convention = raw.get("eagle_aux_hidden_state_layer_ids"), "hidden_states"
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag) or layer.get(flag):
            raise NotImplementedError(f"drafter variant with {flag}=true is not supported")
    if speculators is not None:  # speculators Eagle3SpeculatorConfig fields, read as vLLM's update_eagle3 does
        norms = {"norm_before_residual": bool(raw.get("norm_before_residual", True)), "lm_head_norm": True,
                 "normed_feedback": bool(raw.get("norm_output", False))}
    else:  # SpecForge LlamaForCausalLMEagle3: norm_output (default true) is whether lm_head reads norm(h)
        norms = {"norm_before_residual": bool(raw.get("norm_before_residual", False)),
                 "lm_head_norm": bool(raw.get("norm_output", True)), "normed_feedback": False}
    if layer.get("num_hidden_layers", 1) != 1:
        raise NotImplementedError(f"drafters with num_hidden_layers={layer['num_hidden_layers']} are not supported")

    layer = {**_LLAMA_DEFAULTS, **{k: v for k, v in layer.items() if v is not None or k == "head_dim"}}
    rope = layer.get("rope_parameters") or {}
    rope_scaling = layer.get("rope_scaling")
    if rope.get("rope_type", "default") != "default":
        rope_scaling = rope
    vocab = layer["vocab_size"]
    fields = {
        "hidden_size": layer["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer.get("num_key_value_heads") or layer["num_attention_heads"],
        "head_dim": layer.get("head_dim"),
        "rms_norm_eps": layer["rms_norm_eps"],
        "rope_theta": float(rope.get("rope_theta", layer["rope_theta"])),
        "max_position_embeddings": layer["max_position_embeddings"],
        "vocab_size": vocab,
        "draft_vocab_size": raw.get("draft_vocab_size") or vocab,
        "target_hidden_size": raw.get("target_hidden_size") or layer.get("target_hidden_size") or layer["hidden_size"],
        "hidden_act": layer["hidden_act"],
        "rope_scaling": rope_scaling,
        **norms,
    }
    return fields, (tuple(int(i) for i in ids) if ids is not None else None), convention


def _resolve_aux_ids(ids, convention: str, num_target_layers: int | None) -> tuple[int, int, int]:
    """Checkpoint ids in ``convention`` -> output-of-layer ids; the reference default when absent."""
    if ids is None:
        if num_target_layers is None:
            raise ValueError(
                "the drafter config has no eagle_aux_hidden_state_layer_ids; pass target= or num_target_layers= to "
                "use the default (1, N//2-1, N-4)"
            )
        found, out = "the default (1, N//2-1, N-4)", Eagle3Config.default_aux_layer_ids(num_target_layers)
    else:
        if len(ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(ids)}: expected 3 ids")
        found, out = f"eagle_aux_hidden_state_layer_ids={list(ids)} ({convention} convention)", tuple(ids)
        if convention == "hidden_states":
            if min(ids) < 1:
                raise ValueError(f"{found}: HF hidden-state index 0 is the embeddings, not a decoder layer output")
            out = tuple(i - 1 for i in ids)
        if list(out) != sorted(out):
            warnings.warn(
                f"{found}: not in ascending order; vLLM, SGLang and EAGLE concatenate the captured layers in ascending "
                f"layer order, so the features are fused as output-of-layer ids {tuple(sorted(out))}",
                stacklevel=3,
            )
            out = tuple(sorted(out))
    if num_target_layers is not None and not all(0 <= i < num_target_layers for i in out):
        raise fit_error(
            f"{found} gives output-of-layer ids {out}, expected ids in [0, num_hidden_layers={num_target_layers})"
        )
    return out


def _complete_vocab_maps(state: dict, c: Eagle3Config) -> None:
    """A full-vocab drafter's maps are the identity (EAGLE's loader drops the saved ones). Normalise their dtypes."""
    if c.draft_vocab_size == c.vocab_size:
        v = c.vocab_size
        d2t, t2d = state.get("d2t"), state.get("t2d")
        identity = (d2t is None or (d2t.shape == (v,) and not bool(d2t.any()))) and (
            t2d is None or (t2d.shape == (v,) and bool(t2d.bool().all())))
        if not identity:
            seen = f"{d2t.shape[0]} " if d2t is not None and d2t.dim() == 1 else ""
            warnings.warn(
                f"d2t/t2d ignored: draft_vocab_size == vocab_size = {v}, so the draft vocabulary is the target's (the "
                f"EAGLE trainer saves maps over the {seen}ids it saw; EAGLE's own loader drops them too)",
                stacklevel=3,
            )
        state["d2t"] = torch.zeros(v, dtype=torch.long)
        state["t2d"] = torch.ones(v, dtype=torch.bool)
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()

