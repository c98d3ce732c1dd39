"""The GSM8K regression on the embedded model and drafter: lossless, fewer copies, acceptance above a floor.

By default the first few GSM8K test questions (CI stays fast); all 80 of the paper's subset under ``-m slow``.
Greedy decoding is deterministic, so the counts compared here are too.
"""

import pytest
import torch

from specfit.evaluation import datasets
from specfit import embedded
from specfit.selection.cost_model import CostModel

SLOTS = 12  # of 64: where copies dominate (the paper's 24 of 128); issue 19's goals are set here
MAX_NEW_TOKENS = 96
# Tokens committed per cycle recorded from the 48-layer embedded model and drafter (fp32, greedy, 96 new tokens, first
# 3 questions, 12 slots, the shipped 12-slot reference profile), 2026-12-01: eagle3 2.80 (7 nodes), specfit 1.84
# (2.77 nodes); copies per token AR 58.2, EAGLE-3 89.8, SpecFit 69.4. The floors leave about 10% for other CPUs'
# rounding. (The 6-layer model's figures, until issue 19: eagle3 3.23, specfit 2.04 at 24 slots.)
TOKENS_PER_CYCLE_FLOOR = {"eagle3": 2.5, "specfit": 1.65}


def questions(n: int) -> list[str]:
    try:
        return datasets.prompts("gsm8k", n)
    except datasets.DataUnavailable as err:
        pytest.skip(f"GSM8K is not reachable (no local data folder and no hub): {err}")


def reference_cost() -> CostModel:
    """The shipped reference profile (one for every slot count and link): SpecFit's choices then do not depend on
    the machine the test runs on."""
    from importlib.resources import as_file, files

    with as_file(files("specfit.calibration").joinpath("embedded.json")) as path:
        return CostModel.load(path, expect={"model_id": embedded.MODEL_ID})


def reference_link_seconds(cost: CostModel) -> float:
    """The structural default link as the reference machine measured it when it made the profile: a link in fixed
    seconds, so the copies SpecFit prices (and therefore its choices) are the same on any machine."""
    return max(cost.meta["probes"]["link_seconds"])


def run(n: int) -> None:
    if not embedded.available():
        pytest.fail("the embedded model and drafter must ship with the package")
    texts = questions(n)
    torch.set_num_threads(1)
    models, cost = {}, reference_cost()
    for method in ("ar", "eagle3", "specfit"):
        # SpecFit's rule on the frozen reference profile (no online refresh, no guard): its choices, and so the
        # counts below, do not depend on this machine's clock
        frozen = dict(cost_model=cost, cost_refresh=False, guard=False) if method == "specfit" else {}
        models[method], tokenizer = embedded.load(SLOTS, link=reference_link_seconds(cost), **frozen)
    totals = {m: None for m in models}
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        outs = {}
        for method, model in models.items():
            outs[method] = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                          assistant=None if method == "ar" else method)
            g = model.specfit.stats.last_generate
            totals[method] = g if totals[method] is None else _add(totals[method], g)
        assert torch.equal(outs["eagle3"], outs["ar"]), f"EAGLE-3 differs from AR on {text[:60]!r}"
        assert torch.equal(outs["specfit"], outs["ar"]), f"SpecFit differs from AR on {text[:60]!r}"
    eagle, fit = totals["eagle3"], totals["specfit"]
    assert fit.copies_per_token < eagle.copies_per_token, (fit.copies_per_token, eagle.copies_per_token)
    assert eagle.tokens_per_cycle >= TOKENS_PER_CYCLE_FLOOR["eagle3"], eagle.tokens_per_cycle
    assert fit.tokens_per_cycle >= TOKENS_PER_CYCLE_FLOOR["specfit"], fit.tokens_per_cycle
    assert fit.nodes_per_cycle < eagle.nodes_per_cycle == 7


def _add(a, b):
    a = a.copy()
    a += b
    return a


def test_gsm8k_first_questions():
    run(3)


@pytest.mark.slow
def test_gsm8k_80_questions():
    run(80)
