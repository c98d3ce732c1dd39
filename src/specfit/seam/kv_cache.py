"""What tree decoding needs of the KV cache and the attention: the cache's length and room, keeping the accepted
path's entries (``keep_kv``) and dropping the rest (``crop_kv``), masks per layer type, and the checks that refuse
caches and attention SpecFit cannot verify a tree with.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache

__all__ = ["ATTENTION_LAYER_TYPES", "kv_length", "kv_capacity", "keep_kv", "crop_kv", "ensure_room", "layer_masks",
           "check_cache", "check_layer_types", "check_attention"]

# Layer types whose cache SpecFit's tree decoding can compact (KV attention); anything else in config.layer_types
# (linear attention, mamba, conv, ...) carries recurrent state that cannot verify a tree from one state.
ATTENTION_LAYER_TYPES = ("full_attention", "attention", "sliding_attention", "chunked_attention")


def kv_length(cache: Cache) -> int:
    """Number of committed positions in the cache."""
    return int(cache.get_seq_length())


def kv_capacity(cache: Cache, needed: int, length: int | None = None) -> int:
    """Key/value length the attention sees after writing ``needed`` more positions (the mask's last dimension);
    ``length``: the committed positions when the caller knows them (a StaticCache's count lives on the device)."""
    if isinstance(cache, StaticCache):
        return cache.layers[0].max_cache_len
    return (kv_length(cache) if length is None else length) + needed


def keep_kv(cache: Cache, base: int, keep: torch.Tensor) -> None:
    """After a tree forward wrote positions base.., keep only ``base + keep`` ([n] tree indices on the device,
    ascending) so they become contiguous positions base..base+n-1. Only the tree's tail moves: O(n), not O(context)."""
    n = keep.numel()
    if isinstance(cache, StaticCache):
        dst = None
        for layer in cache.layers:
            if dst is None or dst.device != layer.keys.device:
                src = base + keep.to(layer.keys.device)
                dst = torch.arange(base, base + n, device=layer.keys.device)
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
            layer.cumulative_length.fill_(base + n)
    elif isinstance(cache, DynamicCache):
        for layer in cache.layers:
            # a sliding layer (past recording on, see ensure_room) holds only its window's tail of the committed
            # positions before the tree's; a full layer holds all of them (old == base)
            written = layer.cumulative_length - base if _is_sliding(layer) else layer.keys.shape[-2] - base
            old = layer.keys.shape[-2] - written
            idx = old + keep.to(layer.keys.device)
            kept_k, kept_v = layer.keys.index_select(2, idx), layer.values.index_select(2, idx)  # [B, h, n, D]
            layer.keys[:, :, old:old + n] = kept_k  # in place: the committed prefix does not move
            layer.values[:, :, old:old + n] = kept_v
            layer.keys, layer.values = layer.keys[:, :, :old + n], layer.values[:, :, :old + n]
            if _is_sliding(layer):
                layer.cumulative_length = base + n
                window = layer.sliding_window - 1  # all the next forward needs
                layer.keys, layer.values = layer.keys[:, :, -window:], layer.values[:, :, -window:]
    else:
        raise TypeError(f"SpecFit compacts DynamicCache and StaticCache, got {type(cache).__name__}")


def crop_kv(cache: Cache, length: int, current: int | None = None) -> None:
    """Drop every position from ``length`` on; ``current``: the positions now in the cache, when the caller knows
    them (a StaticCache's count lives on the device: reading it would stop the host)."""
    extra = (kv_length(cache) if current is None else current) - length
    if extra > 0:
        cache.crop(-extra)


def _is_sliding(layer) -> bool:
    return bool(getattr(layer, "is_sliding", False))


def _dict_masks(model) -> bool:
    """Whether the model takes ``attention_mask`` as a dict keyed by ``config.layer_types`` (GPT-OSS, Llama-4,
    Qwen2-MoE, dots1 do; models without ``layer_types`` build one mask for every layer)."""
    return bool(getattr(model.config.get_text_config(decoder=True), "layer_types", None))


def ensure_room(model, cache: Cache, needed: int) -> Cache:
    """Prepare an empty cache for tree decoding up to ``needed`` positions (max_length + draft pool + 1).

    A static cache sized by generate() for max_length alone is too short: replace it (still empty) with one of
    ``needed`` positions; refuse a user's cache that is too short. Sliding-window layers record their past, so a tree
    forward never evicts committed positions before compaction (``keep_kv`` trims them back to the window); models
    that cannot take a per-layer-type mask are refused if a window is shorter than ``needed``."""
    sliding = [layer for layer in cache.layers if _is_sliding(layer)]
    if sliding:
        short = min(layer.sliding_window for layer in sliding)
        if not _dict_masks(model) and short <= needed:
            raise ValueError(f"{type(model).__name__} has sliding-window attention (window {short}) and takes one "
                             f"attention mask for every layer, so tree verification is exact only while a sequence "
                             f"stays inside the window; this generate() needs {needed} positions (max_length + draft "
                             f"pool + 1). Lower max_length, or use generate() without assistant=")
        config = model.config.get_text_config(decoder=True)
        if getattr(config, "attn_temperature_tuning", False) and needed >= getattr(config, "floor_scale", needed):
            raise ValueError(f"{type(model).__name__}'s NoPE layers scale attention by the cache length, not the "
                             f"positions of tree nodes; tree verification is exact below floor_scale="
                             f"{config.floor_scale} positions, this generate() needs {needed}")
        cache.activate_past_recording()
    if not isinstance(cache, StaticCache) or cache.layers[0].max_cache_len >= needed:
        return cache
    if getattr(cache, "_is_user_defined", False):
        raise ValueError(f"the StaticCache passed to generate() holds {cache.layers[0].max_cache_len} positions; tree "
                         f"decoding needs {needed} (max_length + draft pool + 1)")
    return StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=needed)


def layer_masks(model, cache: Cache, mask: torch.Tensor, position_ids: torch.Tensor):
    """The tree mask [1, 1, q, kv] (full attention) for every layer type of the model: unchanged without
    sliding-window layers; else a dict keyed by ``config.layer_types`` in which sliding (``j > p - W``) and chunked
    (``j // C == p // C``) layers see only their window, each sliced to the key span its cache layer returns. Call
    before the forward that writes the tree (the spans depend on the cache length)."""
    layer_types = list(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])
    if not any(_is_sliding(layer) for layer in cache.layers) or not layer_types:
        return mask
    q, kv = mask.shape[-2:]
    base = kv - q
    kv_pos = torch.cat([torch.arange(base, device=mask.device), position_ids[0].to(mask.device)])  # [kv]
    q_pos = position_ids[0].to(mask.device)[:, None]  # [q, 1]
    masks = {}
    for i, kind in enumerate(layer_types):
        if kind in masks:
            continue
        layer = cache.layers[i]
        if not _is_sliding(layer):
            masks[kind] = mask
            continue
        window = layer.sliding_window
        visible = kv_pos[None] // window == q_pos // window if kind == "chunked_attention" else \
            kv_pos[None] > q_pos - window  # [q, kv]
        length, offset = layer.get_mask_sizes(q)
        windowed = mask.masked_fill(~visible, torch.finfo(mask.dtype).min)
        masks[kind] = windowed[..., offset:offset + length]
    return masks


def check_cache(cache) -> None:
    """Tree decoding compacts Dynamic caches (full and sliding-window layers) and full-attention Static caches,
    starting empty."""
    if not isinstance(cache, (DynamicCache, StaticCache)):
        raise TypeError(f"SpecFit's tree decoding supports DynamicCache and StaticCache, got {type(cache).__name__}; "
                        f"use the default cache or cache_implementation='static'")
    if isinstance(cache, StaticCache) and any(_is_sliding(layer) for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers if _is_sliding(layer)})
        raise ValueError(f"SpecFit's tree decoding does not compact static sliding-window cache layers ({kinds}); "
                         f"use the default dynamic cache (no cache_implementation='static')")
    if kv_length(cache) > 0:
        raise ValueError(f"assistant decoding starts from an empty cache; the cache given holds {kv_length(cache)} "
                         f"positions (pass the whole sequence as input_ids instead)")


def check_layer_types(model) -> None:
    """Tree decoding verifies many positions from one cache state and then compacts it; refuse, naming the layer
    type, models whose layers carry recurrent state (linear attention, mamba, ...) or that build a cache of their
    own. Plain generate() with offloaded experts is unaffected."""
    config = model.config.get_text_config(decoder=True)
    layer_types = list(getattr(config, "layer_types", None) or [])
    recurrent = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    name = type(model).__name__
    if recurrent or getattr(model, "_is_stateful", False):
        kinds = ", ".join(repr(t) for t in recurrent) or "stateful (recurrent) layers"
        raise ValueError(f"{name} has {kinds} layers (config.layer_types): their recurrent state cannot verify a "
                         f"draft tree from one state, so assistants (tree speculative decoding) are not supported for "
                         f"it. Use generate() without assistant=: the offloaded experts stay exact")
    if not model._supports_default_dynamic_cache():
        raise ValueError(f"{name} builds a cache of its own inside forward (transformers' "
                         f"_supports_default_dynamic_cache() is False), which SpecFit cannot compact; assistants are "
                         f"not supported for it. Use generate() without assistant=: the offloaded experts stay exact")


def check_attention(model) -> None:
    """Tree verification needs an attention that honours a 4-D additive float mask, and KV-attention layers only."""
    check_layer_types(model)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa"):
        load = "attn_implementation='sdpa'" if getattr(type(model), "_supports_sdpa", False) else \
            f"attn_implementation='eager' ({type(model).__name__} does not support sdpa)"
        raise ValueError(f"tree verification needs attn_implementation 'sdpa' or 'eager' (a 4-D additive mask), the "
                         f"model uses {impl!r}; load it with {load}")
