"""transformers' experts interface: the ``"specfit"`` experts implementation and the experts' math
(gating, the batched and grouped forwards) in the model's own layouts.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

__all__ = ["EXPERTS_IMPL", "EnabledName", "enabled_name", "built_from_enabled", "plain_experts_forward",
           "register_experts_implementation", "experts_implementation", "set_experts_implementation",
           "own_config", "restore_config", "expert_activation", "experts_forward_batched", "grouped_mm",
           "experts_forward_grouped", "transformers_experts_forward"]

EXPERTS_IMPL = "specfit"


def register_experts_implementation(forward) -> None:
    """Make ``"specfit"`` a name in transformers' experts interface, bound to ``forward`` (idempotent)."""
    ExpertsInterface.register(EXPERTS_IMPL, forward)


def experts_implementation(model) -> str | None:
    return model.config._experts_implementation


class EnabledName(str):
    """``"specfit"`` as an enabled model's config holds it, carrying the implementation the model had before
    (``previous``). A model built from that config (``type(model)(model.config)``, ``from_config``, which deep-copies
    it: the copy keeps the mark) has no SpecFit runtime on its experts and runs ``previous``, as the plain model did.
    The name typed by hand is a plain str, and is refused. config.json never holds it (transformers leaves the
    internal attribute out of ``to_dict``)."""

    previous: str | None = None


def enabled_name(previous: str | None) -> EnabledName:
    name = EnabledName(EXPERTS_IMPL)
    name.previous = previous
    return name


def built_from_enabled(experts: nn.Module) -> bool:
    """Whether ``experts`` reads an enabled model's config (or a copy of it) without being enabled itself."""
    return isinstance(getattr(getattr(experts, "config", None), "_experts_implementation", None), EnabledName)


def plain_experts_forward(experts: nn.Module, *args, **kwargs) -> torch.Tensor:
    """transformers' forward of ``experts`` under the implementation its config had before ``enable``."""
    forward = getattr(type(experts).forward, "__wrapped__", type(experts).forward)
    previous = experts.config._experts_implementation.previous
    return ALL_EXPERTS_FUNCTIONS.get_interface(previous or "eager", forward)(experts, *args, **kwargs)


def set_experts_implementation(model, name: str, forward=None) -> None:
    """Select experts implementation ``name``; for ``"specfit"``, ``forward`` is the function it names."""
    if name == EXPERTS_IMPL:
        if forward is None:
            raise ValueError("the 'specfit' experts implementation needs its forward function")
        register_experts_implementation(forward)
    model.set_experts_implementation(name)


def own_config(model) -> tuple:
    """Give the model a private copy of its config (every module holding the config object, or one of its
    sub-configs, gets the copy), so that selecting the experts implementation writes into the model's config only,
    never into the object the caller built it from (a model built later from that config would otherwise run
    ``"specfit"`` without a runtime). Returns what ``restore_config`` needs."""
    original = model.config
    memo: dict = {}
    private = copy.deepcopy(original, memo)
    swapped = []
    for module in model.modules():
        held = vars(module).get("config")
        if held is not None and id(held) in memo:
            swapped.append((module, held))
            module.config = memo[id(held)]
    return original, private, copy.deepcopy(private), swapped


def restore_config(model, saved) -> None:
    """Inverse of ``own_config``: every module gets its original config object back, with the changes made to the
    model's config while it had its own copy (``model.config.use_cache = False``, ...) carried over; the experts
    implementation is the one it had (set back before this is called)."""
    original, private, at_copy, swapped = saved
    for module, held in swapped:
        module.config = held
    for key, value in vars(private).items():
        if key != "_experts_implementation_internal" and value != vars(at_copy).get(key, _MISSING):
            setattr(original, key, value)


_MISSING = object()


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
                            offs: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                            down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of every group at once: x [M, H] sorted by group, ``offs`` (int32 [N]) each group's end row; gate_up
    [N, 2I, H] and down [N, H, I] (views: no copy), biases [N, 2I] / [N, H] -> [M, H], with the family's gating.
    Biases are added after each matmul, as transformers' grouped experts add them."""
    h = grouped_mm(x, gate_up.transpose(1, 2), offs)  # [M, 2I]
    if gate_up_bias is not None:
        h = h + _rows_of_groups(gate_up_bias, offs, x.shape[0])
    y = grouped_mm(expert_activation(experts, h), down.transpose(1, 2), offs)  # [M, H]
    if down_bias is not None:
        y = y + _rows_of_groups(down_bias, offs, x.shape[0])
    return y


def _rows_of_groups(values: torch.Tensor, offs: torch.Tensor, rows: int) -> torch.Tensor:
    """values [N, D] per group -> [rows, D], each group's row repeated over its rows (``offs``: group ends)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))  # [N]
    return values.repeat_interleave(counts, dim=0, output_size=rows)


def transformers_experts_forward(experts: nn.Module, params: dict, hidden_states: torch.Tensor,
                                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' own forward of ``experts``'s class (the eager per-expert loop its experts interface wraps) with
    ``params`` (the module's own parameter names -> tensors, e.g. ``ExpertStore.checkpoint_tensors``) in place of
    the module's parameters: a reference that shares no code with SpecFit's experts. ``experts`` is left as it was.
    hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]."""
    forward = getattr(type(experts).forward, "__wrapped__", type(experts).forward)
    view = copy.copy(experts)  # its own attribute dict; the same submodules (activation) and config
    view.__dict__["_parameters"] = {name: nn.Parameter(t, requires_grad=False) for name, t in params.items()}
    return forward(view, hidden_states, top_k_index, top_k_weights)
