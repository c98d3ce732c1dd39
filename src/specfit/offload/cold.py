"""Where a cold expert is computed: copied into a slot and computed on the device, or computed on the host.

Vocabulary: per MoE layer and forward, each expert the tokens route to is a *hit* (resident in a slot: computed on
the device), a *copy* (loaded into a slot, or streamed through scratch, then computed on the device) or a *host
expert* (computed on the host from its arena: no slot taken, nothing copied). Copies and host experts are the
layer's *cold* experts. ``cold=`` says how they are split (``COLD_MODES``):

- ``"copy"``: every cold expert is copied (SpecFit's behaviour before the host lane);
- ``"host"``: every cold expert is computed on the host (the slot cache then only ever holds what prefetches bring);
- ``"auto"``: per cold expert, by predicted time (``choose_host``).

The rule of ``"auto"`` (``choose_host``), per layer and forward. Start with every cold expert on the host lane (it
reads an expert faster than the link copies it wherever a host lane pays). Then, most reusable first, move a cold
expert to the link when what it costs *now* is no more than what it is worth *later*:

- now: the change in the layer's finish time, ``max(link, lane)`` over the work the layer queues on each (both run
  beside each other and beside the device's hits). Where the lane is the layer's bottleneck, a copy costs nothing:
  the link would idle;
- later: a copied expert stays in a slot, so each of its uses before it is evicted is a hit instead of a cold
  expert priced at the cheaper of a copy and a host expert; the expert it evicts loses the same. Worth
  ``(reuse(e) - reuse(victim)) x that price``, where ``reuse`` is the expected uses in the next ``HORIZON``
  forwards (``ReuseEstimate``: a per-layer use frequency decayed per forward; the victim a free slot, reuse 0, else
  the resident the slot cache's policy would evict for it, ``policies.py``). A cold expert beyond the free and
  evictable slots would be streamed: worth nothing later.

No torch here: plain numbers and lists, testable in milliseconds. ``reuse`` is one small function on one small
class, so a cache policy that forecasts next use can replace it.
"""

from __future__ import annotations

from typing import Callable, Sequence

COLD_MODES = ("copy", "host", "auto")
DECAY = 0.8  # per forward of the layer: a use 10 forwards ago weighs 0.8**10 ~ 0.1 of one now
HORIZON = 8  # forwards ahead that a copy's residency is valued over


def check_cold(cold) -> str:
    """``cold`` if it is one of ``COLD_MODES``, else a ValueError naming the choices."""
    if cold not in COLD_MODES:
        raise ValueError(f"cold must be one of {COLD_MODES} (how experts that miss the slot cache are computed: "
                         f"'copy' copies each into a slot, 'host' computes each on the host CPU, 'auto' chooses per "
                         f"expert by predicted time), got {cold!r}")
    return cold


class ReuseEstimate:
    """How often one layer's experts were used lately: per expert, a count of the forwards that used it, decayed by
    ``DECAY`` per forward (lazily: only the experts a forward uses are touched).

    >>> r = ReuseEstimate()
    >>> for needed in ([1, 2], [1], [1, 3]):
    ...     r.observe(needed)
    >>> r.reuse(1) > r.reuse(3) > r.reuse(2) > r.reuse(7) == 0.0
    True
    """

    def __init__(self, decay: float = DECAY, horizon: int = HORIZON):
        self.decay, self.horizon = decay, horizon
        self.forward = 0
        self._score: dict[int, tuple[float, int]] = {}  # expert -> (decayed count, forward it was last updated at)

    def observe(self, needed: Sequence[int]) -> None:
        """One forward of the layer used ``needed``."""
        self.forward += 1
        for e in needed:
            score, at = self._score.get(e, (0.0, self.forward))
            self._score[e] = (score * self.decay ** (self.forward - at) + 1.0, self.forward)

    def reuse(self, expert: int) -> float:
        """Expected uses of ``expert`` in the next ``horizon`` forwards: the horizon times its recent rate of use
        (the decayed count times ``1 - decay``, a count's steady state being rate / (1 - decay))."""
        score, at = self._score.get(expert, (0.0, self.forward))
        return self.horizon * (1.0 - self.decay) * score * self.decay ** (self.forward - at)


def choose_host(cold: Sequence[int], tokens: dict[int, int], copy_seconds: float,
                host_seconds: Callable[[int], float], reuse: Callable[[int], float],
                victims: Sequence[float], link_busy: float = 0.0) -> list[int]:
    """The cold experts of one layer and forward that ``"auto"`` computes on the host; the others are copied.

    Args:
        cold: the experts the forward needs that are not resident, ascending.
        tokens: expert -> the (token, k) rows routed to it this forward.
        copy_seconds: the link's own time for one expert copy.
        host_seconds: tokens -> the host lane's own time for one expert with that many tokens.
        reuse: expert -> expected uses in the coming forwards (``ReuseEstimate.reuse``).
        victims: reuse of what the 1st, 2nd, .. copy would evict (0.0 for a free slot), in eviction order; a copy
            beyond them is streamed and keeps nothing.
        link_busy: seconds of copies already queued on the link (prefetches) ahead of this layer's.

    >>> fast_host = choose_host([4, 9], {4: 1, 9: 1}, 1.0, lambda t: 0.4, lambda e: 0.0, [0.0, 0.0])
    >>> fast_host                       # nothing reused: both on the host (0.8 s beats a 1 s copy)
    [4, 9]
    >>> choose_host([4, 9, 11], {4: 1, 9: 1, 11: 1}, 1.0, lambda t: 0.4, lambda e: 0.0, [0.0] * 3)
    [9, 11]
    >>> choose_host([4, 9], {4: 1, 9: 1}, 1.0, lambda t: 0.4, {4: 3.0, 9: 0.0}.get, [0.0, 0.0])
    [9]
    """
    lane = {e: host_seconds(tokens[e]) for e in cold}
    later = min(copy_seconds, host_seconds(1))  # what a later use of a non-resident expert costs
    link, busy = link_busy, sum(lane.values())
    host = set(cold)
    for e in sorted(cold, key=lambda e: (-reuse(e), e)):
        copies = len(cold) - len(host)
        worth = (reuse(e) - victims[copies]) * later if copies < len(victims) else 0.0
        now = max(link + copy_seconds, busy - lane[e]) - max(link, busy)
        if now <= worth:
            host.discard(e)
            link, busy = link + copy_seconds, busy - lane[e]
    return sorted(host)
