"""calibrate's host-lane rounds bounded by the lane's measured speed (review 7, item 8).

A lane round computes every expert of every forward on the host (``cold="host"`` from an empty slot cache), so its
time is about the experts the planning round computed times the lane's own time per expert, known before the round
starts (the real lane is measured at ``enable``; an emulated one is set). On a host whose lane is slow (no bf16
instructions in a VM, a contended machine) that alone can pass a time limit: ``bounded_lanes`` then skips the lane
rounds, says why, and the profile prices host experts at the lane's own measured time instead of a fitted share.
"""

from __future__ import annotations

import warnings

PREFILL_TOKENS = 32  # tokens per expert a prompt's forward is priced at (the lane is measured at 1 and 32)


def lane_expert_seconds(runtime, lane, tokens: int) -> float:
    """One host expert's time with ``tokens`` routed to it on ``lane`` (``True``: the model's own lane, measured; a
    ``HostConfig``: an emulated lane, as set)."""
    if lane is True:
        return runtime.host_seconds(tokens)
    return lane.expert_time(runtime.store.expert_bytes, tokens)


def round_seconds(runtime, lane, decode_experts: int, prefill_experts: int) -> float:
    """The lane's own time in one round that computes on it every expert the planning round computed:
    ``decode_experts`` in decoding cycles (a token or a few each), ``prefill_experts`` in the prompts' forwards."""
    return (decode_experts * lane_expert_seconds(runtime, lane, 1)
            + prefill_experts * lane_expert_seconds(runtime, lane, PREFILL_TOKENS))


def bounded_lanes(runtime, lanes: list, planned: tuple[int, int], repeats: int, budget: float | None,
                  fits_without: bool) -> list:
    """``lanes``, or none when their rounds (``repeats`` each) would take the lane more than ``budget`` seconds
    (``planned``: the experts the planning round computed while decoding and in prefills); skipped with a warning
    that gives the estimate. ``fits_without``: whether the fit has enough records without them (else they are kept
    and the warning says the time limit may pass)."""
    if budget is None or not lanes:
        return lanes
    estimate = repeats * sum(round_seconds(runtime, lane, *planned) for lane in lanes)
    if estimate <= budget:
        return lanes
    per_expert = lane_expert_seconds(runtime, lanes[0], 1)
    what = (f"the host-lane rounds would take the lane about {estimate:.0f} s ({sum(planned):,} experts per round "
            f"at {per_expert * 1e3:.2f} ms each, 1 token), over the {budget:g} s allowed (--lane-seconds)")
    if not fits_without:
        warnings.warn(f"calibrate: {what}; kept, as the fit needs their records: the run may pass its time limit",
                      RuntimeWarning, stacklevel=3)
        return lanes
    warnings.warn(f"calibrate: {what}: skipped. The profile prices a host expert at the lane's own measured time "
                  f"(no fitted share); give more time or fewer probes to fit it", RuntimeWarning, stacklevel=3)
    return []
