"""A prompt over 128 tokens (issue 44, item 13): at top-4 its forward routes more than 512 (token, k) rows per layer,
where the experts forward groups rows with NumPy instead of a Python loop. Through an enabled model at 2 and 6 slots,
and with every cold expert on the host lane, the logits are plain transformers' bit for bit (``torch.equal``)."""

import numpy as np
import pytest
import torch
from conftest import tiny_moe

import specfit
from specfit.offload.experts import rows_by_expert
from specfit.offload.host_lane import HostConfig

TOKENS = 140  # 560 (token, k) rows at top-4: past the 512-row cut-off
PROMPT = torch.randint(2, 256, (1, TOKENS), generator=torch.Generator().manual_seed(140))


@pytest.fixture(scope="module")
def plain_logits():
    with torch.no_grad():
        return tiny_moe()(PROMPT).logits


@pytest.mark.parametrize("slots, cold", [(2, "copy"), (6, "copy"), (2, "host")])
def test_a_long_prompts_logits_are_plain_bit_for_bit(plain_logits, slots, cold):
    model = tiny_moe()
    assert TOKENS * model.config.num_experts_per_tok > 512
    host = HostConfig(bandwidth=2e9) if cold == "host" else None
    specfit.enable(model, cache_slots=slots, cold=cold, host=host)
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert torch.equal(logits, plain_logits)
    c = model.specfit.stats.total
    assert c.demand > 0 and (c.host_experts == c.demand if cold == "host" else c.misses > 0)


def test_rows_are_grouped_alike_on_both_sides_of_the_cut_off():
    """expert -> its rows, ascending, whether the flat routes have 512 rows or more (what each matmul reads)."""
    flat = np.random.default_rng(0).integers(0, 16, size=600)
    long = rows_by_expert(flat)
    want: dict[int, list[int]] = {}
    for i, e in enumerate(flat.tolist()):
        want.setdefault(e, []).append(i)
    assert long == want and all(isinstance(e, int) for e in long)
    assert sorted(long) == sorted(rows_by_expert(flat[:512]))
