"""The ``"specfit"`` experts implementation: an experts forward that reads expert weights through the slot cache
instead of the module's own (released) parameters.

Compute is batched per *group* of experts that become ready together (``LayerCache.fetch_groups``): the resident
experts, then the loaded ones, then each streamed one. A group runs as a few batched calls whatever its size (its
experts' rows padded to the busiest expert's count), so a forward costs a few torch calls per layer, not a few per
expert; the hits' compute still runs while the misses copy.

The result does not depend on which experts were resident: every (token, k) contribution is written to its own row
and the k rows of a token are summed in a fixed order at the end, as transformers' batched path does.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .. import seam

ATTR = "_specfit"  # attribute on each patched experts module, pointing to its LayerRuntime


class LayerRuntime:
    def __init__(self, runtime, index: int, cache):
        # runtime: the SpecFitRuntime (model.specfit); cache: this layer's LayerCache; index: 0-based among MoE layers
        self.runtime, self.index, self.cache = runtime, index, cache

    def _untracked(self, needed: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
        arena = self.runtime.store.arenas[self.index]  # measurement path: no slots, no counters, no emulated link
        yield needed, arena[needed].to(self.cache.engine.device, non_blocking=False)

    def forward(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        num_tokens, top_k = top_k_index.shape
        rt.routes.record(self.index, top_k_index)
        flat = top_k_index.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # [T*k] (token, k) positions grouped by expert
        # the one planned host sync per layer: the routes' single transfer to the host (a CUDA bincount would add two
        # more, hidden: it reads min and max on the host); the grouping `order` stays on the device
        counts = torch.bincount(flat.cpu(), minlength=rt.store.num_experts).tolist()
        starts, needed, s = {}, [], 0
        for e, c in enumerate(counts):
            if c:
                starts[e] = (s, c)
                needed.append(e)
                s += c
        rows = hidden_states[order // top_k]  # [T*k, H] inputs in expert order
        grouped = torch.empty_like(rows)  # [T*k, H] outputs in expert order
        source = self._untracked(needed) if rt.untracked else self.cache.fetch_groups(needed, rt.forward_counters)
        for experts, weights in source:
            parts = rt.store.layout.split_batch(weights)  # one expert's math is the family's: seam
            spans = [starts[e] for e in experts]
            width = max(c for _, c in spans)  # each expert's rows padded to the busiest one's (with a repeated row)
            take = [st + min(j, c - 1) for st, c in spans for j in range(width)]
            dest = [st + j for st, c in spans for j in range(c)]
            x = rows[take[0]:take[0] + len(take)] if _is_run(take) else rows[take]  # [n*C, H]
            y = seam.experts_forward_batched(module, x.view(len(experts), width, -1), *parts).view(len(take), -1)
            if len(dest) < len(take):  # drop the padding rows
                y = y[[g * width + j for g, (_, c) in enumerate(spans) for j in range(c)]]
            _put(grouped, dest, y)
        out = torch.empty_like(grouped)
        out[order] = grouped  # back to (token, k) order
        out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(num_tokens, top_k, -1).sum(dim=1)


def _is_run(index: list[int]) -> bool:
    return index == list(range(index[0], index[0] + len(index)))


def _put(dst: torch.Tensor, index: list[int], values: torch.Tensor) -> None:
    """dst[index] = values, as a slice copy when the index is a run."""
    if _is_run(index):
        dst[index[0]:index[0] + len(index)] = values
    else:
        dst[index] = values


def specfit_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Registered in transformers' experts interface as ``"specfit"``; ``self`` is the experts module."""
    layer = getattr(self, ATTR, None)
    if layer is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the 'specfit' experts implementation but has no SpecFit runtime attached; "
            f"use specfit.enable(model, ...) rather than setting the implementation by hand")
    return layer.forward(self, hidden_states, top_k_index, top_k_weights)
