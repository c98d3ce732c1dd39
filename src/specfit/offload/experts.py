"""The ``"specfit"`` experts implementation: a Qwen3-MoE experts forward that reads expert weights through the
slot cache instead of the module's own (released) parameters.

The result does not depend on which experts were resident: every (token, k) contribution is written to its own
row and the k rows of a token are summed in a fixed order at the end, as transformers' batched path does.
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

    def _untracked(self, needed: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
        arena = self.runtime.store.arenas[self.index]
        device = self.cache.engine.device
        for e in needed:  # measurement path: no slots, no counters, no emulated link
            yield e, arena[e].to(device, non_blocking=False)

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
        out = hidden_states.new_empty(num_tokens * top_k, hidden_states.shape[-1])  # [T*k, H]
        source = self._untracked(needed) if rt.untracked else self.cache.fetch(needed, rt.forward_counters)
        for e, weights in source:
            start, count = starts[e]
            # one expert's math is the family's (biases, GPT-OSS's clamped SwiGLU, ...): seam.expert_forward
            out[order[start:start + count]] = seam.expert_forward(module, rows[start:start + count],
                                                                  *rt.store.parts(weights))
        out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(num_tokens, top_k, -1).sum(dim=1)


def specfit_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Registered in transformers' experts interface as ``"specfit"``; ``self`` is the experts module."""
    layer = getattr(self, ATTR, None)
    if layer is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the 'specfit' experts implementation but has no SpecFit runtime attached; "
            f"use specfit.enable(model, ...) rather than setting the implementation by hand")
    return layer.forward(self, hidden_states, top_k_index, top_k_weights)
