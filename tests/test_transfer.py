"""The pinned staging ring's CUDA ordering, run on a CPU with a fake stream (as tests/test_copy_engine.py does for
the slot cache's copies).

``FakeStream`` stands in for ``transfer.CudaCopies``: a copy and an event record are queued in order and run only
when the test runs the stream, and a copy reads its pinned source when it runs, as a DMA does. So a buffer that is
rewritten before its copy has run shows as a device tensor holding another transfer's values.
"""

import random

import numpy as np
import torch

from specfit import transfer
from specfit.transfer import Staging, to_host


class FakeMarker:
    done = False


class FakeEvent:
    def __init__(self, stream):
        self.stream, self.marker = stream, None

    def record(self):
        self.marker = FakeMarker()
        self.stream.queue.append(("mark", self.marker))

    def query(self):
        return self.marker is None or self.marker.done

    def synchronize(self):
        self.stream.waits += 1
        while not self.query():
            self.stream.step()


class FakeStream:
    """The ``CudaCopies`` interface over one queue that runs only when asked; "device" tensors are CPU tensors that
    hold -1 until their copy has run."""

    def __init__(self):
        self.queue, self.waits, self.copies_run = [], 0, 0

    def pinned(self, n):
        return torch.zeros(n, dtype=torch.int64)

    def copy(self, src):
        dst = torch.full(src.shape, -1, dtype=src.dtype)
        self.queue.append(("copy", dst, src))
        return dst

    def event(self):
        return FakeEvent(self)

    def step(self):
        op = self.queue.pop(0)
        if op[0] == "copy":
            op[1].copy_(op[2])  # reads the pinned buffer now, not when the copy was queued
            self.copies_run += 1
        else:
            op[1].done = True

    def run(self, steps=None):
        for _ in range(len(self.queue) if steps is None else min(steps, len(self.queue))):
            self.step()


def test_no_buffer_is_rewritten_before_its_copy_has_run():
    """Many transfers (some outgrowing their buffer), the stream running a random few queued operations after each:
    once everything has run, every device tensor holds exactly the values it was given."""
    rng = random.Random(0)
    stream = FakeStream()
    staging = Staging("cuda", cuda=stream)
    sent = []
    for i in range(300):
        n = rng.choice((1, 3, 17, 200)) if i % 50 else transfer._CAPACITY + 100  # now and then: grow the buffer
        values = [np.array([rng.randrange(1 << 40) for _ in range(n)]), np.array([i] * rng.randint(0, 3))]
        sent.append((values, staging.to_device(*values)))
        stream.run(steps=rng.choice((0, 0, 1, 2, 3)))
    stream.run()
    for i, (values, out) in enumerate(sent):
        for want, got in zip(values, out):
            assert tuple(got.shape) == want.shape and np.array_equal(got.numpy(), want), f"transfer {i}"
    assert stream.waits > 0  # the ring came round before its copies ran: the case under test happened


def test_the_host_waits_only_when_the_ring_comes_round_first():
    """Nothing has run yet: the first ``_RING`` transfers go on at once; the next one waits for the oldest buffer's
    copy (and for nothing after it). Once the stream has run, transfers never wait."""
    stream = FakeStream()
    staging = Staging("cuda", cuda=stream)
    outs = [staging.to_device([k, k + 1]) for k in range(transfer._RING)]
    assert stream.waits == 0 and stream.copies_run == 0
    outs.append(staging.to_device([100, 101]))
    assert stream.waits == 1 and stream.copies_run == 1 and outs[0].tolist() == [0, 1]
    stream.run()
    for k in range(3 * transfer._RING):
        outs.append(staging.to_device([k]))
        stream.run()
    assert stream.waits == 1
    first = [[k, k + 1] for k in range(transfer._RING)] + [[100, 101]]
    assert [o.tolist() for o in outs] == first + [[k] for k in range(3 * transfer._RING)]


def test_cpu_staging_and_to_host_are_plain_conversions():
    a, b = Staging("cpu").to_device([1, 2, 3], np.array([[True, False]]))
    assert a.tolist() == [1, 2, 3] and b.dtype == torch.int64 and b.tolist() == [[1, 0]]
    x, y = to_host(torch.arange(4, dtype=torch.int32), torch.tensor([0.5]))
    assert x.tolist() == [0, 1, 2, 3] and x.dtype == np.int32 and y.tolist() == [0.5]
