"""The grouped-matmul check at ``enable`` (``offload/grouped_check.py``), on the CPU: both projections run in the
self-check, and shapes CUDA's grouped matmul cannot take are refused loudly (the experts then run gathered) instead of
crashing mid-forward (issue 29, 2)."""

import pytest
import torch

from specfit.seam import experts as hf_experts
from specfit.offload.grouped_check import choose_experts_path, grouped_self_check, grouped_shape_problem
from specfit.seam.layers import ExpertLayout


@pytest.mark.parametrize("hidden, intermediate, bad", [(2048, 768, None), (80, 16, None), (64, 32, None),
                                                       (80, 12, "intermediate size 12"), (100, 16, "hidden size 100")])
def test_the_shape_rule_names_the_size_that_is_not_16_byte_aligned(hidden, intermediate, bad):
    problem = grouped_shape_problem(hidden, intermediate)
    assert problem is None if bad is None else bad in problem and "multiple of 8" in problem


def test_enable_refuses_grouped_matmuls_at_shapes_they_cannot_run_and_says_so():
    """On CUDA in bf16 (no device call is needed: the shape rule comes first), I = 12 takes the gathered path with a
    warning naming the size, rather than passing the check and failing inside the down projection."""
    with pytest.warns(RuntimeWarning, match="intermediate size 12 is not a multiple of 8"):
        assert choose_experts_path(torch.device("cuda"), torch.bfloat16, ExpertLayout(80, 12)) is False


def test_the_self_check_passes_where_grouped_matmuls_are_right():
    assert grouped_self_check(torch.device("cpu"), torch.bfloat16, ExpertLayout(64, 32)) is None


def wrong_for(k: int):
    """A grouped matmul that is wrong only when its inner size is ``k`` (one projection's)."""
    original = hf_experts.grouped_mm

    def grouped_mm(x, weight, offs):
        out = original(x, weight, offs)
        return out + 1 if weight.shape[1] == k else out

    return grouped_mm


@pytest.mark.parametrize("projection, k", [("gate_up", 64), ("down", 32)])
def test_the_self_check_runs_both_projections(monkeypatch, projection, k):
    """A grouped matmul wrong only in the down projection (inner size I) fails the check too, as one wrong only in
    gate_up (inner size H) does."""
    monkeypatch.setattr(hf_experts, "grouped_mm", wrong_for(k))
    problem = grouped_self_check(torch.device("cpu"), torch.bfloat16, ExpertLayout(64, 32))
    assert problem == f"the grouped {projection} matmul on a slot view disagrees with per-expert matmuls"


def test_a_grouped_matmul_that_raises_is_reported_not_raised(monkeypatch):
    def broken(x, weight, offs):
        raise RuntimeError("stride must be a multiple of 16 bytes")

    monkeypatch.setattr(hf_experts, "grouped_mm", broken)
    problem = grouped_self_check(torch.device("cpu"), torch.bfloat16, ExpertLayout(64, 32))
    assert "grouped gate_up matmul failed on this device: RuntimeError: stride" in problem
    assert grouped_shape_problem(64, 32) is None
