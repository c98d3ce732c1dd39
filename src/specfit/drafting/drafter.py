"""The EAGLE-3 drafter as a plain torch module: one Llama-style decoder layer over (token embedding, target feature).

Input pairing (EAGLE-3 reference, SpecForge, vLLM): at drafter position i the drafter consumes the target's feature of
token i and the embedding of token i+1, and predicts token i+2. With context tokens t_0..t_L, where t_L is the token
the target produced last, the context pairs are (f_p, t_{p+1}) for p = 0..L-1 at RoPE positions p, and position L-1
predicts t_{L+1}. Drafting goes on by feeding each drafted token at the position after the one that predicted it,
paired with that position's output as ``hidden`` (width H, ``fc`` skipped): the token drafted at L-1 is fed
at position L, its child at L+1, and so on (siblings share a position; a tree mask keeps them apart).

Target features are the outputs of three target decoder layers, concatenated in ascending layer order as vLLM, SGLang
and EAGLE do (``aux_layer_ids``, 0-based output-of-layer ids, kept sorted; see ``formats`` for the other conventions).

Norm variants (flags of ``Eagle3Config``; the defaults are the standard EAGLE-3 drafter), with ``h`` the midlayer
output: ``lm_head_norm`` false scores ``lm_head(h)`` instead of ``lm_head(norm(h))`` (SpecForge ``norm_output:
false``); ``normed_feedback`` feeds ``norm(h)`` back instead of ``h`` (speculators / vLLM ``norm_output: true``);
``norm_before_residual`` makes ``hidden_norm(hidden)`` the first residual instead of ``hidden`` (speculators / vLLM).

Vocabulary: ``lm_head`` scores a reduced draft vocabulary of Vd ids. ``d2t[d]`` is an OFFSET (target id = d + d2t[d])
and ``t2d[v]`` marks the target ids that are in the draft vocabulary. The embedding is the target's (vocab V).

Shape legend: B batch, T new positions, S = len(cache) + T keys, H drafter hidden, Ht target hidden,
nh / nkv query / key-value heads, D head_dim, I intermediate size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class Eagle3Config:
    """Shapes and constants of one EAGLE-3 drafter."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the TARGET vocab: rows of the shared embedding, length of t2d
    draft_vocab_size: int  # rows of lm_head, length of d2t
    target_hidden_size: int  # fc reads 3 * this
    aux_layer_ids: tuple[int, int, int]  # 0-based target decoder layers whose OUTPUT is captured; stored ascending
    hidden_act: str = "silu"
    rope_scaling: dict | None = None  # only None / rope_type "default" is implemented
    norm_before_residual: bool = False  # the first residual is hidden_norm(hidden), not hidden
    lm_head_norm: bool = True  # lm_head reads norm(h); False: the un-normed h
    normed_feedback: bool = False  # the next step receives norm(h), not h

    def __post_init__(self):
        # features are concatenated in ascending layer order (vLLM, SGLang, EAGLE test membership in a walk over the
        # layers), so the listed order carries no meaning; a repeated id is captured twice here (those readers would
        # capture it once)
        self.aux_layer_ids = tuple(sorted(int(i) for i in self.aux_layer_ids))
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must hold 3 layer ids (low, mid, high), got {self.aux_layer_ids}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        if 3 * self.target_hidden_size == self.hidden_size:
            # forward() tells fused target features from fed-back drafter states by their width
            raise ValueError(f"3*target_hidden_size equals hidden_size={self.hidden_size}: inputs would be ambiguous")

    @staticmethod
    def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
        """The EAGLE reference choice for an N-layer target: outputs of layers 1, N//2-1, N-4 (sorted, for small N)."""
        n = num_target_layers
        return tuple(sorted((1, n // 2 - 1, n - 4)))

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, intermediate_size: int | None = None) -> Eagle3Config:
        """A drafter shaped like one layer of ``target_config`` (a transformers config), with the default aux layers."""
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        heads = c.num_attention_heads
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=intermediate_size or c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
            max_position_embeddings=c.max_position_embeddings,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=c.hidden_size,
            aux_layer_ids=cls.default_aux_layer_ids(c.num_hidden_layers),
            hidden_act=getattr(c, "hidden_act", "silu"),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        return cls(**d)


class DraftCache:
    """The drafter's own one-layer KV cache: post-RoPE ``keys`` / ``values`` [B, nkv, S, D]."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [B, nkv, T, D] keys/values after the cached ones; returns the whole cache."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop drafted nodes, keep the context)."""
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]


class RMSNorm(nn.Module):
    """HF-style RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # the same arithmetic without two no-op casts (each a torch call)
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


_INV_FREQ: dict = {}  # (head_dim, theta, device) -> inv_freq [D/2]: the same for every call


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Default RoPE tables for [B, T] positions -> cos, sin [B, 1, T, D] (computed in fp32, like HF)."""
    key = (head_dim, theta, position_ids.device)
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim
        inv_freq = _INV_FREQ[key] = 1.0 / theta**exponent  # [D/2]
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, nkv, S, D] -> [B, nkv * n_rep, S, D], each kv head repeated for its query group (GQA)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Eagle3Attention(nn.Module):
    """Projections of the midlayer attention; the attention pattern itself is passed in (cache or TTT)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.head_dim, self.rope_theta = c.head_dim, c.rope_theta
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor, position_ids: torch.Tensor):
        """x [B, T, 2H] -> q [B, nh, T, D], k / v [B, nkv, T, D], RoPE applied to q and k."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def output(self, a: torch.Tensor) -> torch.Tensor:
        """a [B, nh, T, D] -> [B, T, H]."""
        b, _, t, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        if c.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"hidden_act={c.hidden_act!r} is not supported (known: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[c.hidden_act]
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# attend(q [B,nh,T,D], k [B,nkv,T,D], v [B,nkv,T,D]) -> [B,nh,T,D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Layer(nn.Module):
    """The single EAGLE-3 decoder layer ("midlayer"); attribute names follow SpecForge so state-dict keys match."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, attend: Attend):
        """emb, hidden [B, T, H] -> pre-norm output [B, T, H]. The residual is ``hidden`` (``hidden_norm(hidden)`` with
        ``norm_before_residual``)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(emb), normed], dim=-1)  # [B, T, 2H], embedding first
        q, k, v = self.self_attn.project(x, position_ids)
        h = residual + self.self_attn.output(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


def _cached_attention(q, k, v, cache: DraftCache | None, mask: torch.Tensor | None) -> torch.Tensor:
    if cache is not None:
        k, v = cache.append(k, v)
    t, s = q.shape[2], k.shape[2]
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if mask is None:
        if s == t:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # bottom-right aligned causal: new token j sees every cached position and new tokens <= j
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    else:
        if mask.dim() != 4 or mask.shape[-2:] != (t, s):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected [B, 1, {t}, len(cache)+T={s}]")
        if mask.is_floating_point():
            mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter: ``fc`` fuses the 3 target features, one ``midlayer``, ``norm`` and a draft-vocab ``lm_head``.

    The token embedding is the target's, shared by reference through :meth:`set_embedding` (not a submodule, so it is
    neither saved nor moved with the drafter), unless the drafter owns ``embed_tokens`` (``own_embedding=True``, for
    checkpoints that ship ``embed_tokens.weight``).
    """

    def __init__(self, config: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        rope_type = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope type {rope_type!r} is not supported; only default RoPE is implemented")
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # identity-like maps until a real draft vocabulary is loaded: draft id d <-> target id d
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        self._shared_embedding: nn.Module | None = None

    def set_embedding(self, embedding: nn.Module) -> None:
        """Share the target's input embedding ([V, H]); kept as a plain reference, not registered."""
        if self.embed_tokens is not None:
            raise ValueError("this drafter owns its embedding (embed_tokens.weight); it does not share the target's")
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(embedding.weight.shape) != expected:
            raise ValueError(
                f"target embedding has shape {tuple(embedding.weight.shape)}, expected "
                f"(vocab_size={expected[0]}, hidden_size={expected[1]})"
            )
        object.__setattr__(self, "_shared_embedding", embedding)  # bypass nn.Module registration

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] token ids -> [B, T, H] embeddings in the drafter's dtype and device."""
        emb = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding
        if emb is None:
            raise RuntimeError("no embedding: call drafter.set_embedding(target.get_input_embeddings())")
        w = self.fc.weight
        return emb(input_ids.to(emb.weight.device)).to(device=w.device, dtype=w.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Midlayer outputs [B, T, H] -> draft-vocab logits [B, T, Vd]."""
        return self.lm_head(self.norm(hidden) if self.config.lm_head_norm else hidden)

    def head(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Midlayer outputs [B, T, H] -> (logits [B, T, Vd], the states fed back to the next step [B, T, H])."""
        normed = self.norm(h)
        logits = self.lm_head(normed if self.config.lm_head_norm else h)
        return logits, (normed if self.config.normed_feedback else h)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass over T new positions.

        Args:
            input_ids: [B, T] token ids (target vocab): the token AFTER the one each feature belongs to.
            hidden: [B, T, 3*Ht] fused target features (``fc`` is applied) or [B, T, H] drafter states fed back at
                depth > 1 (``fc`` is skipped).
            position_ids: [B, T] RoPE positions.
            cache: the drafter's KV cache; the new keys/values are appended to it.
            attention_mask: additive float mask [B, 1, T, len(cache)+T] (0 attend, finfo.min masked), e.g. a tree
                mask; None means causal attention over the cache and the new positions.

        Returns:
            logits [B, T, Vd] over the draft vocab and the states to feed back [B, T, H]: the pre-norm midlayer
            output, or its ``norm`` with ``normed_feedback``.
        """
        c = self.config
        hidden = hidden.to(self.fc.weight.dtype)
        if hidden.shape[-1] == 3 * c.target_hidden_size:
            hidden = self.fc(hidden)  # fused target features (depth 1)
        elif hidden.shape[-1] != c.hidden_size:
            raise ValueError(
                f"hidden has width {hidden.shape[-1]}, expected 3*target_hidden_size={3 * c.target_hidden_size} "
                f"(target features) or hidden_size={c.hidden_size} (drafter states)"
            )
        def attend(q, k, v):
            return _cached_attention(q, k, v, cache, attention_mask)

        h = self.midlayer(self.embed(input_ids), hidden, position_ids, attend)
        return self.head(h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids (``d2t`` holds offsets; all zeros when the vocabularies coincide)."""
        return draft_ids + self.d2t[draft_ids]
