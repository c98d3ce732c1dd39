"""Expert-cache policies judged offline: the routes of real ``generate()`` calls recorded forward by forward, then
replayed through each policy's slot bookkeeping and through Belady's MIN.

``RouteTape`` records, while it is open, every offloaded target forward of a model: its routes, whether it was the
call's prompt forward (its misses are prefill's, not counted per token), and the forecast the decoding method gave
the slot caches before it (SpecFit's drafted pool). ``replay`` runs the tape through ``slots.SlotBook`` with a named
policy (the runtime's own code, fed what the experts function feeds it), so a replay of the policy the tape was
recorded with reproduces the live counters exactly. ``belady`` is Belady's MIN (with bypass) under the plan's rules:
a forward's needed experts are all resident during it (hits keep their slots; misses beyond the slots are
streamed), and afterwards the slots keep, of the experts resident or just copied, those whose next use comes
soonest. With a set of experts per forward and hits kept, that rule is not always the exact optimum (on small
traces it is within one miss of an exhaustive search, and exact on 133 of 135: ``tests/test_cache_policies.py``),
so a policy may in principle come in a hair under it. Both count the misses of decode forwards, as
``stats.last_generate`` does.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..offload.policies import make_policy, tree_forecast
from ..offload.slots import SlotBook

@dataclass
class Tape:
    """Per MoE layer, one entry per recorded forward: the needed experts (ascending) and the tokens routed to each
    (None: a one-token forward), as the experts function passes them to the slot plan."""

    num_layers: int
    num_experts: int
    needed: list[list[list[int]]] = field(default_factory=list)  # [layer][forward] -> experts
    uses: list[list[list[int] | None]] = field(default_factory=list)  # [layer][forward] -> tokens per expert
    counted: list[bool] = field(default_factory=list)  # [forward]: a decode forward (its misses count per token)
    forecasts: list[list[list[float]] | None] = field(default_factory=list)  # [forward] -> [layer][expert] or None
    new_tokens: int = 0  # tokens the recorded calls generated

    def __post_init__(self):
        if not self.needed:
            self.needed = [[] for _ in range(self.num_layers)]
            self.uses = [[] for _ in range(self.num_layers)]

    def __len__(self) -> int:
        return len(self.counted)

    def add(self, routes: np.ndarray, counted: bool, forecast=None) -> None:
        """One forward: ``routes`` bool [tokens, layers, experts]."""
        counts = routes.sum(0)  # [L, E]
        one = routes.shape[0] == 1
        for layer in range(self.num_layers):
            needed = np.flatnonzero(counts[layer]).tolist()
            self.needed[layer].append(needed)
            self.uses[layer].append(None if one else counts[layer, needed].tolist())
        self.counted.append(counted)
        self.forecasts.append(forecast)


class RouteTape:
    """Records the forwards of ``model`` (SpecFit enabled) into ``self.tape`` while ``recording()`` is open."""

    def __init__(self, model):
        rt = model.specfit
        self.runtime = rt
        self.tape = Tape(len(rt.layers), rt.num_experts)

    @contextmanager
    def recording(self):
        rt, tape = self.runtime, self.tape
        end, expect = rt.end_forward, rt.expect_tree
        pending = [None]  # the forecast given since the last forward

        def expect_tree(weights, node_routes):
            expect(weights, node_routes)
            pending[0] = tree_forecast(weights, node_routes) if len(weights) else None

        def end_forward():
            call = rt.stats.scope  # the generate() call in progress (None: a forward outside one)
            prompt = call is not None and call.after_prefill is None  # its first forward: the prefill
            end()
            if rt.untracked:  # a measurement forward: no slot was touched
                return
            tape.add(rt.routes.last.numpy(), counted=call is not None and not prompt, forecast=pending[0])
            pending[0] = None

        rt.end_forward, rt.expect_tree = end_forward, expect_tree
        try:
            yield tape
        finally:
            del rt.end_forward, rt.expect_tree  # the class's methods again


def replay(tape: Tape, slots: int, policy: str, forecasts: bool = True) -> int:
    """Misses of the tape's counted forwards with ``slots`` slots per layer and the named ``policy``, starting empty
    (``forecasts=False``: the recorded forecasts withheld)."""
    misses = 0
    counted = tape.counted
    for layer in range(tape.num_layers):
        book = SlotBook(slots, tape.num_experts, make_policy(policy, tape.num_experts))
        for t, (needed, uses) in enumerate(zip(tape.needed[layer], tape.uses[layer])):
            forecast = tape.forecasts[t]
            if forecasts and forecast is not None:
                book.expect(forecast[layer])
            plan = book.plan(needed, uses=uses)
            if counted[t]:
                misses += len(plan.loads) + len(plan.streamed)
    return misses


def belady(tape: Tape, slots: int) -> int:
    """Misses of the tape's counted forwards under MIN with bypass (see the module docstring), starting empty."""
    return sum(belady_layer(tape.needed[layer], tape.counted, slots) for layer in range(tape.num_layers))


def belady_layer(needed: list[list[int]], counted: list[bool], slots: int) -> int:
    """MIN for one layer's sequence of needed sets: after each forward, keep the experts whose next use comes
    soonest (ties: the one whose following uses come sooner).

    >>> belady_layer([[0, 1], [2], [0], [1], [2]], [True] * 5, 2)  # 2 is streamed: 0 and 1 are needed before it
    4
    """
    uses: dict[int, list[int]] = {}
    for t in range(len(needed) - 1, -1, -1):  # each expert's use times, soonest last (popped as they pass)
        for e in needed[t]:
            uses.setdefault(e, []).append(t)
    resident: set[int] = set()
    misses = 0
    horizon = len(needed)
    for t, now in enumerate(needed):
        for e in now:
            uses[e].pop()
        wanted = set(now)
        hits = wanted & resident
        if counted[t]:
            misses += len(wanted) - len(hits)
        candidates = (resident | wanted) - hits
        room = slots - len(hits)
        if len(candidates) > room:
            soonest = sorted(candidates, key=lambda e: (uses[e][-1:] or [horizon], uses[e][-2:-1] or [horizon], e))
            candidates = set(soonest[:room])
        resident = hits | candidates
    return misses
