"""Routes: which experts each token routes to in every MoE layer.

``RouteRecorder`` collects them during a forward (filled by the experts function, one layer at a time) as a bool
tensor ``[tokens, layers, experts]``; ``pack`` turns such an array into packed bitmaps
``[tokens, layers, ceil(experts / 8)]`` (``numpy.packbits``, little bit order), the form the decoding loop keeps.
Route *sources* for draft nodes (the oracle, predictors) live in ``selection/route_sources.py``.
"""

from __future__ import annotations

import numpy as np
import torch


def pack(routes) -> np.ndarray:
    """bool [..., experts] -> uint8 [..., ceil(experts / 8)] bitmaps (bit e of byte e // 8 is expert e)."""
    return np.packbits(np.asarray(routes, dtype=bool), axis=-1, bitorder="little")


def unpack(bitmaps: np.ndarray, num_experts: int) -> np.ndarray:
    return np.unpackbits(bitmaps, axis=-1, count=num_experts, bitorder="little").astype(bool)


class RouteRecorder:
    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self._current: torch.Tensor | None = None  # [T, L, E] bool, on the compute device
        self._last: torch.Tensor | None = None  # [T, L, E] bool: routes of the last finished forward

    def begin(self) -> None:
        self._current = None

    def record(self, layer: int, top_k_index: torch.Tensor) -> None:
        """top_k_index: [T, k] expert ids of layer ``layer`` (0-based among MoE layers)."""
        if self._current is None or self._current.shape[0] != top_k_index.shape[0]:
            self._current = torch.zeros(top_k_index.shape[0], self.num_layers, self.num_experts, dtype=torch.bool,
                                        device=top_k_index.device)
        self._current[:, layer].scatter_(1, top_k_index, True)

    def end(self) -> None:
        if self._current is not None:
            self._last = self._current  # stays on the device: no host sync unless someone reads it
        self._current = None

    @property
    def last(self) -> torch.Tensor | None:
        """[T, L, E] bool on the CPU: the routes of the last finished forward."""
        if self._last is not None and self._last.device.type != "cpu":
            self._last = self._last.cpu()
        return self._last

    def packed(self) -> np.ndarray:
        """The last forward's routes as packed bitmaps [T, L, ceil(E / 8)]."""
        if self.last is None:
            raise RuntimeError("no forward has been recorded yet")
        return pack(self.last.numpy())
