"""Route predictors for draft nodes: drafter state -> per-layer expert scores -> top-k per layer.

- ``gate``: no training. Each target layer's own router (``[E, H]``) applied to the drafter's state of the node;
  the paper's predictor head has exactly this shape (layers x experts outputs over the drafter hidden).
- ``RoutePredictor``: the same linear map, initialised from the routers and fine-tuned on (drafter state, true
  routes) pairs (``specfit train-router``); saved beside the drafter as ``route_predictor.safetensors`` + ``.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .. import seam

FILE = "route_predictor.safetensors"
CONFIG = "route_predictor.json"
FORMAT = "specfit-route-predictor"


class RoutePredictor(nn.Module):
    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, top_k: int):
        super().__init__()
        self.num_layers, self.num_experts, self.hidden_size, self.top_k = num_layers, num_experts, hidden_size, top_k
        self.weight = nn.Parameter(torch.zeros(num_layers, num_experts, hidden_size))  # [L, E, H]
        self.bias = nn.Parameter(torch.zeros(num_layers, num_experts))  # [L, E]

    @classmethod
    def from_gates(cls, model) -> "RoutePredictor":
        """The target's routers stacked: the untrained ``gate`` predictor, and the predictor's initialisation."""
        layers = seam.moe_layers(model)
        gates = torch.stack([m.gate.weight.detach().float() for m in layers])  # [L, E, H]
        top_k = layers[0].top_k
        head = cls(gates.shape[0], gates.shape[1], gates.shape[2], top_k)
        with torch.no_grad():
            head.weight.copy_(gates)
        return head.to(layers[0].gate.weight.device)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] -> expert scores [N, L, E]."""
        return torch.einsum("nh,leh->nle", states.float(), self.weight) + self.bias

    @torch.no_grad()
    def routes(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] -> bool routes [N, L, E] (top-k per layer)."""
        scores = self(states)
        out = torch.zeros_like(scores, dtype=torch.bool)
        return out.scatter_(-1, scores.topk(self.top_k, dim=-1).indices, True)

    def save(self, folder) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.detach().cpu().contiguous(), "bias": self.bias.detach().cpu().contiguous()},
                  folder / FILE)
        (folder / CONFIG).write_text(json.dumps(dict(format=FORMAT, num_layers=self.num_layers,
                                                     num_experts=self.num_experts, hidden_size=self.hidden_size,
                                                     top_k=self.top_k), indent=2) + "\n")

    @classmethod
    def load(cls, folder, model=None) -> "RoutePredictor":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        missing = FileNotFoundError(f"no route predictor in {folder} (expected {CONFIG} and {FILE}; train one with "
                                    f"`specfit train-router`)")
        try:
            config = json.loads((folder / CONFIG).read_text())
        except FileNotFoundError:
            raise missing from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{folder / CONFIG}: not valid JSON ({e}); restore it or train the predictor again with "
                             "`specfit train-router`") from e
        if config.get("format") != FORMAT:
            raise ValueError(f"{folder / CONFIG}: field 'format' is {config.get('format')!r}, expected {FORMAT!r}")
        head = cls(config["num_layers"], config["num_experts"], config["hidden_size"], config["top_k"])
        try:
            tensors = load_file(folder / FILE)
        except FileNotFoundError:
            raise missing from None
        except SafetensorError as e:
            raise ValueError(f"{folder / FILE}: not a readable safetensors file ({e}); it is truncated or corrupt: "
                             "restore it or train the predictor again with `specfit train-router`") from e
        for name in ("weight", "bias"):
            if name not in tensors:
                raise ValueError(f"{folder / FILE}: no tensor {name!r} (it holds {sorted(tensors)})")
            want = tuple(getattr(head, name).shape)
            if tuple(tensors[name].shape) != want:
                raise ValueError(f"{folder / FILE}: {name} has shape {tuple(tensors[name].shape)}, expected {want}")
        head.load_state_dict(tensors)
        if model is not None:
            layers = seam.moe_layers(model)
            want = (len(layers), layers[0].gate.weight.shape[0], layers[0].gate.weight.shape[1])
            if (head.num_layers, head.num_experts, head.hidden_size) != want:
                raise ValueError(f"route predictor in {folder} is for (layers, experts, hidden) = "
                                 f"{(head.num_layers, head.num_experts, head.hidden_size)}, the model has {want}")
            head.to(layers[0].gate.weight.device)
        return head


def recall(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Per-layer top-k recall: |predicted ∩ true| / |true| per (token, layer), averaged over tokens -> [L]."""
    hit = (predicted & true).sum(-1).float()  # [N, L]
    return (hit / true.sum(-1).clamp(min=1)).mean(0)
