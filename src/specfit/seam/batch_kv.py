"""A batch's KV cache when its rows accept different numbers of tokens: one common length, holes masked.

Every row of a ``DynamicCache`` has the same length. After a verify forward wrote ``q`` positions per row at
``base..base+q-1``, row ``b`` keeps its accepted path (``keep[b]``, tree indices); the kept entries move to
``base..base+m_b-1`` and the cache keeps ``M = max_b m_b`` new positions: row b's last ``M - m_b`` are holes that a
boolean ``valid`` [B, length] mask hides from every later query (exactly as left padding hides a short prompt's
front). A finished row leaves the batch (``drop_rows``): it costs nothing more.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

__all__ = ["check_batch_cache", "keep_rows_kv", "drop_rows", "batch_tree_mask"]


def check_batch_cache(cache) -> None:
    """A batch is verified on a dynamic cache of full-attention layers (a sliding window would evict committed
    positions at a different place in every row)."""
    if not isinstance(cache, DynamicCache) or any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError(f"assistant decoding of a batch (more than one row) runs on the default dynamic cache of "
                         f"full-attention layers; got {type(cache).__name__}"
                         + (" with sliding-window layers" if isinstance(cache, DynamicCache) else "")
                         + ": pass one prompt at a time, or drop assistant= for this model")


def keep_rows_kv(cache: DynamicCache, base: int, keep: torch.Tensor) -> None:
    """``keep`` [B, M] tree indices on the device (row b's accepted path, padded to M with any index): position
    ``base + j`` of row b becomes what ``base + keep[b, j]`` held; the cache is cut to ``base + M``."""
    rows, m = keep.shape
    for layer in cache.layers:
        heads, dim = layer.keys.shape[1], layer.keys.shape[-1]
        idx = (base + keep.to(layer.keys.device))[:, None, :, None].expand(rows, heads, m, dim)  # [B, h, M, D]
        kept_k, kept_v = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        layer.keys[:, :, base:base + m] = kept_k
        layer.values[:, :, base:base + m] = kept_v
        layer.keys, layer.values = layer.keys[:, :, :base + m], layer.values[:, :, :base + m]


def drop_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only ``rows`` ([r] batch indices on the device) of every layer."""
    for layer in cache.layers:
        idx = rows.to(layer.keys.device)
        layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)


def batch_tree_mask(valid: torch.Tensor, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, q, K + q] additive mask: every query of row b sees the committed positions ``valid[b]`` ([B, K] bool)
    and its ancestors-or-self among the row's q tree positions (``ancestors`` [B, q, q] bool; a padding query sees
    itself only)."""
    rows, q = ancestors.shape[:2]
    seen = torch.cat([valid[:, None, :].expand(rows, q, valid.shape[1]), ancestors], dim=2)  # [B, q, K + q]
    mask = torch.zeros(seen.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min)[:, None]
