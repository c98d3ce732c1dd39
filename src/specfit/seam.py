"""The one file that touches transformers internals.

Everything here relies on details of transformers 5.x that are not public API: the experts-implementation registry
and ``config._experts_implementation``, the layout of Qwen3-MoE decoder layers, the tensors inside cache layers, and
how ``generate()`` builds a call's generation config. (The private ``_sample`` method that ``generate()`` dispatches
to is named in ``decoding/strategy.py``, the one class that overrides it.) When transformers moves, this file moves.
It is the bottom layer: it imports nothing of SpecFit's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, apply_renamings
from transformers.integrations.moe import ExpertsInterface

EXPERTS_IMPL = "specfit"


def register_experts_implementation(forward) -> None:
    """Make ``"specfit"`` a name in transformers' experts interface, bound to ``forward`` (idempotent)."""
    ExpertsInterface.register(EXPERTS_IMPL, forward)


# --- Model structure ------------------------------------------------------------------------------------------
# Layer types whose cache SpecFit's tree decoding can compact (KV attention); anything else in config.layer_types
# (linear attention, mamba, conv, ...) carries recurrent state that cannot verify a tree from one state.
ATTENTION_LAYER_TYPES = ("full_attention", "attention", "sliding_attention", "chunked_attention")
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
        return _router_top_k(self.gate)

    @property
    def transposed(self) -> bool:
        """Weights stored [E, H, 2I] / [E, I, H] (x @ W) rather than [E, 2I, H] / [E, H, I] (F.linear)."""
        return self.kind == "Llama4TextMoe" or bool(getattr(self.experts, "is_transposed", False))

    @property
    def layout(self) -> ExpertLayout:
        return ExpertLayout(self.hidden, self.intermediate, bool(getattr(self.experts, "has_bias", False)))


def _first_attr(module, names) -> int:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(module).__name__} has none of {names}; SpecFit cannot tell its expert sizes")


def expert_activation(experts: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """[S, 2I] gate/up projections -> [S, I], with the experts module's own gating: its ``_apply_gate`` (transformers'
    default act(gate) * up on concatenated halves; GPT-OSS's clamped SwiGLU on interleaved columns), or, for
    Llama-4's experts outside the interface, ``up * act(gate)`` on concatenated halves as its forward does."""
    apply = getattr(experts, "_apply_gate", None)
    if apply is not None:
        return apply(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return up * experts.act_fn(gate)


def experts_forward_batched(experts: nn.Module, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                            gate_up_bias: torch.Tensor | None = None,
                            down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """n experts at once: x [n, C, H] (C rows each) -> [n, C, H], from ``ExpertLayout.split_batch`` views
    (gate_up [n, 2I, H], down [n, H, I], biases [n, 2I] / [n, H]): ``F.linear`` orientation, the family's own
    gating and biases."""
    if gate_up_bias is None:
        h = torch.bmm(x, gate_up.transpose(1, 2))  # [n, C, 2I]
    else:
        h = torch.baddbmm(gate_up_bias[:, None], x, gate_up.transpose(1, 2))
    h = expert_activation(experts, h)  # [n, C, I]
    if down_bias is None:
        return torch.bmm(h, down.transpose(1, 2))  # [n, C, H]
    return torch.baddbmm(down_bias[:, None], h, down.transpose(1, 2))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] rows grouped by ``offs`` (int32 [G], each group's end) times weight [G, K, N] -> [M, N]: torch's
    grouped matmul (public from torch 2.9 as ``F.grouped_mm``, private ``torch._grouped_mm`` before)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(x, weight, offs=offs)


def experts_forward_grouped(experts: nn.Module, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                            offs: torch.Tensor) -> torch.Tensor:
    """Rows of every slot at once: x [M, H] sorted by slot, ``offs`` (int32 [N]) each slot's end row; gate_up
    [N, 2I, H] and down [N, H, I] are views over all N slots (no copy) -> [M, H], with the family's gating."""
    h = grouped_mm(x, gate_up.transpose(1, 2), offs)  # [M, 2I]
    return grouped_mm(expert_activation(experts, h), down.transpose(1, 2), offs)  # [M, H]


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


def expert_param(moe: MoELayer) -> torch.Tensor:
    """A parameter of the experts (for their device, dtype and requires_grad before enable)."""
    return moe.experts.gate_up_proj


def compute_dtype(model) -> torch.dtype:
    """The dtype of the model's activations; tree masks are built in it (an additive float mask)."""
    return model.get_input_embeddings().weight.dtype


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers`; SpecFit supports decoder-only causal LMs "
                         f"such as Qwen3MoeForCausalLM")
    return layers


def _router_classes(model) -> tuple[tuple[type, ...], tuple[str, ...]]:
    """The router classes the model declares (``_can_record_outputs["router_logits"]``), as classes and names."""
    specs = []
    for owner in (model, getattr(model, "model", None)):  # Llama-4 declares it on the text model only
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


# --- Routers --------------------------------------------------------------------------------------------------
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


def _router_top_k(router: nn.Module) -> int:
    if type(router).__name__ == "PhimoeTopKRouter":
        return 2  # sparsemixer picks two experts whatever num_experts_per_tok says
    return int(router.top_k)


def router_rule(moe: MoELayer) -> RouterRule:
    """The exact selection rule of ``moe``'s router; refuses routers whose rule SpecFit does not reproduce."""
    router = moe.gate
    name = type(router).__name__
    weight = router_weight(router).detach()
    bias = getattr(router, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    top_k = _router_top_k(router)
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


def experts_implementation(model) -> str | None:
    return model.config._experts_implementation


def set_experts_implementation(model, name: str, forward=None) -> None:
    """Select experts implementation ``name``; for ``"specfit"``, ``forward`` is the function it names."""
    if name == EXPERTS_IMPL:
        if forward is None:
            raise ValueError("the 'specfit' experts implementation needs its forward function")
        register_experts_implementation(forward)
    model.set_experts_implementation(name)


# --- KV cache -------------------------------------------------------------------------------------------------
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


def host_stopping(criteria) -> Callable[[list[int]], bool] | None:
    """The stopping criteria as a check on the host's token list, with no device read, when every criterion is one
    whose rule is known (max length, eos); None otherwise (then they run on the ids as transformers runs them)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    lengths, eos = [], set()
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            lengths.append(c.max_length)
        elif type(c) is EosTokenCriteria:
            eos.update(int(t) for t in c.eos_token_id.detach().to("cpu").reshape(-1).numpy())
        else:
            return None
    longest = min(lengths) if lengths else None
    return lambda tokens: (longest is not None and len(tokens) >= longest) or (bool(eos) and tokens[-1] in eos)


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


# --- generate() -----------------------------------------------------------------------------------------------
def call_generation_config(model, generation_config, **kwargs):
    """The generation config one ``generate()`` call runs with, built as transformers builds it (its private
    ``_prepare_generation_config``): ``generation_config`` (or a default one) over the model's own
    ``generation_config``, custom entries such as ``assistant`` carried over, then the call's keyword arguments.
    A copy: nothing of the model's changes."""
    config, _ = model._prepare_generation_config(generation_config, **kwargs)
    return config


# --- Checkpoints ----------------------------------------------------------------------------------------------
def checkpoint_renamer(model):
    """key -> key: transformers' own renamings of hub checkpoint keys for this model (``conversion_mapping``: e.g.
    Mixtral's ``block_sparse_moe`` -> ``mlp``, PhiMoE's ``block_sparse_moe.gate`` -> ``mlp.router``, Granite's
    ``router.layer`` -> ``router``); the converters that fuse per-expert tensors are not applied (the loader reads
    experts itself)."""
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda key: apply_renamings(key, renamings)


def ignored_checkpoint_key(model, key: str) -> bool:
    """Keys transformers drops on load (``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3 / GLM / Ernie / Qwen3-Next
    multi-token-prediction layers)."""
    return any(re.search(p, key) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


def quantization_method(config) -> str | None:
    """The checkpoint's quantization (``config.quantization_config.quant_method``: "mxfp4", "fp8", ...), if any."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return str(q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", q))


# --- save_pretrained with the experts outside the parameters ------------------------------------------------------
def save_pretrained_streaming(model, save_directory, rest: dict, expert_groups: list, *,
                              save_original_format: bool = True, **kwargs) -> None:
    """``model.save_pretrained`` for a model whose routed experts live in a host store, not in its parameters.

    transformers writes the config, the generation config and ``rest`` (every other weight, with its own
    tied-weight, renaming and sharding rules; ``kwargs`` pass through to it). Then each of ``expert_groups`` (a
    callable returning a dict state-dict key -> tensor, views of the store) is read, converted to the checkpoint's
    format as transformers converts a whole state dict (``revert_weight_conversion``: Qwen3-MoE's fused
    ``gate_up_proj`` back to per-expert ``gate_proj``/``up_proj``), copied, written as its own shard and dropped
    before the next is read: the extra memory is one group, never a second copy of the experts. Every shard is then
    numbered ``model-0000k-of-0000n.safetensors`` and one index maps every key, so plain ``from_pretrained`` reads
    the folder as any sharded checkpoint."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    folder = os.fspath(save_directory)
    os.makedirs(folder, exist_ok=True)
    ours = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(SAFE_WEIGHTS_INDEX_NAME))
    for name in os.listdir(folder):  # a checkpoint saved here before is replaced, as transformers replaces it
        if ours.fullmatch(name):
            os.remove(os.path.join(folder, name))
    type(model).save_pretrained(model, folder, state_dict=rest, save_original_format=save_original_format,
                                **kwargs)

    index_path = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(folder, SAFE_WEIGHTS_NAME), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), SAFE_WEIGHTS_NAME)
    files = sorted(set(weight_map.values()))
    total_size = sum(_stored_bytes(os.path.join(folder, name)) for name in files)
    temporary = []
    for j, read in enumerate(expert_groups):
        state = read()  # views of the store
        if save_original_format:
            state = revert_weight_conversion(model, state)
        state = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format) for k, v in state.items()}
        temporary.append(f"specfit-experts-{j:05d}.safetensors.partial")
        save_file(state, os.path.join(folder, temporary[-1]), metadata={"format": "pt"})
        total_size += sum(t.numel() * t.element_size() for t in state.values())
        weight_map.update(dict.fromkeys(state, temporary[-1]))
        del state
    n = len(files) + len(temporary)
    final = {old: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, old in enumerate(files + temporary)}
    for old, new in final.items():
        os.replace(os.path.join(folder, old), os.path.join(folder, new))
    index = {"metadata": {"total_size": total_size},
             "weight_map": {key: final[file] for key, file in sorted(weight_map.items())}}
    with open(index_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _stored_bytes(path) -> int:
    """Bytes of the tensors in a safetensors file (its header gives each one's byte range)."""
    import json
    import struct

    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
