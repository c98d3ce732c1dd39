"""The model's structure as SpecFit reads it: decoder layers, the MoE layers with their experts and routers
(``MoELayer``), one expert's row layout (``ExpertLayout``), the experts' tensors (released to the host store and
restored), and the MoE blocks outside transformers' experts interface (Llama-4) routed through SpecFit's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["EXPERT_PARAMS", "ExpertLayout", "MoELayer", "router_top_k", "base_model", "decoder_layers", "compute_dtype",
           "moe_layers",
           "route_blocks", "unroute_blocks", "expert_tensors", "release_expert_tensors", "restore_expert_tensors",
           "expert_param", "hide_expert_plans", "restore_expert_plans"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertLayout:
    """One expert as one flat row of the host store: ``gate_up [2I, H]`` (the model's own gate/up order: gate rows
    then up rows, or interleaved for GPT-OSS), then ``down [H, I]``, then, for families with biases (GPT-OSS),
    ``gate_up_bias [2I]`` and ``down_bias [H]``. Transposed families (GPT-OSS, Llama-4) are stored transposed back
    to this ``F.linear`` orientation."""

    hidden: int
    intermediate: int
    bias: bool = False

    @property
    def numel(self) -> int:
        return 3 * self.intermediate * self.hidden + (2 * self.intermediate + self.hidden if self.bias else 0)

    def split(self, row: torch.Tensor):
        """flat row [numel] -> (gate_up [2I, H], down [H, I], gate_up_bias [2I] | None, down_bias [H] | None)."""
        h, i = self.hidden, self.intermediate
        n = 2 * i * h
        gate_up, down = row[:n].view(2 * i, h), row[n:n + i * h].view(h, i)
        if not self.bias:
            return gate_up, down, None, None
        m = 3 * i * h
        return gate_up, down, row[m:m + 2 * i], row[m + 2 * i:m + 2 * i + h]

    def split_batch(self, rows: torch.Tensor):
        """rows [n, numel] -> (gate_up [n, 2I, H], down [n, H, I], gate_up_bias [n, 2I] | None,
        down_bias [n, H] | None) views."""
        h, i, b = self.hidden, self.intermediate, rows.shape[0]
        n = 2 * i * h
        gate_up, down = rows[:, :n].view(b, 2 * i, h), rows[:, n:n + i * h].view(b, h, i)
        if not self.bias:
            return gate_up, down, None, None
        m = 3 * i * h
        return gate_up, down, rows[:, m:m + 2 * i], rows[:, m + 2 * i:m + 2 * i + h]


@dataclass(frozen=True)
class MoELayer:
    layer: int  # decoder layer index
    experts: nn.Module  # the experts module (its 3-D weights are released while SpecFit is enabled)
    gate: nn.Module  # the router: mlp.gate, mlp.router, block_sparse_moe.router, feed_forward.router, ...
    block: nn.Module | None = None  # the sparse MoE block holding both
    kind: str = "interface"  # "interface": transformers' experts interface; else the class whose forward we route

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def hidden(self) -> int:
        return _first_attr(self.experts, ("hidden_dim", "hidden_size"))

    @property
    def intermediate(self) -> int:
        return _first_attr(self.experts, ("intermediate_dim", "expert_dim", "intermediate_size"))

    @property
    def top_k(self) -> int:
        return router_top_k(self.gate)

    @property
    def transposed(self) -> bool:
        """Weights stored [E, H, 2I] / [E, I, H] (x @ W) rather than [E, 2I, H] / [E, H, I] (F.linear)."""
        return self.kind == "Llama4TextMoe" or bool(getattr(self.experts, "is_transposed", False))

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.hidden, self.intermediate, bool(getattr(self.experts, "has_bias", False)))


def router_top_k(router: nn.Module) -> int:
    """How many experts ``router`` selects per token."""
    if type(router).__name__ == "PhimoeTopKRouter":
        return 2  # sparsemixer picks two experts whatever num_experts_per_tok says
    return int(router.top_k)


def _first_attr(module, names) -> int:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(module).__name__} has none of {names}; SpecFit cannot tell its expert sizes")


def expert_tensors(moe: MoELayer):
    """The experts' weights in store orientation: (gate_up [E, 2I, H], down [E, H, I], gate_up_bias [E, 2I] | None,
    down_bias [E, H] | None)."""
    e = moe.experts
    gate_up, down = e.gate_up_proj, e.down_proj
    if moe.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if moe.layout.bias:
        return gate_up, down, e.gate_up_proj_bias, e.down_proj_bias
    return gate_up, down, None, None


def release_expert_tensors(moe: MoELayer) -> None:
    """Drop the experts' own 3-D parameters (the store holds the only copy while SpecFit is enabled)."""
    for name in EXPERT_PARAMS:
        if name in moe.experts._parameters:
            delattr(moe.experts, name)


def restore_expert_tensors(moe: MoELayer, tensors, device, dtype, requires_grad: bool) -> None:
    """Inverse of ``release_expert_tensors``: ``tensors`` as ``expert_tensors`` returns them."""
    gate_up, down, gate_up_bias, down_bias = tensors
    if moe.transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    for name, t in zip(EXPERT_PARAMS, (gate_up, down, gate_up_bias, down_bias)):
        if t is not None:
            setattr(moe.experts, name, nn.Parameter(t.to(device, dtype or t.dtype), requires_grad))


def hide_expert_plans(model: nn.Module) -> list:
    """While the experts are released (not the model's parameters), the parallel plans of every PreTrainedModel in
    the model (``_tp_plan``, ``_ep_plan``: tensor and expert parallelism) name none of their tensors: entries naming
    ``experts.gate_up_proj``, ``experts.down_proj``, ... are dropped. Returns what ``restore_expert_plans`` puts
    back."""
    saved = []
    for module in model.modules():
        for attr in ("_tp_plan", "_ep_plan"):
            plan = vars(module).get(attr)
            if not plan:
                continue
            kept = {k: v for k, v in plan.items() if k.split(".")[-2:] not in [["experts", p] for p in EXPERT_PARAMS]}
            if len(kept) != len(plan):
                saved.append((module, attr, plan))
                setattr(module, attr, kept)
    return saved


def restore_expert_plans(saved: list) -> None:
    for module, attr, plan in saved:
        setattr(module, attr, plan)


def expert_param(moe: MoELayer) -> torch.Tensor:
    """A parameter of the experts (for their device, dtype and requires_grad before enable)."""
    return moe.experts.gate_up_proj


def compute_dtype(model) -> torch.dtype:
    """The dtype of the model's activations; tree masks are built in it (an additive float mask)."""
    return model.get_input_embeddings().weight.dtype


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack, the module holding ``layers``: ``model.model`` of a causal LM, else transformers'
    ``model.base_model`` (``model.transformer`` of Qwen3-MoE's question-answering head, the model itself for
    ``Qwen3MoeModel``)."""
    for candidate in (getattr(model, "model", None), getattr(model, "base_model", None)):
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers (`base_model.layers`); SpecFit supports "
                         f"decoder-only MoE models such as Qwen3MoeForCausalLM")
    return layers


def _router_classes(model) -> tuple[tuple[type, ...], tuple[str, ...]]:
    """The router classes the model declares (``_can_record_outputs["router_logits"]``), as classes and names."""
    specs = []
    for owner in (model, base_model(model)):  # Llama-4 declares it on the text model only
        spec = (getattr(owner, "_can_record_outputs", None) or {}).get("router_logits")
        specs += spec if isinstance(spec, (list, tuple)) else [] if spec is None else [spec]
    classes, names = [], []
    for s in specs:
        target = getattr(s, "target_class", s)
        if isinstance(target, type):
            classes.append(target)
        elif getattr(s, "class_name", None):
            names.append(s.class_name)
    return tuple(classes), tuple(names)


def _in_experts_interface(module: nn.Module) -> bool:
    """Decorated with transformers' ``use_experts_implementation`` (the flags it sets, and its wrapped forward)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and \
        getattr(type(module).forward, "__wrapped__", None) is not None


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The sparse MoE blocks, in layer order: in each decoder layer, a child module holding one of the router
    modules the model declares and an experts module in transformers' experts interface (or, for Llama-4, whose
    experts are outside the interface, a block whose forward SpecFit routes itself)."""
    classes, names = _router_classes(model)
    if not classes and not names:
        raise ValueError(f"{type(model).__name__} has no MoE layers: it declares no router (transformers' "
                         f"_can_record_outputs['router_logits']); SpecFit offloads the experts of "
                         f"models such as Qwen3MoeForCausalLM, MixtralForCausalLM or GptOssForCausalLM")

    def is_router(m):
        return isinstance(m, classes) or any(type(m).__name__.endswith(n) for n in names)

    found = []
    for i, layer in enumerate(decoder_layers(model)):
        for block in layer.children():
            router = next((m for m in block.children() if is_router(m)), None)
            if router is None:
                continue
            experts = next((m for m in block.children() if _in_experts_interface(m)), None)
            kind = "interface"
            if experts is None:
                kind = type(block).__name__
                experts = getattr(block, "experts", None)
                if kind not in _ROUTED_BLOCKS or not isinstance(experts, nn.Module):
                    raise ValueError(f"layer {i}: {kind} routes with {type(router).__name__}, but its experts are "
                                     f"not in transformers' experts interface and SpecFit has no routed forward for "
                                     f"it (supported outside the interface: {sorted(_ROUTED_BLOCKS)})")
            elif not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
                raise ValueError(f"layer {i}: {type(experts).__name__} has has_gate=False or a post-expert norm; "
                                 f"SpecFit supports gated experts (gate_up_proj + down_proj) without post norms")
            found.append(MoELayer(i, experts, router, block, kind))
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE layers (no decoder-layer block holding a declared router "
                         f"{[c.__name__ for c in classes] + list(names)} and an experts module)")
    first = found[0]
    for moe in found[1:]:
        if (moe.num_experts, moe.layout, moe.top_k) != (first.num_experts, first.layout, first.top_k):
            raise ValueError(f"MoE layers differ: layer {first.layer} has {first.num_experts} experts, "
                             f"{first.layout}, top-{first.top_k}; layer {moe.layer} has {moe.num_experts}, "
                             f"{moe.layout}, top-{moe.top_k}. SpecFit's store needs one shape for every MoE layer")
    for moe in found:
        if moe.kind == "Llama4TextMoe" and moe.top_k != 1:
            raise ValueError(f"layer {moe.layer}: Llama-4 with num_experts_per_tok={moe.top_k}; SpecFit routes "
                             f"Llama-4's experts for top-1 routing only (the released models use 1)")
    return found


def _llama4_forward(block: nn.Module, experts_forward):
    """Llama4TextMoe.forward with the routed experts computed sparsely by ``experts_forward`` (the "specfit"
    experts function): the router's sigmoid weight of its top-1 expert scales that expert's *input*, as the dense
    original does (unselected experts get x * 0 and add nothing); the shared expert is added as before."""

    def forward(hidden_states):
        x = hidden_states.reshape(-1, block.hidden_dim)  # [T, H]
        scores, logits = block.router(x)  # [T, E] sigmoid of the top-k logits, 0 elsewhere; [T, E]
        index = torch.topk(logits, block.router.top_k, dim=1).indices  # [T, 1]: the router's own choice
        weight = scores.gather(1, index)  # [T, 1]
        routed = experts_forward(block.experts, x * weight, index, torch.ones_like(weight))  # [T, H]
        out = block.shared_expert(x)
        out.add_(routed)
        return out, logits

    return forward


_ROUTED_BLOCKS = {"Llama4TextMoe": _llama4_forward}


def route_blocks(layers: list[MoELayer], experts_forward) -> None:
    """Blocks whose experts are outside the experts interface run ``experts_forward`` through their own routed
    forward (an instance attribute; ``unroute_blocks`` removes it)."""
    for moe in layers:
        if moe.kind != "interface":
            moe.block.forward = _ROUTED_BLOCKS[moe.kind](moe.block, experts_forward)


def unroute_blocks(layers: list[MoELayer]) -> None:
    for moe in layers:
        if moe.kind != "interface" and "forward" in moe.block.__dict__:
            del moe.block.forward
