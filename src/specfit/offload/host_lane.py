"""The host lane's cost, and an emulated host lane, so the host-expert regime can be reproduced on a CPU.

A *host expert* is a routed expert that misses the slot cache and is computed on the host CPU, from its arena, where
its weights already are: no slot taken, nothing copied. On the host an expert costs about its bytes over the host's
memory bandwidth plus a small fixed cost, nearly flat in the tokens routed to it (measured with torch on one CPU core
at Qwen3-30B-A3B's bf16 expert shape: 1.9 ms for 1 token, 2.2 ms for 32), so ``HostConfig`` prices one host expert at
``overhead + stored bytes / bandwidth + tokens x per_token``.

``EmulatedHostLane`` is a ``link.Timeline``: each host expert occupies the lane for that time, one after the other;
the compute itself is done for real, and the layer's join waits until the lane is done, so the lane overlaps the
"device" work in between (the hits, the copies), as on a GPU machine where the host computes while the GPU does.
Every figure obtained with it is labelled *emulated*. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .link import Timeline, _finite


@dataclass(frozen=True)
class HostConfig:
    """Cost of one emulated host expert: ``overhead + nbytes / bandwidth + tokens * per_token`` seconds.

    ``relative``: a lane defined by the structural rule (``specfit.embedded.default_host``): its bandwidth is
    ``relative`` x the link's it was made for, and it is named by that rule rather than by its GB/s, which differ
    machine to machine.

    >>> h = HostConfig(bandwidth=1e9, overhead=1e-5, per_token=1e-6)
    >>> round(h.expert_time(1_000_000, tokens=4) * 1e3, 6)   # 0.01 + 1 + 0.004 ms
    1.014
    """

    bandwidth: float  # bytes per second the host reads expert weights at
    overhead: float = 0.0  # seconds per host expert (the request to the host's experts kernel)
    per_token: float = 0.0  # seconds per token routed to a host expert (its compute, beside the bytes)
    relative: float | None = None

    def __post_init__(self):
        if not (_finite(self.bandwidth, 0.0) and self.bandwidth > 0):
            raise ValueError(f"host: the host lane's bandwidth must be a finite number > 0 bytes/s (e.g. "
                             f"specfit.embedded.default_host(), or HostConfig(bandwidth=63e9) for a host that reads "
                             f"experts at 63 GB/s), got {self.bandwidth!r}")
        for name in ("overhead", "per_token"):
            if not _finite(getattr(self, name), 0.0):
                raise ValueError(f"host: {name} must be a finite number >= 0 seconds, got {getattr(self, name)!r}")
        if self.relative is not None and not (_finite(self.relative, 0.0) and self.relative > 0):
            raise ValueError(f"host: relative must be a finite number > 0 or None, got {self.relative!r}")

    def expert_time(self, nbytes: int, tokens: int = 1) -> float:
        """Seconds the lane spends on one host expert of ``nbytes`` stored bytes with ``tokens`` routed to it."""
        return self.overhead + nbytes / self.bandwidth + tokens * self.per_token

    @property
    def label(self) -> str:
        if self.relative is not None:
            return f"emulated host lane, {self.relative:g}x the link's bandwidth (structural)"
        return (f"emulated host lane, {self.bandwidth / 1e9:.3g} GB/s + {self.overhead * 1e6:.3g} us per expert + "
                f"{self.per_token * 1e6:.3g} us per token")


class EmulatedHostLane(Timeline):
    """The host lane as a timeline: ``issue`` books one host expert and returns when the lane is done with it."""

    def __init__(self, config: HostConfig):
        super().__init__()
        self.config = config

    def issue(self, nbytes: int, tokens: int) -> float:
        return self.occupy(self.config.expert_time(nbytes, tokens))
