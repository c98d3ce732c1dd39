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

from ..seam import layers as hf_layers, routers

FILE = "route_predictor.safetensors"
CONFIG = "route_predictor.json"
FORMAT = "specfit-route-predictor"
SCORINGS = ("logits", "softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


class RoutePredictor(nn.Module):
    """``states [N, H] -> logits [N, L, E]`` (a linear map per layer), then each layer's routers' own selection rule
    (``seam.routers.RouterRule``): top-k of the logits, or of ``sigmoid``/``softmax`` scores plus a correction bias
    within the best expert groups (DeepSeek-V3, GLM-4-MoE, dots1, Ernie, DeepSeek-V2's group-limited greedy)."""

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int, top_k: int, scoring: str = "logits",
                 n_group: int = 1, topk_group: int = 1, group_score: str = "max"):
        super().__init__()
        if scoring not in SCORINGS or group_score not in GROUP_SCORES:
            raise ValueError(f"scoring must be one of {SCORINGS} and group_score one of {GROUP_SCORES}, got "
                             f"{scoring!r}, {group_score!r}")
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide {num_experts} experts and topk_group={topk_group} be in "
                             f"1..n_group")
        self.num_layers, self.num_experts, self.hidden_size, self.top_k = num_layers, num_experts, hidden_size, top_k
        self.scoring, self.n_group, self.topk_group, self.group_score = scoring, n_group, topk_group, group_score
        self.weight = nn.Parameter(torch.zeros(num_layers, num_experts, hidden_size))  # [L, E, H]
        self.bias = nn.Parameter(torch.zeros(num_layers, num_experts))  # [L, E]
        self.register_buffer("correction", torch.zeros(num_layers, num_experts))  # [L, E], added to the scores

    @classmethod
    def from_gates(cls, model) -> "RoutePredictor":
        """The target's routers stacked, with their selection rule: the untrained ``gate`` predictor (exactly the
        target's routes when applied to a layer's router input), and the predictor's initialisation."""
        layers = hf_layers.moe_layers(model)
        rules = [routers.router_rule(m) for m in layers]
        first = rules[0]
        shape = (first.top_k, first.scoring, first.n_group, first.topk_group, first.group_score)
        for moe, rule in zip(layers, rules):
            if (rule.top_k, rule.scoring, rule.n_group, rule.topk_group, rule.group_score) != shape:
                raise ValueError(f"layer {moe.layer}'s router selects differently from layer {layers[0].layer}'s; "
                                 f"the 'gate' predictor needs one rule for every MoE layer")
        weight = rules[0].weight
        head = cls(len(rules), weight.shape[0], weight.shape[1], *shape)
        with torch.no_grad():
            head.weight.copy_(torch.stack([r.weight.float() for r in rules]))
            for i, r in enumerate(rules):
                if r.bias is not None:
                    head.bias[i].copy_(r.bias.float())
                if r.correction is not None:
                    head.correction[i].copy_(r.correction.float())
        return head.to(weight.device)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] -> expert logits [N, L, E]: one matmul over every layer's experts at once (the einsum
        ``nh,leh->nle`` computed as the same [N, H] x [H, L*E] product, bit for bit, without einsum's planning)."""
        flat = states.float() @ self.weight.view(-1, self.hidden_size).T  # [N, L*E]
        return flat.view(-1, self.num_layers, self.num_experts) + self.bias

    def choice_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, L, E] -> the scores the routers rank ([N, L, E]; -inf outside the kept expert groups)."""
        # only the rule's own scoring (each is a full pass over [N, L, E]: per-op cost at batch 1)
        scores = logits if self.scoring == "logits" else logits.softmax(-1) if self.scoring == "softmax" \
            else logits.sigmoid()
        scores = scores + self.correction
        if self.n_group > 1:
            groups = scores.view(*scores.shape[:-1], self.n_group, -1)  # [N, L, G, E/G]
            group = groups.max(-1).values if self.group_score == "max" else groups.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(-1, group.topk(self.topk_group, -1).indices,
                                                                      True)  # [N, L, G]
            keep = keep.repeat_interleave(self.num_experts // self.n_group, dim=-1)  # [N, L, E]
            scores = scores.masked_fill(~keep, float("-inf"))
        return scores

    @torch.no_grad()
    def routes(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H] -> bool routes [N, L, E] (top-k per layer)."""
        scores = self.choice_scores(self(states))
        out = torch.zeros_like(scores, dtype=torch.bool)
        return out.scatter_(-1, scores.topk(self.top_k, dim=-1).indices, True)

    def save(self, folder, dtype: torch.dtype | None = None) -> None:
        """Write the head beside a drafter; ``dtype``: its tensors in that dtype (``torch.bfloat16`` halves the file;
        loading casts them back to float32)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({name: t.detach().cpu().to(dtype or t.dtype).contiguous() for name, t in
                   (("weight", self.weight), ("bias", self.bias), ("correction", self.correction))}, folder / FILE)
        (folder / CONFIG).write_text(json.dumps(dict(format=FORMAT, num_layers=self.num_layers,
                                                     num_experts=self.num_experts, hidden_size=self.hidden_size,
                                                     top_k=self.top_k, scoring=self.scoring, n_group=self.n_group,
                                                     topk_group=self.topk_group, group_score=self.group_score),
                                                indent=2) + "\n")

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
        rule = {k: config[k] for k in ("scoring", "n_group", "topk_group", "group_score") if k in config}
        head = cls(config["num_layers"], config["num_experts"], config["hidden_size"], config["top_k"], **rule)
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
        tensors.setdefault("correction", torch.zeros_like(head.correction))  # saved before routers had one
        for name in ("weight", "bias", "correction"):
            want = tuple(getattr(head, name).shape)
            if tuple(tensors[name].shape) != want:
                raise ValueError(f"{folder / FILE}: {name} has shape {tuple(tensors[name].shape)}, expected {want}")
        head.load_state_dict(tensors)
        if model is not None:
            layers = hf_layers.moe_layers(model)
            weight = routers.router_weight(layers[0].gate)
            want = (len(layers), weight.shape[0], weight.shape[1])
            if (head.num_layers, head.num_experts, head.hidden_size) != want:
                raise ValueError(f"route predictor in {folder} is for (layers, experts, hidden) = "
                                 f"{(head.num_layers, head.num_experts, head.hidden_size)}, the model has {want}")
            head.to(weight.device)
        return head


def recall(predicted: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Per-layer top-k recall: |predicted ∩ true| / |true| per (token, layer), averaged over tokens -> [L]."""
    hit = (predicted & true).sum(-1).float()  # [N, L]
    return (hit / true.sum(-1).clamp(min=1)).mean(0)
