"""The decode check's correctness gate on the CUDA stand-in (issue 43): the "small" preset enabled with
``SPECFIT_CUDA_STANDIN=1`` takes the GPU's flow (``cold="auto"``, the threaded host lane, copy streams and events,
pinned staging, registered arenas); correct code passes the gate under the emulated GPU rounding, and each fault the
gate already catches (a wrong expert, a wrong slot, a wrong routing weight) still fails it there."""

import os

import pytest
import torch
from test_decode_gate import PROFILE, prompt, sc, wrong_expert, wrong_routing_weight, wrong_slot

import specfit
from decode_gate import TOLERANCE, other_rounding, reference_gap, token_check  # noqa: E402  (test_decode_gate's path)
from specfit.offload import standin


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-standin")
    summary = sc.write_checkpoint(root / "ckpt", "small", workers=1)
    sc.write_drafter(root / "drafter", summary["config"], draft_vocab_size=256)
    torch.set_num_threads(1)
    saved = os.environ.get(standin.ENV)
    os.environ[standin.ENV] = "1"
    try:
        model = specfit.from_pretrained(root / "ckpt", cache_slots=12, dtype=torch.bfloat16, device="cpu",
                                        drafter=root / "drafter", cost_model=PROFILE)
    finally:
        if saved is None:
            del os.environ[standin.ENV]
        else:
            os.environ[standin.ENV] = saved
    rt = model.specfit
    assert rt.cuda and rt.cold == "auto" and rt.lane.real and rt.store.is_pinned  # the GPU's flow
    rt.lane.measured = (1e-6, 0.0)  # the lane priced cheap: "auto" computes cold experts on it too
    model.generation_config.eos_token_id = None
    return model


def test_correct_code_passes_the_gate_on_the_stand_in(small):
    with other_rounding(small):
        ids = prompt(0).to(small.device)
        ref = reference_gap(small, ids, 4)
        assert ref["max_gap"] < TOLERANCE / 3 and ref["layer_gap"] < TOLERANCE / 3, ref
        for assistant in ("eagle3", "specfit"):
            out = small.generate(ids, max_new_tokens=4, do_sample=False, assistant=assistant)[0, 16:].tolist()
            check = token_check(small, ids, out)
            assert check["steps"] == 4 and not check["failures"], (assistant, check)
    total = small.specfit.stats.total
    assert total.host_experts > 0 and total.misses > 0 and total.pageable_copies == 0  # both paths ran
    assert small.specfit.engine.streams.copies_run > 0


@pytest.mark.parametrize("fault, seen_by", [(wrong_expert, "experts_gap"), (wrong_slot, "experts_gap"),
                                            (wrong_routing_weight, "layer_gap")])
def test_a_fault_fails_the_gate_on_the_stand_in(small, monkeypatch, fault, seen_by):
    small.specfit.clear_cache()
    fault(monkeypatch)
    with other_rounding(small):
        ref = reference_gap(small, prompt(0).to(small.device), 4)
    assert ref[seen_by] > TOLERANCE and ref["max_gap"] > TOLERANCE, ref
