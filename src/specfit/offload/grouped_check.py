"""Whether a layer's experts may run grouped over the slots (``experts.SLOTS``): the device, dtype, biases and shapes a
grouped matmul takes, and a self-check of both projections on slot-shaped views, run once at ``enable``; a refusal
on CUDA in bfloat16 is said loudly and the experts run gathered (correct at any shape)."""

from __future__ import annotations

import logging
import warnings

import torch

from ..seam import experts as hf_experts

log = logging.getLogger("specfit")


def grouped_shape_problem(hidden: int, intermediate: int, element_size: int = 2) -> str | None:
    """Why grouped matmuls over the slot views cannot run at these expert shapes, or None. CUDA's grouped matmul
    wants every operand's rows 16-byte aligned: x [M, H] and gate_up's view (leading dimension H), the activation
    [M, I] and down's view (leading dimension I), and down's view starts 2*I*H items into a slot.

    >>> grouped_shape_problem(2048, 768) is None  # Qwen3-30B-A3B
    True
    >>> grouped_shape_problem(80, 12)
    'intermediate size 12 is not a multiple of 8 (bf16 rows must be 16-byte aligned for grouped matmuls)'
    """
    per_row = 16 // element_size
    for name, size in (("hidden size", hidden), ("intermediate size", intermediate)):
        if size % per_row:
            return (f"{name} {size} is not a multiple of {per_row} (bf16 rows must be 16-byte aligned for grouped "
                    f"matmuls)")
    return None


def grouped_self_check(device: torch.device, dtype: torch.dtype, layout) -> str | None:
    """Run both projections (gate_up, then down) as grouped matmuls over slot-shaped views of 3 slots (the middle
    one empty), as the forward does, against per-expert matmuls; why they disagree or fail, or None."""
    slots = torch.randn(3, layout.numel, device=device, dtype=dtype)  # [3, numel]
    gate_up, down = layout.split_batch(slots)[:2]  # [3, 2I, H], [3, H, I]: the forward's views
    x = torch.randn(5, layout.hidden, device=device, dtype=dtype)  # [5, H]: rows 0-1 slot 0, rows 2-4 slot 2
    a = torch.randn(5, layout.intermediate, device=device, dtype=dtype)  # [5, I]: an activation
    offs = torch.tensor([2, 2, 5], device=device, dtype=torch.int32)
    checks = (("gate_up", x, gate_up), ("down", a, down))
    for name, rows, weight in checks:
        try:
            got = hf_experts.grouped_mm(rows, weight.transpose(1, 2), offs)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            return f"the grouped {name} matmul failed on this device: {type(e).__name__}: {e}"
        want = torch.cat([rows[:2] @ weight[0].T, rows[2:] @ weight[2].T])
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
            return f"the grouped {name} matmul on a slot view disagrees with per-expert matmuls"
    return None


def grouped_experts_supported(device: torch.device, dtype: torch.dtype, layout) -> tuple[bool, str]:
    """Whether experts can run grouped over the slots on this device: CUDA, bfloat16, no expert biases, shapes the
    grouped matmul takes, and both projections as grouped matmuls over slot-shaped views matching per-expert
    matmuls (checked once, on the device)."""
    if device.type != "cuda":
        return False, "not a CUDA device (grouped matmuls on the CPU loop over every slot)"
    if dtype != torch.bfloat16:
        return False, f"grouped matmuls take bfloat16 weights, these are {dtype}"
    if layout.bias:
        return False, "the experts have biases, which grouped matmuls do not add"
    problem = grouped_shape_problem(layout.hidden, layout.intermediate) or grouped_self_check(device, dtype, layout)
    if problem is not None:
        return False, problem
    return True, "grouped matmuls over the slots"


def choose_experts_path(device: torch.device, dtype: torch.dtype, layout) -> bool:
    """True: grouped. On CUDA in bfloat16 without biases a refusal of the grouped path (a shape it cannot run, a
    failed or wrong self-check) is said loudly, and the experts run gathered: correct at any shape."""
    ok, reason = grouped_experts_supported(device, dtype, layout)
    if not ok and device.type == "cuda" and dtype == torch.bfloat16 and not layout.bias:
        warnings.warn(f"SpecFit computes experts with gathered weights (a device copy of each group's weights per "
                      f"layer): {reason}", RuntimeWarning, stacklevel=3)
    elif device.type == "cuda":
        log.info("specfit experts path: %s (%s)", "grouped" if ok else "gathered", reason)
    return ok
