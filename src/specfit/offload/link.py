"""An emulated host-to-device link, so the offload regime can be reproduced on a CPU.

Each copy occupies the link for ``LinkConfig.copy_time(nbytes)``; copies queue one behind the other, as on one DMA
engine. ``issue`` returns the wall-clock time at which a copy lands, and compute that needs the expert ``wait``s
until then. Because readiness is a timestamp, a copy issued early (a prefetch) overlaps whatever the CPU does in
the meantime, with no thread. Every figure obtained with it is labelled *emulated*.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

_SPIN_BELOW = 2e-4  # time.sleep overshoots by ~0.1 ms on Linux; spin the last stretch for precision


@dataclass(frozen=True)
class LinkConfig:
    """Cost of one emulated expert copy: ``seconds_per_expert`` or ``latency + nbytes / bandwidth``."""

    seconds_per_expert: float | None = None
    bandwidth: float | None = None  # bytes per second
    latency: float = 0.0  # seconds per copy, added to the bandwidth term
    # a link defined relative to the machine (the embedded model's structural default: a token's full expert demand
    # costs `relative` x 1.4 x its compute), named by that rule rather than by its ms, which differ machine to
    # machine. Cost profiles are filed under the label: since every time of such a profile scales with the machine,
    # the selector's choices (a ratio of tokens to time) carry over from one machine to another
    relative: float | None = None

    def __post_init__(self):
        if (self.seconds_per_expert is None) == (self.bandwidth is None):
            raise ValueError("LinkConfig needs exactly one of seconds_per_expert or bandwidth")
        # finite, or the first copy's landing time overflows the clock (a free link is seconds_per_expert=0)
        if self.seconds_per_expert is not None and not _finite(self.seconds_per_expert, 0.0):
            raise ValueError(f"link: seconds per expert copy must be a finite number >= 0 (0: a free link), got "
                             f"{self.seconds_per_expert!r}")
        if self.bandwidth is not None and not (_finite(self.bandwidth, 0.0) and self.bandwidth > 0):
            raise ValueError(f"link: bandwidth must be a finite number > 0 bytes/s, got {self.bandwidth!r}")
        if not _finite(self.latency, 0.0):
            raise ValueError(f"link: latency must be a finite number >= 0 seconds, got {self.latency!r}")

    def copy_time(self, nbytes: int) -> float:
        if self.seconds_per_expert is not None:
            return self.seconds_per_expert
        return self.latency + nbytes / self.bandwidth

    @property
    def label(self) -> str:
        if self.relative is not None:
            scale = "" if self.relative == 1 else f"{self.relative:g}x "
            return f"emulated link, {scale}structural default"
        if self.seconds_per_expert is not None:
            return f"emulated link, {self.seconds_per_expert * 1e3:.3g} ms per expert copy"
        return f"emulated link, {self.bandwidth / 1e9:.3g} GB/s + {self.latency * 1e6:.3g} us per copy"


def _finite(value, low: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= low


def sleep_until(t: float) -> None:
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        if left > _SPIN_BELOW:
            time.sleep(left - _SPIN_BELOW)


class Timeline:
    """One emulated resource that serves its work one item after the other (a DMA engine, the host lane): work
    queued now starts when the resource is free and occupies it for a set time; the work's readiness is a
    ``perf_counter`` timestamp, so whatever the CPU does meanwhile overlaps it, with no thread."""

    def __init__(self):
        self._free_at = 0.0  # when the resource finishes its last queued work

    def occupy(self, seconds: float) -> float:
        """Queue ``seconds`` of work; return the perf_counter time at which it is done."""
        start = max(time.perf_counter(), self._free_at)
        self._free_at = start + seconds
        return self._free_at

    def wait(self, ready_at: float) -> float:
        """Block until work queued earlier is done; return the seconds spent waiting."""
        t0 = time.perf_counter()
        sleep_until(ready_at)
        return max(0.0, time.perf_counter() - t0)

    def busy(self) -> float:
        """Seconds of work still queued ahead of anything queued now."""
        return max(0.0, self._free_at - time.perf_counter())

    def reset(self) -> None:
        self._free_at = 0.0


class EmulatedLink(Timeline):
    def __init__(self, config: LinkConfig):
        super().__init__()
        self.config = config

    def issue(self, nbytes: int) -> float:
        """Queue one copy; return the perf_counter time at which it lands."""
        return self.occupy(self.config.copy_time(nbytes))
