"""The real link's own time per expert copy on CUDA: the stored bytes of one expert copied from the pinned host arena
to the device, timed with CUDA events. It prices the cost model's copies (``selection.profiles.link_seconds``) and
the ``cold="auto"`` choice: measured once per runtime, in well under a second, when ``enable`` runs on CUDA (outside
any forward: no forward makes a probe copy or an extra sync), so a profile fitted on this GPU carries over to any slot
count and to experts of another size (an FP8 checkpoint copies half the bytes). Its CUDA calls go through the copy
engine's streams (``cache.CudaStreams``), so the CPU stand-in (``standin.py``) runs it too."""

from __future__ import annotations

import torch

from ..transfer import host_wait
from .cache import CudaStreams

ROUNDS = 24  # timed copies; the median is kept (the first few warm the copy path up)


def copy_seconds(runtime, rounds: int = ROUNDS) -> float:
    """Seconds for one host-to-device copy of one expert's stored bytes (median of ``rounds``), cached on
    ``runtime``."""
    cached = getattr(runtime, "_link_copy_seconds", None)
    if cached is not None:
        return cached
    store = runtime.store
    engine = getattr(runtime, "engine", None)  # a benchmark passes the store and device alone: CUDA's own streams
    streams = engine.streams if engine is not None else CudaStreams(runtime.device)
    source = store.arenas[0][0]  # [expert_numel] one expert as stored, in the pinned arena
    target = torch.empty_like(source, device=runtime.device)
    stream = streams.new_stream(priority=0)  # a stream of its own: no forward's copies queue with the probe's
    streams.tie(target, stream)
    times = []
    with streams.on(stream):
        for _ in range(rounds + 4):
            start, end = streams.event(timing=True), streams.event(timing=True)
            start.record(stream)
            streams.copy(target, source)
            end.record(stream)
            times.append((start, end))
    host_wait(stream, "link bandwidth probe")  # once per runtime, at enable; counted once by the sync counters
    seconds = sorted(s.elapsed_time(e) / 1e3 for s, e in times[4:])
    runtime._link_copy_seconds = seconds[len(seconds) // 2]
    return runtime._link_copy_seconds
