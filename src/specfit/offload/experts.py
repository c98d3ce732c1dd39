"""The ``"specfit"`` experts implementation: an experts forward that reads expert weights through the slot cache
instead of the module's own (released) parameters.

Per layer and forward: the routes reach the host once (the one planned host sync: the layer's experts are known
only then; with a host lane in use the layer's rows come with them, in the same transfer); the host plans everything
else — which experts are hits, copies (loads or streamed) or host experts (``cold.py``), and for each group of
experts that become ready together (``LayerCache.ready``), which rows each reads and where its outputs go — and sends
those indices to the device in one transfer that does not stop the host (``transfer.Staging``). The host experts go
to the host lane (``host_compute.py``), which computes them beside the device; compute on the device then runs a few
batched calls per group, the hits' compute overlapping the misses' copies and the host lane:

- *grouped over the slots* (CUDA, bfloat16, no expert biases): one ``grouped_mm`` per projection over *all* slots,
  with the rows sorted by slot and per-slot offsets, so no weight is copied on the device (transformers' grouped_mm
  path does the same over its parameters);
- *grouped over the group* (CPU): one ``grouped_mm`` per projection over the group's weights, gathered from the
  slots (a view when they are consecutive), with per-expert offsets: on the CPU that is one matmul per expert over
  exactly its rows, which is what transformers' default experts (``grouped_mm``) compute there, bit for bit;
- *bucketed* (CUDA where grouped matmuls cannot run): the group's experts bucketed by row count, one ``bmm`` per
  projection and bucket over their gathered weights.

No path pads an expert's rows to a busier expert's count: a matmul's row can round differently in a taller matrix
(in bf16 and fp16, and in fp32 on the CPU), so padding would make the result depend on which experts share a group,
that is on what the slot cache held, and a prompt's forward would not give plain ``generate()``'s logits.

The result does not depend on which experts were resident or where they were computed: every (token, k)
contribution, the host lane's included, is written to its own row and the k rows of a token are summed in a fixed
order at the end, as transformers' batched path does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.torch_version import TorchVersion

from ..seam import experts as hf_experts
from .cache import Group
from ..transfer import to_host
from .cold import ReuseEstimate, choose_host

ATTR = "_specfit"  # attribute on each patched experts module, pointing to its LayerRuntime


class LayerRuntime:
    def __init__(self, runtime, index: int, cache):
        # runtime: the SpecFitRuntime (model.specfit); cache: this layer's LayerCache; index: 0-based among MoE layers
        self.runtime, self.index, self.cache = runtime, index, cache
        self.reuse = ReuseEstimate()  # how often this layer's experts were used lately ("auto" values copies by it)

    def forward(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, rows_out: list | None = None) -> torch.Tensor:
        rt = self.runtime
        num_tokens, top_k = top_k_index.shape
        rt.routes.record(self.index, top_k_index)
        lane = None if rt.untracked else rt.lane_for(num_tokens)  # None: every cold expert is copied
        # [T*k] the one planned host sync per layer; with a lane, the rows [T, H] on the host come with it
        flat, x_host = routes_to_host(top_k_index, hidden_states, lane is not None, rt.cuda)
        rows = rows_by_expert(flat)  # expert -> its (token, k) rows, on the host: no device bincount
        needed = sorted(rows)
        host = []
        if rt.untracked:
            fetch = None
        else:
            if lane is not None:
                host = self._cold(needed, rows)
            self.reuse.observe(needed)
            on_host = set(host)
            device = [e for e in needed if e not in on_host]
            uses = [len(rows[e]) for e in device] if num_tokens > 1 else None  # tokens per expert, for the policy
            fetch = self.cache.start(device, rt.forward_counters, host=len(host), uses=uses)
        groups = [("untracked", needed, None)] if fetch is None else fetch.groups
        grouped = rt.grouped_experts and fetch is not None
        gathered = gathered_path(hidden_states.device)
        plans = [plan_group(rows, top_k, experts, slots, SLOTS if grouped and slots is not None else gathered,
                            self.cache.num_slots) for kind, experts, slots in groups]  # per group: its plans
        if fetch is None:  # the measurement's own buffer, its experts in plan order: each plan's is a slice of it
            ready = iter([Group("untracked", needed, None, self._untracked([e for p in plans[0] for e in p.experts]))])
        else:
            ready = self.cache.ready(fetch)
        # the host lane's calls, run by run of consecutive experts (each run's weights: one view of the arena)
        host_plans = [p for run in consecutive_runs(host) for p in plan_group(rows, top_k, run, None, HOST_PATH, 0)]
        # every index of the layer in one host -> device transfer: rows to read and write, slots, offsets; then where
        # the host lane's outputs go
        host_dest = [d for p in host_plans for d in p.dest]
        index = rt.staging.to_device(*[a for group in plans for p in group for a in p.arrays()],
                                     *([host_dest] if host else []))
        index = iter([index] if isinstance(index, torch.Tensor) else index)
        hidden = hidden_states.shape[-1]
        out = hidden_states.new_empty(num_tokens * top_k, hidden)  # [T*k, H]: one row per (token, k)
        ticket = None
        if host:  # after the copies were issued (the link runs), before the device's compute (the lane runs beside)
            nbytes = rt.store.expert_bytes
            ticket = lane.submit(host_work(module, rt.store, self.index, x_host, host_plans),
                                 [(nbytes, len(rows[e])) for e in host], rt.forward_counters)
        for group_plans in plans:
            group = next(ready)
            first = 0  # where the plan's experts start in a group's own buffer (streamed, untracked)
            for plan in group_plans:
                take, dest, slots, offsets = next(index), next(index), next(index), next(index)
                x = hidden_states.index_select(0, take)  # [rows, H]
                if plan.how == SLOTS:  # no weight moves
                    parts = rt.store.layout.split_batch(self.cache.slots)
                    y = hf_experts.experts_forward_grouped(module, x, parts[0], parts[1], offsets.to(torch.int32))
                else:
                    n = len(plan.experts)
                    w = self.cache.gather(plan.slots, slots) if group.weights is None else \
                        group.weights[first:first + n]  # [n, numel]
                    first += n
                    parts = rt.store.compute_parts(w)  # in the compute dtype (FP8 rows dequantized); math: hf_experts
                    if plan.how == OWN:
                        y = hf_experts.experts_forward_grouped(module, x, *parts[:2], offsets.to(torch.int32),
                                                               *parts[2:])
                    else:
                        y = hf_experts.experts_forward_batched(module, x.view(n, plan.width, -1), *parts)
                out.index_copy_(0, dest, y.reshape(-1, hidden))
        for _ in ready:  # the last group's waits are done; close the generator (marks the scratch ring free)
            pass
        if ticket is not None:  # the host lane's outputs join the device's rows before the fixed-order sum
            out.index_copy_(0, next(index), lane.join(ticket, rt.forward_counters))
        if rows_out is not None:
            rows_out.append(out)
        return combine(out, top_k_weights)

    def forward_rows(self, module, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """[T*k, H]: each (token, k)'s expert output, unweighted (``forward`` without the final sum)."""
        rows = []
        self.forward(module, hidden_states, top_k_index, top_k_weights, rows_out=rows)
        return rows[0]

    def input_grad(self, module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   grad_rows: torch.Tensor) -> torch.Tensor:
        """Backward of the expert rows with respect to ``hidden_states`` [T, H]: ``grad_rows`` [T*k, H] is the
        gradient of each (token, k)'s expert output. Every needed expert is read again from the host store (its
        true values, whatever the slots hold now) and recomputed with autograd, bucket by row count (no padding);
        no slot, counter or emulated link is touched. The experts' own weights get no gradient (they are frozen
        while offloaded)."""
        top_k = top_k_index.shape[1]
        rows = rows_by_expert(to_host(top_k_index.reshape(-1))[0])  # [T*k] -> expert: its rows
        device = hidden_states.device
        grad = torch.zeros_like(hidden_states)  # [T, H]
        for plan in plan_group(rows, top_k, sorted(rows), None, BUCKETS, self.cache.num_slots):
            take = torch.as_tensor(plan.take, device=device)
            dest = torch.as_tensor(plan.dest, device=device)
            parts = self.runtime.store.compute_parts(self._untracked(plan.experts))  # [n, ...] compute dtype
            with torch.enable_grad():
                x = hidden_states.detach().index_select(0, take).requires_grad_()  # [n * width, H]
                y = hf_experts.experts_forward_batched(module, x.view(len(plan.experts), plan.width, -1), *parts)
                (grad_x,) = torch.autograd.grad(y.reshape(-1, y.shape[-1]), x, grad_rows.index_select(0, dest))
            grad.index_add_(0, take, grad_x.to(hidden_states.dtype))
        return grad

    def _cold(self, needed: list[int], rows: dict[int, list[int]]) -> list[int]:
        """The experts of ``needed`` this forward computes on the host lane: none (``cold="copy"``), every one not
        resident (``"host"``), or those ``cold.choose_host`` picks (``"auto"``)."""
        rt, lru = self.runtime, self.cache.lru
        cold = [e for e in needed if lru.slot_of(e) is None]
        if not cold or rt.cold != "auto":
            return cold if rt.cold == "host" else []
        resident = lru.resident  # expert -> slot, least recently used first
        free = lru.num_slots - len(resident)
        victims = [0.0] * free  # free slots first, then the residents the cache policy would evict for the rest
        if len(cold) > free:
            victims += [self.reuse.reuse(v) for v in lru.policy.victims(resident, set(needed), cold[free:])
                        if v is not None]  # None: no evictable slot, the copy is streamed and keeps nothing
        return choose_host(cold, {e: len(rows[e]) for e in cold}, rt.copy_seconds(), rt.host_seconds,
                           self.reuse.reuse, victims, rt.link_busy())

    def _untracked(self, needed: list[int]) -> torch.Tensor:
        """The needed experts' weights [n, numel] straight from the arena, for the route oracle's measurement
        forwards: no slots, no counters, no emulated link. One asynchronous copy per expert from the pinned rows
        (no gather into fresh pageable memory first)."""
        arena = self.runtime.store.arenas[self.index]
        device = self.cache.engine.device
        if not self.runtime.cuda:  # (the CUDA stand-in takes the CUDA path below)
            return arena.index_select(0, torch.as_tensor(needed))
        buf = torch.empty(len(needed), arena.shape[1], dtype=arena.dtype, device=device)
        for i, e in enumerate(needed):
            buf[i].copy_(arena[e], non_blocking=True)
        return buf


SLOTS, OWN, BUCKETS = "slots", "own", "buckets"  # how a group's experts are computed (see the module's docstring)


def combine(rows: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """rows [T*k, H] (each (token, k)'s expert output) weighted by top_k_weights [T, k] and summed over k -> [T, H],
    in a fixed order (as transformers' batched path sums them)."""
    num_tokens, top_k = top_k_weights.shape
    out = rows * top_k_weights.reshape(-1, 1).to(rows.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


class TrainableExperts(torch.autograd.Function):
    """The experts of one layer under autograd: the forward runs as at inference (no graph through the slots, whose
    weights later copies overwrite), the backward recomputes each needed expert from the host store
    (``LayerRuntime.input_grad``). Gradients reach the hidden states and the routing weights (so attention, routers,
    norms and embeddings train); the routed experts themselves stay frozen, said once per model."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, layer, module, top_k_index):
        with torch.no_grad():
            rows = layer.forward_rows(module, hidden_states, top_k_index, top_k_weights)  # [T*k, H]
        ctx.layer, ctx.module = layer, module
        ctx.save_for_backward(hidden_states, top_k_weights, top_k_index, rows)
        return combine(rows, top_k_weights)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [T, H]
        hidden_states, top_k_weights, top_k_index, rows = ctx.saved_tensors
        ctx.layer.runtime.warn_frozen_experts()
        num_tokens, top_k = top_k_weights.shape
        grad_rows = grad_out[:, None, :].to(rows.dtype) * top_k_weights[..., None].to(rows.dtype)  # [T, k, H]
        grad_hidden = grad_weights = None
        if ctx.needs_input_grad[1]:
            grad_weights = (rows.view(num_tokens, top_k, -1) * grad_out[:, None, :].to(rows.dtype)).sum(-1)
            grad_weights = grad_weights.to(top_k_weights.dtype)  # [T, k]
        if ctx.needs_input_grad[0]:
            grad_rows = grad_rows.reshape(-1, rows.shape[-1])  # [T*k, H]
            grad_hidden = ctx.layer.input_grad(ctx.module, hidden_states, top_k_index, grad_rows)
        return grad_hidden, grad_weights, None, None, None


def routes_to_host(top_k_index: torch.Tensor, hidden_states: torch.Tensor, with_rows: bool,
                   as_bytes: bool | None = None):
    """(flat routes [T*k] as NumPy, the rows [T, H] on the host or None): one transfer, the layer's one planned host
    sync. The rows come only ``with_rows`` (a host lane may compute some of the layer's experts), packed as bytes
    beside the routes (``as_bytes``; default: on a device other than the CPU, where they are the rows themselves)."""
    if not with_rows:
        return to_host(top_k_index.reshape(-1))[0], None
    if not (hidden_states.device.type != "cpu" if as_bytes is None else as_bytes):
        return to_host(top_k_index.reshape(-1))[0], hidden_states
    # as bytes: NumPy has no bfloat16; viewed back as the compute dtype on the host
    flat, raw = to_host(top_k_index.reshape(-1), hidden_states.contiguous().view(torch.uint8), pack=True)
    return flat, torch.from_numpy(raw).view(hidden_states.dtype)


def host_work(module, store, layer: int, x_host: torch.Tensor, plans: list):
    """The host lane's work for one layer: each plan's experts (consecutive ids) computed from their arena rows (a
    view, as stored: FP8 dequantized per use) on the rows the plan takes, over exactly their own rows as the CPU
    computes a gathered group (``HOST_PATH``). Returns a function giving their outputs [R, H] on the host, in
    ``plans``' dest order."""
    arena = store.arenas[layer]  # [E, numel] in host memory

    def work() -> torch.Tensor:
        out = []
        for plan in plans:
            experts = plan.experts
            w = arena[experts[0]: experts[0] + len(experts)] if experts[-1] - experts[0] == len(experts) - 1 else \
                arena.index_select(0, torch.as_tensor(experts))  # [n, numel]
            parts = store.compute_parts(w)  # [n, ...] in the compute dtype
            x = x_host.index_select(0, torch.as_tensor(plan.take))  # [rows, H]
            if plan.how == OWN:
                offsets = torch.as_tensor(plan.offsets, dtype=torch.int32)
                y = hf_experts.experts_forward_grouped(module, x, *parts[:2], offsets, *parts[2:])  # [rows, H]
            else:
                y = hf_experts.experts_forward_batched(module, x.view(len(experts), plan.width, -1), *parts)
            out.append(y.reshape(-1, x.shape[-1]))
        return out[0] if len(out) == 1 else torch.cat(out)

    return work


def consecutive_runs(experts: list[int]) -> list[list[int]]:
    """Ascending ids split into runs of consecutive ones.

    >>> consecutive_runs([1, 2, 3, 7, 9, 10])
    [[1, 2, 3], [7], [9, 10]]
    """
    runs: list[list[int]] = []
    for e in experts:
        if runs and runs[-1][-1] == e - 1:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


class GroupPlan:
    """Host-side indices of one matmul call of a group: its ``experts``, ``take`` (token rows read), ``dest``
    ((token, k) rows written), the ``slots`` to gather (None: grouped over every slot, or the group's own buffer
    holds the weights), ``offsets`` (grouped: each slot's, or each expert's, end row) and ``width`` (bucketed: rows
    per expert)."""

    __slots__ = ("how", "experts", "take", "dest", "slots", "offsets", "width")

    def __init__(self, how, experts, take, dest, slots=None, offsets=None, width=0):
        self.how, self.experts, self.take, self.dest = how, experts, take, dest
        self.slots, self.offsets, self.width = slots, offsets, width

    def arrays(self) -> tuple:
        return self.take, self.dest, self.slots or [], self.offsets or []


# torch's CPU grouped matmul: from 2.11 any dtype and alignment, as transformers (5.24, integrations/moe.py,
# _can_use_grouped_mm) states it: "on CPU with torch <= 2.10, the kernel requires 16 bytes alignment" of the operands'
# data pointers, "with torch <= 2.8 ... no CPU kernel at all" (it then loops one matmul per expert, which BUCKETS
# matches in fp32). Review 5 read a transformers PR table placing the fix in 2.13; the shipped check says 2.11, and the
# GPU check's host-lane operands (arena rows of 16-byte multiples, fresh index_select outputs) are aligned either way
_CPU_GROUPED_MM = TorchVersion(torch.__version__) >= (2, 11)


def gathered_path(device: torch.device) -> str:
    """How a group with gathered weights computes: ``OWN`` on the CPU (there ``grouped_mm`` is one matmul per group in
    any dtype, transformers' own computation), else ``BUCKETS`` (CUDA's grouped matmuls take bf16 only)."""
    return OWN if device.type == "cpu" and _CPU_GROUPED_MM else BUCKETS


HOST_PATH = gathered_path(torch.device("cpu"))  # how the host lane computes: as the CPU computes a gathered group


def plan_group(rows: dict[int, list[int]], top_k: int, experts: list[int], slots: list[int] | None, how: str,
               num_slots: int) -> list[GroupPlan]:
    """The matmul calls of one group. ``rows[e]``: the (token, k) rows routed to expert e (``rows_by_expert``);
    ``slots``: each expert's slot (None: the group's own buffer holds the weights, in the order of the plans'
    experts). Every expert's rows stay unpadded and in order, so each expert multiplies exactly its own rows.

    - ``SLOTS``: one plan, rows sorted by slot, ``offsets[s]`` ends slot s's rows (every slot of the layer).
    - ``OWN``: one plan over the group's experts, ``offsets[j]`` ends expert j's rows.
    - ``BUCKETS``: one plan per row count C (ascending), expert j of a bucket reading ``take[j*C:(j+1)*C]``.

    >>> rows = rows_by_expert(np.array([3, 1, 1, 0]))   # token 0 -> experts 3, 1; token 1 -> experts 1, 0 (top-2)
    >>> p, = plan_group(rows, 2, [1, 3], [2, 0], SLOTS, 4)
    >>> p.take, p.dest, p.offsets
    ([0, 0, 1], [0, 1, 2], [1, 1, 3, 3])
    >>> p, = plan_group(rows, 2, [1, 3, 0], [2, 0, 1], OWN, 4)
    >>> p.take, p.dest, p.slots, p.offsets
    ([0, 1, 0, 1], [1, 2, 0, 3], [2, 0, 1], [2, 3, 4])
    >>> [(p.experts, p.take, p.dest, p.slots, p.width) for p in plan_group(rows, 2, [1, 3, 0], [2, 0, 1], BUCKETS, 4)]
    [([3, 0], [0, 1], [0, 3], [0, 1], 1), ([1], [0, 1], [1, 2], [2], 2)]
    """
    if how == SLOTS:
        take, dest, per_slot = [], [], [0] * num_slots
        for slot, e in sorted(zip(slots, experts)):
            dest += rows[e]
            per_slot[slot] = len(rows[e])
        return [GroupPlan(how, experts, [i // top_k for i in dest], dest, offsets=np.cumsum(per_slot).tolist())]
    if how == OWN:
        dest = [i for e in experts for i in rows[e]]
        return [GroupPlan(how, experts, [i // top_k for i in dest], dest, slots,
                          np.cumsum([len(rows[e]) for e in experts]).tolist())]
    slot_of = dict(zip(experts, slots)) if slots is not None else None
    buckets: dict[int, list[int]] = {}
    for e in experts:
        buckets.setdefault(len(rows[e]), []).append(e)
    plans = []
    for width in sorted(buckets):
        members = buckets[width]
        dest = [i for e in members for i in rows[e]]
        plans.append(GroupPlan(how, members, [i // top_k for i in dest], dest,
                               None if slot_of is None else [slot_of[e] for e in members], width=width))
    return plans


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


# torch.compile traces around the experts, never into them; fullgraph=True is refused with this reason
COMPILE_REASON = ("SpecFit plans each MoE layer's expert copies on the host from the layer's routes, which a compiled "
                  "graph cannot hold: compile without fullgraph=True (the graph breaks at each MoE layer's experts), "
                  "or call specfit.disable(model) first")


def specfit_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Registered in transformers' experts interface as ``"specfit"``; ``self`` is the experts module. Under
    autograd (a forward whose output needs a gradient) the experts run as ``TrainableExperts``; traced by
    torch.compile, outside the graph (eager calls skip that wrapper: it costs microseconds per call)."""
    if torch.compiler.is_compiling():
        return _experts_outside_graph(self, hidden_states, top_k_index, top_k_weights)
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights)


@torch.compiler.disable(reason=COMPILE_REASON)
def _experts_outside_graph(self, hidden_states, top_k_index, top_k_weights):
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    layer = getattr(self, ATTR, None)
    if layer is None and hf_experts.built_from_enabled(self):  # a plain model built from an enabled model's config
        return hf_experts.plain_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if layer is None:
        raise RuntimeError(
            f"{type(self).__name__} runs the 'specfit' experts implementation but has no SpecFit runtime attached; "
            f"use specfit.enable(model, ...) rather than setting the implementation by hand")
    if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
        return TrainableExperts.apply(hidden_states, top_k_weights, layer, self, top_k_index)
    return layer.forward(self, hidden_states, top_k_index, top_k_weights)
