"""Where and when host experts are computed: the host lane's two executors, one interface.

The experts function hands a lane one layer's host work at a time: ``submit(work, costs, counters)`` with ``work``
a function that computes the layer's host experts on the host (rows [R, H] in, their outputs [R, H] out, from the
arena rows as stored: bf16 as is, FP8 dequantized per use) and ``costs`` one (stored bytes, tokens) per host expert;
after the device's hits and copies are queued, ``join(ticket, counters)`` returns the outputs on the compute device.
Counted: ``host_busy_seconds`` (the lane's time on them) and ``host_wait_seconds`` (the Python thread blocked
joining it).

- ``InlineLane``, a CPU "device" (every machine here): an emulated lane (``host_lane.EmulatedHostLane``). ``submit``
  books each host expert on the lane's timeline, then computes it for real on the Python thread; ``join`` waits
  until the lane is done, so the lane's time overlaps whatever the layer did in between (its hits, its copies).
- ``ThreadedLane``, CUDA: the host computes in a worker thread of its own (torch's CPU threads under it), on the
  arenas in host memory, while the Python thread queues the device's hits and copies; ``join`` waits for the worker
  (a wait on host work, not a device sync) and sends the outputs to the device in one non-blocking copy from pinned
  memory, queued on the compute stream before the reads of them. The rows reach the host with the routes, in the
  layer's one planned sync (``experts.routes_to_host``): no host sync is added per layer. Its CUDA calls are in one
  small seam (``HostCopies``) that a CPU test double stands in for. Measured once, at ``enable``
  (``runtime.measure_once``), outside any forward. **Not yet run on a GPU**; on a CPU, CI runs it (its measurement
  too) through the CUDA stand-in (``standin.py``).
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ..stats.counters import Counters
from .host_lane import EmulatedHostLane

ROWS_WITH_ROUTES = 64  # CUDA: tokens up to which a forward's rows go to the host with its routes ("auto")
LANE_EXPERTS = 16  # experts the lane is timed over in turn: ~150 MB between two reads of one at Qwen3-30B-A3B's shape,
# more than a host's last-level cache, so its bytes come from DRAM as a missed expert's do


def machine_threads() -> int:
    """The host lane's torch threads: every core this process may run on but one (the Python thread queues the
    device's work meanwhile), whatever ``torch.set_num_threads`` the caller set for its own thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class InlineLane:
    """The emulated host lane of a CPU device: work computed on the Python thread, its time from the timeline."""

    real = False

    def __init__(self, timeline: EmulatedHostLane):
        self.timeline = timeline

    def expert_seconds(self, nbytes: int, tokens: int = 1) -> float:
        """The lane's own time for one host expert of ``nbytes`` with ``tokens`` routed to it."""
        return self.timeline.config.expert_time(nbytes, tokens)

    def submit(self, work: Callable[[], torch.Tensor], costs: list[tuple[int, int]], counters: Counters):
        ready = 0.0
        for nbytes, tokens in costs:  # booked first: the lane's time runs while the work is computed
            ready = self.timeline.issue(nbytes, tokens)
            counters.host_busy_seconds += self.expert_seconds(nbytes, tokens)
        return work(), ready

    def join(self, ticket, counters: Counters) -> torch.Tensor:
        out, ready = ticket
        counters.host_wait_seconds += self.timeline.wait(ready)
        return out

    def close(self) -> None:
        pass


class HostCopies:
    """The CUDA calls the threaded lane makes, in one small seam, so that a CPU test double can stand in."""

    def __init__(self, device: torch.device):
        self.device = device

    def pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer shaped as ``t`` (torch's caching host allocator: a freed block is reused only after
        the copies recorded on it have run)."""
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def to_device(self, pinned: torch.Tensor) -> torch.Tensor:
        """A device copy of ``pinned``, queued on the current stream (the host goes on at once)."""
        return pinned.to(self.device, non_blocking=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s host memory is page-locked (``pinned_like``'s, or registered with CUDA)."""
        return t.is_pinned()


class ThreadedLane:
    """The real host lane beside a CUDA device: one worker thread computes each layer's host experts while the
    Python thread queues the device's work; the outputs return in one transfer per layer."""

    real = True

    def __init__(self, device: torch.device, copies: HostCopies | None = None, threads: int | None = None):
        self.copies = copies or HostCopies(torch.device(device))
        self.threads = threads or machine_threads()  # the worker's torch threads (its own: not the caller's setting)
        self._pool: ThreadPoolExecutor | None = None  # started on first use
        self.measured: tuple[float, float] | None = None  # (seconds per expert at 1 token, per extra token)

    def expert_seconds(self, nbytes: int, tokens: int = 1) -> float:
        if self.measured is None:
            raise RuntimeError("the host lane's time per expert is measured on first use (measure_lane)")
        base, per_token = self.measured
        return base + (tokens - 1) * per_token

    def submit(self, work: Callable[[], torch.Tensor], costs: list[tuple[int, int]], counters: Counters):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specfit-host-lane",
                                            initializer=torch.set_num_threads, initargs=(self.threads,))
        copies = self.copies

        def run():
            t0 = time.perf_counter()
            out = work()  # [R, H] on the host
            pinned = copies.pinned_like(out)
            pinned.copy_(out)
            return pinned, time.perf_counter() - t0

        return self._pool.submit(run)

    def join(self, ticket, counters: Counters) -> torch.Tensor:
        t0 = time.perf_counter()
        pinned, busy = ticket.result()  # the worker's exceptions are raised here, in the forward
        counters.host_wait_seconds += time.perf_counter() - t0
        counters.host_busy_seconds += busy
        return self.copies.to_device(pinned)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def measure_lane(lane: ThreadedLane, expert_work: Callable[[int], Callable[[], torch.Tensor]],
                 rounds: int = 9) -> tuple[float, float]:
    """Time the real lane at 1 and at 32 tokens (``expert_work(tokens)`` makes the work, which may take another
    expert each run, as a miss brings them; the median of ``rounds`` after two warm-ups each), once per runtime:
    (seconds at 1 token, seconds per extra token)."""
    times = {}
    for tokens in (1, 32):
        work = expert_work(tokens)
        runs = []
        for _ in range(rounds + 2):
            counters = Counters()
            lane.join(lane.submit(work, [], counters), counters)
            runs.append(counters.host_busy_seconds)
        times[tokens] = statistics.median(runs[2:])
    lane.measured = (times[1], max(0.0, times[32] - times[1]) / 31)
    return lane.measured
