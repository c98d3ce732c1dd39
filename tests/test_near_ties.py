"""bf16 and fp16 greedy decoding against plain generate() on a tiny random target: the prompt's forward (hence the
first token's logits) bit-identical, AR on the enabled model bit-identical throughout, and the assistants identical
except at near-ties (evaluation/near_ties.py: deviations within a few noise units measured on plain transformers
alone). A wrong expert or a wrong tree mask in the verify forward is not a near-tie: the judge fails them."""

import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
import specfit.decoding.loop as loop
import specfit.offload.experts as offload_experts
from specfit.drafting.tree import VerifyLayout
from specfit.evaluation import near_ties
from specfit.selection.cost_model import CostModel

COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)
FIRST = 7  # every prompt starts with this token: one self-drafter serves them all


def prompt_of(n: int) -> torch.Tensor:
    """[1, n + 1]: FIRST, then n random tokens."""
    rest = torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n))
    return torch.cat([torch.tensor([[FIRST]]), rest], dim=1)


PROMPTS = [prompt_of(n) for n in (20, 33)]
NEW = 16
GREEDY = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True)


class Case:
    """Plain greedy outputs and logits of each prompt, the noise unit, and an enabled copy with 4 of 16 slots."""

    def __init__(self, dtype):
        plain = tiny_moe().to(dtype)
        self.refs, noise = [], []
        for prompt in PROMPTS:
            out = plain.generate(prompt, **GREEDY)
            logits = near_ties.step_logits(out)
            self.refs.append((near_ties.new_tokens(out, prompt.shape[1]), logits))
            noise += near_ties.shape_noise(plain, out.sequences, prompt.shape[1], logits)
        self.unit = near_ties.noise_unit(noise, torch.cat([logits for _, logits in self.refs]), dtype)
        model = tiny_moe().to(dtype)
        self.model = specfit.enable(model, cache_slots=4, drafter=SelfDrafter(model, first_token=FIRST, noise=0.3),
                                    cost_model=COST)

    def verdicts(self, assistant):
        for prompt, (want, want_logits) in zip(PROMPTS, self.refs):
            out = self.model.generate(prompt, assistant=assistant, **GREEDY)
            got_logits = near_ties.step_logits(out)
            yield (near_ties.judge(want, want_logits, near_ties.new_tokens(out, prompt.shape[1]), got_logits,
                                   self.unit), torch.equal(got_logits[0], want_logits[0]))


_CASES: dict = {}


def case_of(dtype) -> Case:
    """One Case per dtype for the whole module (plain references and noise are the expensive part)."""
    if dtype not in _CASES:
        _CASES[dtype] = Case(dtype)
    return _CASES[dtype]


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def case(request):
    return case_of(request.param)


@pytest.mark.parametrize("assistant", [None, "eagle3", "specfit"])
def test_greedy_matches_plain_generate_up_to_near_ties(case, assistant):
    for verdict, same_first_logits in case.verdicts(assistant):
        assert same_first_logits  # the prompt's forward computed as plain generate() computes it, bit for bit
        assert verdict.ok, verdict
        if assistant is None:  # one token per forward, as plain decoding: nothing to round differently
            assert verdict.divergence is None and verdict.max_deviation == 0.0, verdict


def test_a_wrong_expert_or_mask_is_not_a_near_tie(monkeypatch):
    """Two bugs in the verify forward, each caught by the judge: the last tree position's first expert replaced by
    its neighbour, and tree positions attending to their siblings."""
    case = case_of(torch.bfloat16)
    specfit.configure(case.model, guard=False)  # SpecFit's rule drafts every cycle (the guard may run plain ones)
    forward = offload_experts.LayerRuntime.forward

    def wrong_expert(self, module, hidden_states, top_k_index, top_k_weights):
        if 1 < hidden_states.shape[0] <= 8:  # a verify forward (the prompts are longer)
            top_k_index = top_k_index.clone()
            top_k_index[-1, 0] = (top_k_index[-1, 0] + 1) % 16
        return forward(self, module, hidden_states, top_k_index, top_k_weights)

    with monkeypatch.context() as m:
        m.setattr(offload_experts.LayerRuntime, "forward", wrong_expert)
        assert not all(v.ok for v, _ in case.verdicts("specfit"))
    layout = loop.verify_layout

    def sees_siblings(*args, **kwargs):
        out = layout(*args, **kwargs)
        if out.mask is None:
            return out
        mask = out.mask.clone()
        mask[..., -len(out.parents):] = 0.0
        return VerifyLayout(out.nodes, out.parents, out.tokens, out.position_ids, mask)

    with monkeypatch.context() as m:
        m.setattr(loop, "verify_layout", sees_siblings)
        assert not all(v.ok for v, _ in case.verdicts("eagle3"))
    assert all(v.ok for v, _ in case.verdicts("specfit"))  # the bugs undone: rounding only again


def test_judge_counts_gaps_and_deviations_in_noise_units():
    want_logits = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.9, 0.0], [0.0, 3.0, 1.0]])
    got_logits = want_logits.clone()
    got_logits[1, 1] += 0.2  # plain's 0.1 gap flipped by 0.2 of rounding
    v = near_ties.judge([0, 0, 1], want_logits, [0, 1, 2], got_logits, noise=0.1)
    assert (v.divergence, v.compared, v.first_token_equal) == (1, 2, True)
    assert v.gap == pytest.approx(0.1) and v.gap_units == pytest.approx(1.0)
    assert v.deviation_units == pytest.approx(2.0) and v.near_tie and v.ok
    assert not near_ties.judge([0, 0, 1], want_logits, [0, 1, 2], got_logits, noise=0.09).ok  # 2.2 units: too far
    far = near_ties.judge([0, 0, 1], want_logits, [1, 0, 1], got_logits, noise=0.1)
    assert not far.first_token_equal and far.gap_units == pytest.approx(40.0) and not far.near_tie
    assert near_ties.judge([0, 0, 1], want_logits, [0, 0, 1], want_logits, noise=0.05).divergence is None
    assert near_ties.near_tie_rate(want_logits, 0.2) == pytest.approx(1 / 3)
    assert near_ties.noise_unit([0.0, 0.0], want_logits, torch.bfloat16) == 4 * 2**-7  # one ulp of 5.0 in bf16
    assert near_ties.noise_unit([0.5], want_logits, torch.bfloat16) == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_prompts_forward_is_bit_identical_to_plain_whatever_the_slots_hold(dtype):
    """Every position's logits of a 50-token forward, at 2 slot counts and after another prompt filled the slots:
    each expert multiplies exactly its own rows, as transformers' grouped experts do, so nothing depends on which
    experts shared a group. Fails when a group's rows are padded to its busiest expert's count."""
    prompt = torch.randint(2, 256, (1, 50), generator=torch.Generator().manual_seed(50))
    with torch.no_grad():
        want = tiny_moe().to(dtype)(prompt).logits
        for slots in (2, 6):
            model = specfit.enable(tiny_moe().to(dtype), cache_slots=slots)
            for other in (None, PROMPTS[0]):
                if other is not None:
                    model(other)
                assert torch.equal(model(prompt).logits, want), (slots, other is None)


def test_buckets_by_row_count_compute_the_same_experts(monkeypatch):
    """The gathered path CUDA takes where grouped matmuls cannot run (experts bucketed by row count, one bmm per
    bucket), run on the CPU: the prompt's logits agree with plain's to fp32 rounding, at 2 and 6 slots."""
    monkeypatch.setattr(offload_experts, "gathered_path", lambda device: offload_experts.BUCKETS)
    prompt = torch.randint(2, 256, (1, 50), generator=torch.Generator().manual_seed(50))
    with torch.no_grad():
        want = tiny_moe()(prompt).logits
        for slots in (2, 6):
            got = specfit.enable(tiny_moe(), cache_slots=slots)(prompt).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
