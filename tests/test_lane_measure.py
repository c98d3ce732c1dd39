"""The real host lane's time per expert is measured once, at 1 and at 32 tokens (issue 54: a 32-token measurement
costs more than a 1-token one): the lane prices a host expert at its 1-token time plus its measured time per extra
token, so work that grows with the tokens routed to it is priced higher for more tokens."""

import time

import pytest
import torch

from specfit.offload import standin
from specfit.offload.host_compute import ThreadedLane, measure_lane


def work_of(per_token: float):
    """An expert's host work that takes 1 ms plus ``per_token`` seconds per token routed to it."""
    def expert_work(tokens):
        def run():
            end = time.perf_counter() + 1e-3 + per_token * tokens
            while time.perf_counter() < end:  # busy, as computing is (a sleep may overshoot by more than a token)
                pass
            return torch.zeros(tokens, 4)  # [tokens, H]
        return run
    return expert_work


@pytest.fixture
def lane():
    lane = ThreadedLane(torch.device("cpu"), standin.HostCopies())
    yield lane
    lane.close()


def test_a_32_token_measurement_costs_more_than_a_1_token_one(lane):
    one, per_token = measure_lane(lane, work_of(1e-4), rounds=5)
    assert lane.measured == (one, per_token)
    assert 1e-3 <= one < 1e-2 and 0.5e-4 < per_token < 3e-4
    assert lane.expert_seconds(0, 32) > lane.expert_seconds(0, 1) + 15e-4  # 31 extra tokens at ~0.1 ms
    assert lane.expert_seconds(0, 32) == pytest.approx(one + 31 * per_token)


def test_work_flat_in_the_tokens_is_priced_flat(lane):
    one, per_token = measure_lane(lane, work_of(0.0), rounds=5)
    assert 31 * per_token < 0.3 * one  # what 31 more tokens add: noise beside the expert's own time
