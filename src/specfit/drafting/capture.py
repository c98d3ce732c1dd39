"""The target features an EAGLE-3 drafter fuses: outputs of three decoder layers (low, mid, high), kept by hooks."""

from __future__ import annotations

import torch

from ..seam import layers as hf_layers


class AuxCapture:
    """Forward hooks on the target's decoder layers that keep the outputs the drafter fuses (low, mid, high).
    ``paused()`` true: forwards leave the kept outputs alone (the route oracle's must not overwrite verified ones)."""

    def __init__(self, model, layer_ids, paused=lambda: False):
        layers = hf_layers.decoder_layers(model)
        for i in layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(f"drafter aux layer id {i} is outside the target's {len(layers)} layers")
        self.paused = paused
        self.layer_ids = tuple(layer_ids)
        self.outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.handles = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(layer_ids)]

    def _hook(self, j):
        def hook(module, args, output):
            if not self.paused():
                self.outputs[j] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self) -> torch.Tensor:
        """[1, T, 3H] features of the last forward's tokens (low, mid, high)."""
        return torch.cat(self.outputs, dim=-1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
