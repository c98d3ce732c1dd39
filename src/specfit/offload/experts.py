"""The ``"specfit"`` experts implementation: an experts forward that reads expert weights through the slot cache
instead of the module's own (released) parameters.

Per layer and forward: the routes reach the host once (the one planned host sync: the layer's experts are known
only then); the host plans everything else — which experts are hits, loads or streamed, and for each group of
experts that become ready together (``LayerCache.ready``), which rows each reads and where its outputs go — and sends
those indices to the device in one transfer that does not stop the host (``transfer.Staging``). Compute then runs a
few batched calls per group, the hits' compute overlapping the misses' copies:

- *gathered* (CPU, and CUDA where grouped matmuls cannot run): each group's rows padded to its busiest expert's count
  and one ``bmm`` per projection over the group's weights, gathered from the slots (a view when they are consecutive);
- *grouped* (CUDA, bfloat16, no expert biases): one ``grouped_mm`` per projection over *all* slots, with the rows
  sorted by slot and per-slot offsets, so no weight is copied on the device (transformers' grouped_mm path does the
  same over its parameters).

The result does not depend on which experts were resident: every (token, k) contribution is written to its own row
and the k rows of a token are summed in a fixed order at the end, as transformers' batched path does.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from ..seam import experts as hf_experts
from ..transfer import to_host

ATTR = "_specfit"  # attribute on each patched experts module, pointing to its LayerRuntime
log = logging.getLogger("specfit")


class LayerRuntime:
    def __init__(self, runtime, index: int, cache):
        # runtime: the SpecFitRuntime (model.specfit); cache: this layer's LayerCache; index: 0-based among MoE layers
        self.runtime, self.index, self.cache = runtime, index, cache

    def forward(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        num_tokens, top_k = top_k_index.shape
        rt.routes.record(self.index, top_k_index)
        flat = to_host(top_k_index.reshape(-1))[0]  # [T*k] the one planned host sync per layer
        rows = rows_by_expert(flat)  # expert -> its (token, k) rows, on the host: no device bincount
        needed = sorted(rows)
        if rt.untracked:
            groups, weights = [("untracked", needed, None)], [self._untracked(needed)]
            ready = iter([None])
        else:
            uses = [len(rows[e]) for e in needed] if num_tokens > 1 else None  # tokens per expert, for the policy
            fetch = self.cache.start(needed, rt.forward_counters, uses)
            groups, weights, ready = fetch.groups, None, self.cache.ready(fetch)
        grouped = rt.grouped_experts and weights is None
        plans = [plan_group(rows, top_k, len(flat), experts, slots, grouped and slots is not None,
                            self.cache.num_slots) for kind, experts, slots in groups]
        # every index of the layer in one host -> device transfer: rows to read, rows to write, slots (or offsets)
        index = rt.staging.to_device(*[a for p in plans for a in p.arrays()])
        index = [index] if isinstance(index, torch.Tensor) else list(index)
        hidden = hidden_states.shape[-1]
        out = hidden_states.new_empty(num_tokens * top_k + 1, hidden)  # [T*k + 1, H]: the last row takes padding
        for g, ((kind, experts, slots), plan) in enumerate(zip(groups, plans)):
            group = next(ready)
            take, dest, extra = index[3 * g: 3 * g + 3]
            x = hidden_states.index_select(0, take)  # [rows, H]
            if plan.offsets is not None:  # grouped over every slot: no weight moves
                parts = rt.store.layout.split_batch(self.cache.slots)
                y = hf_experts.experts_forward_grouped(module, x, parts[0], parts[1], extra.to(torch.int32))
            else:
                w = weights[0] if weights is not None else group.weights if group.weights is not None else \
                    self.cache.gather(slots, extra)  # [n, numel]
                parts = rt.store.compute_parts(w)  # in the compute dtype (FP8 rows dequantized); the math: hf_experts
                y = hf_experts.experts_forward_batched(module, x.view(len(experts), plan.width, -1), *parts)
            out.index_copy_(0, dest, y.reshape(-1, hidden))
        for _ in ready:  # the last group's waits are done; close the generator (marks the scratch ring free)
            pass
        out = out[:-1] * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(num_tokens, top_k, hidden).sum(dim=1)

    def _untracked(self, needed: list[int]) -> torch.Tensor:
        """The needed experts' weights [n, numel] straight from the arena, for the route oracle's measurement
        forwards: no slots, no counters, no emulated link. One asynchronous copy per expert from the pinned rows
        (no gather into fresh pageable memory first)."""
        arena = self.runtime.store.arenas[self.index]
        device = self.cache.engine.device
        if device.type == "cpu":
            return arena.index_select(0, torch.as_tensor(needed))
        buf = torch.empty(len(needed), arena.shape[1], dtype=arena.dtype, device=device)
        for i, e in enumerate(needed):
            buf[i].copy_(arena[e], non_blocking=True)
        return buf


class GroupPlan:
    """Host-side indices of one group: ``take`` (token rows read, padded), ``dest`` ((token, k) rows written; padding
    to the dummy last row), and the slots to gather or, grouped, per-slot row offsets."""

    __slots__ = ("take", "dest", "slots", "offsets", "width")

    def __init__(self, take, dest, slots, offsets, width):
        self.take, self.dest, self.slots, self.offsets, self.width = take, dest, slots, offsets, width

    def arrays(self) -> tuple:
        return self.take, self.dest, self.offsets if self.offsets is not None else (self.slots or [])


def plan_group(rows: dict[int, list[int]], top_k: int, pad: int, experts: list[int],
               slots: list[int] | None, grouped: bool, num_slots: int) -> GroupPlan:
    """Indices for one group. ``rows[e]``: the (token, k) rows routed to expert e (``rows_by_expert``);
    ``pad``: T*k, the dummy row padding is written to.

    ``slots``: each expert's slot (None: the weights are in a buffer of their own, in ``experts`` order).
    Gathered: expert j's rows are ``take[j*C:(j+1)*C]``, padded to the group's busiest count C with its last row
    repeated; their outputs go to ``dest`` (padding rows to row T*k, dropped).
    Grouped: rows sorted by slot, unpadded; ``offsets[s]`` ends slot s's rows.

    >>> flat = np.array([3, 1, 1, 0])   # token 0 -> experts 3, 1; token 1 -> experts 1, 0 (top_k = 2)
    >>> rows = rows_by_expert(flat)
    >>> p = plan_group(rows, 2, 4, [1, 3], [2, 0], False, 4)
    >>> p.take, p.dest, p.width
    ([0, 1, 0, 0], [1, 2, 0, 4], 2)
    >>> p = plan_group(rows, 2, 4, [1, 3], [2, 0], True, 4)
    >>> p.take, p.dest, p.offsets
    ([0, 0, 1], [0, 1, 2], [1, 1, 3, 3])
    """
    if grouped:
        by_slot = sorted(zip(slots, experts))
        take, dest, per_slot = [], [], [0] * num_slots
        for slot, e in by_slot:
            r = rows[e]
            take += [i // top_k for i in r]
            dest += r
            per_slot[slot] = len(r)
        return GroupPlan(take, dest, None, np.cumsum(per_slot).tolist(), 0)
    width = max(len(rows[e]) for e in experts)
    take, dest = [], []
    for e in experts:
        r = rows[e]
        take += [i // top_k for i in r] + [r[-1] // top_k] * (width - len(r))
        dest += r + [pad] * (width - len(r))
    return GroupPlan(take, dest, slots, None, width)


def rows_by_expert(flat: np.ndarray) -> dict[int, list[int]]:
    """expert -> its (token, k) rows of ``flat`` [T*k], ascending (plain Python: a layer routes few rows at decode
    and verify; NumPy's sort pays off only for a long prefill).

    >>> rows_by_expert(np.array([3, 1, 1, 0]))
    {3: [0], 1: [1, 2], 0: [3]}
    """
    if len(flat) > 512:
        order = np.argsort(flat, kind="stable")
        ids = flat[order]
        experts = np.unique(ids)
        starts, ends = np.searchsorted(ids, experts, "left"), np.searchsorted(ids, experts, "right")
        return {int(e): order[a:b].tolist() for e, a, b in zip(experts, starts, ends)}
    rows: dict[int, list[int]] = {}
    for i, e in enumerate(flat.tolist()):
        rows.setdefault(e, []).append(i)
    return rows


def grouped_shape_problem(hidden: int, intermediate: int, element_size: int = 2) -> str | None:
    """Why grouped matmuls over the slot views cannot run at these expert shapes, or None. CUDA's grouped matmul
    wants every operand's rows 16-byte aligned: x [M, H] and gate_up's view (leading dimension H), the activation
    [M, I] and down's view (leading dimension I), and down's view starts 2*I*H items into a slot.

    >>> grouped_shape_problem(2048, 768) is None  # Qwen3-30B-A3B
    True
    >>> grouped_shape_problem(80, 12)
    'intermediate size 12 is not a multiple of 8 (bf16 rows must be 16-byte aligned for grouped matmuls)'
    """
    per_row = 16 // element_size
    for name, size in (("hidden size", hidden), ("intermediate size", intermediate)):
        if size % per_row:
            return (f"{name} {size} is not a multiple of {per_row} (bf16 rows must be 16-byte aligned for grouped "
                    f"matmuls)")
    return None


def grouped_self_check(device: torch.device, dtype: torch.dtype, layout) -> str | None:
    """Run both projections (gate_up, then down) as grouped matmuls over slot-shaped views of 3 slots (the middle
    one empty), as the forward does, against per-expert matmuls; why they disagree or fail, or None."""
    slots = torch.randn(3, layout.numel, device=device, dtype=dtype)  # [3, numel]
    gate_up, down = layout.split_batch(slots)[:2]  # [3, 2I, H], [3, H, I]: the forward's views
    x = torch.randn(5, layout.hidden, device=device, dtype=dtype)  # [5, H]: rows 0-1 slot 0, rows 2-4 slot 2
    a = torch.randn(5, layout.intermediate, device=device, dtype=dtype)  # [5, I]: an activation
    offs = torch.tensor([2, 2, 5], device=device, dtype=torch.int32)
    checks = (("gate_up", x, gate_up), ("down", a, down))
    for name, rows, weight in checks:
        try:
            got = hf_experts.grouped_mm(rows, weight.transpose(1, 2), offs)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            return f"the grouped {name} matmul failed on this device: {type(e).__name__}: {e}"
        want = torch.cat([rows[:2] @ weight[0].T, rows[2:] @ weight[2].T])
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            return f"the grouped {name} matmul on a slot view disagrees with per-expert matmuls"
    return None


def grouped_experts_supported(device: torch.device, dtype: torch.dtype, layout) -> tuple[bool, str]:
    """Whether experts can run grouped over the slots on this device: CUDA, bfloat16, no expert biases, shapes the
    grouped matmul takes, and both projections as grouped matmuls over slot-shaped views matching per-expert
    matmuls (checked once, on the device)."""
    if device.type != "cuda":
        return False, "not a CUDA device (grouped matmuls on the CPU loop over every slot)"
    if dtype != torch.bfloat16:
        return False, f"grouped matmuls take bfloat16 weights, these are {dtype}"
    if layout.bias:
        return False, "the experts have biases, which grouped matmuls do not add"
    problem = grouped_shape_problem(layout.hidden, layout.intermediate) or grouped_self_check(device, dtype, layout)
    if problem is not None:
        return False, problem
    return True, "grouped matmuls over the slots"


def choose_experts_path(device: torch.device, dtype: torch.dtype, layout) -> bool:
    """True: grouped. On CUDA in bfloat16 without biases a refusal of the grouped path (a shape it cannot run, a
    failed or wrong self-check) is said loudly, and the experts run gathered: correct at any shape."""
    ok, reason = grouped_experts_supported(device, dtype, layout)
    if not ok and device.type == "cuda" and dtype == torch.bfloat16 and not layout.bias:
        warnings.warn(f"SpecFit computes experts with gathered weights (a device copy of each group's weights per "
                      f"layer): {reason}", RuntimeWarning, stacklevel=3)
    elif device.type == "cuda":
        log.info("specfit experts path: %s (%s)", "grouped" if ok else "gathered", reason)
    return ok


def specfit_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Registered in transformers' experts interface as ``"specfit"``; ``self`` is the experts module."""
    layer = getattr(self, ATTR, None)
    if layer is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the 'specfit' experts implementation but has no SpecFit runtime attached; "
            f"use specfit.enable(model, ...) rather than setting the implementation by hand")
    return layer.forward(self, hidden_states, top_k_index, top_k_weights)
