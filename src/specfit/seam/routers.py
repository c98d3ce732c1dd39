"""How each family's router selects experts (``RouterRule``): the rule the target's gates apply, read from its
router so that SpecFit can reproduce its routes (``route_source="gate"``) and train a predictor of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import MoELayer, router_top_k

__all__ = ["RouterRule", "router_weight", "router_rule"]

@dataclass(frozen=True)
class RouterRule:
    """How a router picks its top-k experts from ``logits = x @ weight.T + bias`` (fp32): rank ``scores`` =
    ``scoring(logits) + correction``, keep the ``topk_group`` best of ``n_group`` expert groups (a group's score: its
    ``"max"`` or the sum of its ``"top2"``), take the top-k. Exactly what the family's router does at inference."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None  # [E]: added to the logits (GPT-OSS)
    top_k: int
    scoring: str = "logits"  # "logits" | "softmax" | "sigmoid"
    correction: torch.Tensor | None = None  # [E]: added to the scores before selection (DeepSeek-V3, Ernie)
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"  # "max" | "top2"


# router class name -> rule kind; a router not listed is refused by the "gate" route source
_TOPK_OF_LOGITS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter",
                   "MiniMaxTopKRouter", "Qwen3NextTopKRouter", "HunYuanMoEV1Gate", "GptOssTopKRouter",
                   "PhimoeTopKRouter", "GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter",
                   "GraniteMoeHybridTopKRouter", "Llama4Router")
_SIGMOID_GROUPED = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Dots1TopkRouter")


def router_weight(router: nn.Module) -> torch.Tensor:
    """The router's [E, H] projection (HunYuan keeps it in ``gate.wg``)."""
    wg = getattr(router, "wg", None)
    if isinstance(wg, nn.Linear):
        return wg.weight
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(router).__name__} has no router weight (.weight or .wg.weight)")
    return weight


def router_rule(moe: MoELayer) -> RouterRule:
    """The exact selection rule of ``moe``'s router; refuses routers whose rule SpecFit does not reproduce."""
    router = moe.gate
    name = type(router).__name__
    weight = router_weight(router).detach()
    bias = getattr(router, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    top_k = router_top_k(router)
    if name in _TOPK_OF_LOGITS:  # top-k of the logits (softmax or not: the order is the same)
        return RouterRule(weight, bias, top_k)
    if name == "DeepseekV2TopkRouter":
        if router.topk_method == "greedy":
            return RouterRule(weight, None, top_k)
        if router.topk_method == "group_limited_greedy":
            return RouterRule(weight, None, top_k, "softmax", None, router.num_group, router.topk_group, "max")
        raise ValueError(f"DeepSeek-V2 router with topk_method={router.topk_method!r}; SpecFit's 'gate' route "
                         f"source reproduces 'greedy' and 'group_limited_greedy'")
    if name in _SIGMOID_GROUPED:
        return RouterRule(weight, None, top_k, "sigmoid", router.e_score_correction_bias.detach(),
                          router.num_group, router.topk_group, "top2")
    if name == "Ernie4_5_MoeTopKRouter":
        return RouterRule(weight, None, top_k, "softmax",
                          router.moe_statics.e_score_correction_bias.detach().reshape(-1))
    raise ValueError(f"route_source='gate' does not know how {name} selects experts, so it cannot reproduce its "
                     f"routes; use route_source='oracle', or train a predictor (`specfit train-router --model MODEL --drafter DRAFTER_FOLDER`, the checkpoint and "
                     f"drafter folder you enable with) and pass route_predictor=FOLDER")
