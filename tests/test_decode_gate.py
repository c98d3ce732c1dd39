"""The decode check's correctness gate (tests/gpu/decode_gate.py) on a CPU: under an emulated GPU rounding (the slot
cache's expert matmuls accumulated differently from the reference's) correct code passes, although the router then
switches near-tied routes; a wrong expert, a wrong slot, a wrong routing weight and a wrong tree mask each fail."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.offload.cache import LayerCache
from specfit.offload.experts import LayerRuntime
from specfit.selection.cost_model import CostModel

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import synthetic_checkpoint as sc  # noqa: E402
from decode_gate import TOLERANCE, other_rounding, reference_gap, token_check  # noqa: E402

PROFILE = CostModel(intercepts=(0.01,) * 8, beta=1e-4, copy_overhead=2e-4, link_share=1.0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The "small" preset in bf16 (4 layers x 128 experts top-8, hidden 256, random flat routers), 12 slots, with a
    random drafter: the real routing at a width where another rounding flips near-tied routes."""
    root = tmp_path_factory.mktemp("small")
    summary = sc.write_checkpoint(root / "ckpt", "small", workers=1)
    sc.write_drafter(root / "drafter", summary["config"], draft_vocab_size=256)
    torch.set_num_threads(1)
    model = specfit.from_pretrained(root / "ckpt", cache_slots=12, dtype=torch.bfloat16, device="cpu",
                                    drafter=root / "drafter", cost_model=PROFILE)
    model.generation_config.eos_token_id = None
    return model


def prompt(seed: int, length: int = 16) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def test_correct_code_passes_under_another_rounding_where_unreplayed_routes_fail(small):
    """Review 4's item 1 on a CPU: the emulated rounding switches near-tied routes, and without the replay a switched
    expert moves its row by about its whole spread; with the reference's routes replayed the gaps are rounding's."""
    unreplayed = []
    with other_rounding(small):
        for seed in range(3):
            ids = prompt(seed)
            ref = reference_gap(small, ids, 4)
            assert ref["max_gap"] < TOLERANCE / 3, (seed, ref)
            assert 0 < ref["experts_gap"] and ref["layer_gap"] < TOLERANCE / 3
            unreplayed.append(reference_gap(small, ids, 4, replay=False)["experts_gap"])
            for assistant in ("eagle3", "specfit"):
                out = small.generate(ids, max_new_tokens=4, do_sample=False, assistant=assistant)[0, 16:].tolist()
                check = token_check(small, ids, out)
                assert check["steps"] == 4 and not check["failures"], (seed, assistant, check)
    assert max(unreplayed) > TOLERANCE, unreplayed  # the rounding does flip routes here: the replay is what passes


def wrong_expert(monkeypatch):
    copy = LayerCache._copy
    monkeypatch.setattr(LayerCache, "_copy", lambda self, loads, *a, **k: copy(
        self, [((e + 1) % 128 if self.layer == 1 else e, s) for e, s in loads], *a, **k))


def wrong_slot(monkeypatch):
    gather = LayerCache.gather
    monkeypatch.setattr(LayerCache, "gather", lambda self, slots, index=None: gather(
        self, [(s + 1) % self.num_slots for s in slots]) if self.layer == 1 else gather(self, slots, index))


def wrong_routing_weight(monkeypatch):
    """Every layer's routing weights applied to the wrong experts: the reference pass runs the same experts code, so
    only the comparison with transformers' own experts sees it."""
    forward = LayerRuntime.forward
    monkeypatch.setattr(LayerRuntime, "forward", lambda self, module, x, index, weights: forward(
        self, module, x, index, weights.flip(-1)))


@pytest.mark.parametrize("fault, seen_by", [(wrong_expert, "experts_gap"), (wrong_slot, "experts_gap"),
                                            (wrong_routing_weight, "layer_gap")])
def test_a_fault_in_the_slot_cache_fails_the_gate(small, monkeypatch, fault, seen_by):
    fault(monkeypatch)
    with other_rounding(small):
        ref = reference_gap(small, prompt(0), 4)
    assert ref[seen_by] > TOLERANCE and ref["max_gap"] > TOLERANCE, ref


def test_a_wrong_tree_mask_fails_the_token_check(monkeypatch):
    """A tree mask that hides each node's ancestors (a node sees the prompt and itself): accepted nodes are computed
    without their context, and the assistants' output disagrees with the reference beyond any rounding; with the
    right mask every token is the reference's argmax. A drafter that drafts the target's own tokens makes the tree
    matter (random drafters' nodes are never accepted)."""
    import specfit.drafting.tree as tree

    ids = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(8))
    model = tiny_moe()
    specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=int(ids[0, 0]), noise=0.3),
                   cost_model=CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002,
                                        copy_overhead=0.008, link_share=1.0),
                   guard=False)  # trees every cycle (the guard may run plain ones)
    right = tree.tree_mask

    def own_only(ancestors, base, kv_len, dtype):
        return right(torch.eye(ancestors.shape[0], dtype=ancestors.dtype, device=ancestors.device), base, kv_len, dtype)

    for mask, fails in ((right, False), (own_only, True)):
        monkeypatch.setattr(tree, "tree_mask", mask)
        for assistant in ("eagle3", "specfit"):
            out = model.generate(ids, max_new_tokens=16, do_sample=False, assistant=assistant)[0, 8:].tolist()
            assert model.specfit.stats.last_generate.tokens_per_cycle > 1.5  # nodes were accepted
            check = token_check(model, ids, out)
            assert bool(check["failures"]) == fails, (mask.__name__, assistant, check)
            assert fails or check["equal"] == 16
