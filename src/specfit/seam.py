"""The one file that touches transformers internals.

Everything here relies on details of transformers 5.x that are not public API: the experts-implementation registry
and ``config._experts_implementation``, the layout of Qwen3-MoE decoder layers, and the tensors inside cache layers.
(The private ``_sample`` method that ``generate()`` dispatches to is named in ``decoding/strategy.py``, the one class
that overrides it.) When transformers moves, this file moves. It is the bottom layer: it imports nothing of SpecFit's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.integrations.moe import ExpertsInterface

EXPERTS_IMPL = "specfit"


def register_experts_implementation(forward) -> None:
    """Make ``"specfit"`` a name in transformers' experts interface, bound to ``forward`` (idempotent)."""
    ExpertsInterface.register(EXPERTS_IMPL, forward)


# --- Model structure ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoELayer:
    layer: int  # decoder layer index
    experts: nn.Module  # has gate_up_proj [E, 2I, H] and down_proj [E, H, I] (or had, before enable)
    gate: nn.Module  # the router

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def hidden(self) -> int:
        return self.experts.hidden_dim

    @property
    def intermediate(self) -> int:
        return self.experts.intermediate_dim

    @property
    def top_k(self) -> int:
        return self.gate.top_k


def expert_activation(experts: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """[S, 2I] gate/up projections -> [S, I], with the experts module's own gating (act(gate) * up)."""
    return experts._apply_gate(gate_up_out)


def compute_dtype(model) -> torch.dtype:
    """The dtype of the model's activations; tree masks are built in it (an additive float mask)."""
    return model.get_input_embeddings().weight.dtype


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers`; SpecFit supports decoder-only causal LMs "
                         f"such as Qwen3MoeForCausalLM")
    return layers


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The sparse MoE blocks of a Qwen3-MoE-style model, in layer order."""
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
        if experts is None or gate is None:
            continue
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or \
                not getattr(experts, "is_concatenated", True) or not getattr(experts, "has_gate", True):
            raise ValueError(f"layer {i}: {type(experts).__name__} uses a layout SpecFit does not support (bias, "
                             f"transposed or interleaved gate/up); supported: Qwen3-MoE fused gate_up_proj/down_proj")
        found.append(MoELayer(i, experts, gate))
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE layers (no `mlp.experts` + `mlp.gate` in "
                         f"model.layers); SpecFit offloads routed experts of models such as Qwen3MoeForCausalLM")
    return found


def experts_implementation(model) -> str | None:
    return model.config._experts_implementation


def set_experts_implementation(model, name: str, forward=None) -> None:
    """Select experts implementation ``name``; for ``"specfit"``, ``forward`` is the function it names."""
    if name == EXPERTS_IMPL:
        if forward is None:
            raise ValueError("the 'specfit' experts implementation needs its forward function")
        register_experts_implementation(forward)
    model.set_experts_implementation(name)


# --- KV cache -------------------------------------------------------------------------------------------------
def kv_length(cache: Cache) -> int:
    """Number of committed positions in the cache."""
    return int(cache.get_seq_length())


def kv_capacity(cache: Cache, needed: int) -> int:
    """Key/value length the attention sees after writing ``needed`` more positions (the mask's last dimension)."""
    if isinstance(cache, StaticCache):
        return cache.layers[0].max_cache_len
    return kv_length(cache) + needed


def keep_kv(cache: Cache, base: int, keep: torch.Tensor) -> None:
    """After a tree forward wrote positions base.., keep only ``base + keep`` ([n] tree indices, ascending) so
    they become contiguous positions base..base+n-1."""
    n = keep.numel()
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            src = (base + keep).to(layer.keys.device)
            dst = torch.arange(base, base + n, device=layer.keys.device)
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
            layer.cumulative_length.fill_(base + n)
    elif isinstance(cache, DynamicCache):
        for layer in cache.layers:
            idx = torch.cat([torch.arange(base, device=layer.keys.device), base + keep.to(layer.keys.device)])
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)
    else:
        raise TypeError(f"SpecFit compacts DynamicCache and StaticCache, got {type(cache).__name__}")


def crop_kv(cache: Cache, length: int) -> None:
    """Drop every position from ``length`` on."""
    extra = kv_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def ensure_room(model, cache: Cache, needed: int) -> Cache:
    """A tree forward writes past the committed length; a static cache sized by generate() for max_length alone is
    too short. Replace such a cache (still empty) with one of ``needed`` positions; refuse a user's cache that is too
    short."""
    if not isinstance(cache, StaticCache) or cache.layers[0].max_cache_len >= needed:
        return cache
    if getattr(cache, "_is_user_defined", False):
        raise ValueError(f"the StaticCache passed to generate() holds {cache.layers[0].max_cache_len} positions; tree "
                         f"decoding needs {needed} (max_length + draft pool + 1)")
    return StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=needed)


def check_cache(cache) -> None:
    """Tree decoding compacts full-attention Dynamic/Static caches that start empty."""
    if not isinstance(cache, (DynamicCache, StaticCache)):
        raise TypeError(f"SpecFit's tree decoding supports DynamicCache and StaticCache, got {type(cache).__name__}; "
                        f"use the default cache or cache_implementation='static'")
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError("SpecFit's tree decoding does not support sliding-window cache layers")
    if kv_length(cache) > 0:
        raise ValueError(f"assistant decoding starts from an empty cache; the cache given holds {kv_length(cache)} "
                         f"positions (pass the whole sequence as input_ids instead)")


def check_attention(model) -> None:
    """Tree verification needs an attention that honours a 4-D additive float mask."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"tree verification needs attn_implementation 'sdpa' or 'eager' (a 4-D additive mask), the "
                         f"model uses {impl!r}; load it with attn_implementation='sdpa'")
