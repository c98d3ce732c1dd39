"""Tree decoding inside generate(): lossless against plain generate(), on a tiny random target (fp32, CPU) with
offloading on at a small slot count."""

import itertools

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.selection.cost_model import CostModel
from specfit.patch import configure

PROMPTS = [torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 21, 34, 50)]
SHAPES = [  # topk, depth, pool_nodes, max_nodes
    dict(topk=2, depth=5, pool_nodes=18, max_nodes=7),
    dict(topk=1, depth=4, pool_nodes=4, max_nodes=4),
    dict(topk=3, depth=3, pool_nodes=12, max_nodes=5),
    dict(topk=2, depth=2, pool_nodes=6, max_nodes=1),
    dict(topk=2, depth=5, pool_nodes=10, max_nodes=0),
]
# a cost model under which SpecFit's choices vary: a few nodes pay off, wide unions do not
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


def enabled(prompt, noise=0.3, slots=4, sharpen=1.0, **kw):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(prompt[0, 0]), noise=noise, sharpen=sharpen)
    return specfit.enable(model, cache_slots=slots, drafter=drafter, cost_model=COST, **kw)


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_greedy_equals_plain_generate(assistant):
    """5 prompts x 2 lengths x 5 tree shapes = 50 combinations per assistant."""
    reference = tiny_moe()
    checked = 0
    for (p, prompt), length in itertools.product(enumerate(PROMPTS), (6, 23)):
        expected = reference.generate(prompt, max_new_tokens=length, do_sample=False)
        model = enabled(prompt, noise=0.3)
        for shape in SHAPES:
            configure(model, **shape)
            out = model.generate(prompt, max_new_tokens=length, do_sample=False, assistant=assistant)
            assert torch.equal(out, expected), f"prompt {p}, {length} tokens, tree {shape}"
            g = model.specfit.stats.last_generate
            assert g.new_tokens == length and g.nodes_per_cycle <= shape["max_nodes"]
            checked += 1
    assert checked == 50


def test_self_drafter_path_fully_accepted():
    """A drafter that proposes the target's own next tokens, drafting a 5-node chain: every node is accepted."""
    prompt = PROMPTS[1]
    expected = tiny_moe().generate(prompt, max_new_tokens=40, do_sample=False)
    model = enabled(prompt, noise=0.0, topk=1, depth=5, pool_nodes=5, max_nodes=5)
    model.specfit.stats.trace = []
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, assistant="eagle3")
    assert torch.equal(out, expected)
    cycles = model.specfit.stats.trace
    assert [c.n_nodes for c in cycles] == [5] * len(cycles)
    assert [c.committed for c in cycles[:-1]] == [6] * (len(cycles) - 1)  # 5 accepted + the bonus token
    assert sum(c.committed for c in cycles) == 39  # the first of the 40 tokens comes from the prefill


def test_self_drafter_tree_commits_depth_plus_one_every_cycle():
    """A noise-free, confident self-drafter with top-2 expansion: the target's greedy continuation is the most
    probable node of every level, so every cycle accepts it to the full depth and commits depth + 1 tokens. Kills
    the mutant: levels.py expands the worst frontier nodes (the greedy path then stops at depth 2: 3 tokens)."""
    prompt = PROMPTS[1]
    expected = tiny_moe().generate(prompt, max_new_tokens=40, do_sample=False)
    model = enabled(prompt, noise=0.0, sharpen=1000.0, topk=2, depth=5, pool_nodes=18, max_nodes=7)
    model.specfit.stats.trace = []
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, assistant="eagle3")
    assert torch.equal(out, expected)
    cycles = model.specfit.stats.trace
    assert [c.pool for c in cycles] == [18] * len(cycles)  # a real tree: 2 + 4 + 4 + 4 + 4 nodes
    assert [c.committed for c in cycles[:-1]] == [6] * (len(cycles) - 1)  # 5 accepted + the bonus token


def accepted_layout_indices(tree, nodes, accepted):
    """Verify-tree indices (root 0) of the root and the ``accepted`` draft tokens, walked from the root."""
    nodes = sorted(nodes)
    kept, parent = [0], -1
    for token in accepted:
        v = next(v for v in nodes if tree.parents[v] == parent and tree.tokens[v] == token)
        kept.append(nodes.index(v) + 1)
        parent = v
    return kept


def test_drafter_is_fed_the_accepted_paths_features():
    """After each cycle the drafter reads the target's features of the committed tokens, also when the accepted
    path is not a prefix of the verified layout (a top-2 tree: the path's level-2 node comes after the root's
    second child): everything it was fed equals the features of the output sequence from one plain forward.
    Kills the mutant: loop.py's phase 6 feeds the first len(kept) positions' features instead of the accepted
    path's (lossless, but acceptance silently drops)."""
    from specfit.decoding.assistants import Eagle3Generator

    prompt = PROMPTS[1]
    model = enabled(prompt, noise=0.0, sharpen=50.0, topk=2, depth=3, pool_nodes=10, max_nodes=5)
    fed, branched, selected = [], [], []

    class Recording(Eagle3Generator):
        def start(self, features, next_tokens):
            fed.append((features.clone(), next_tokens.clone()))
            super().start(features, next_tokens)

        def select(self, tree, cycle):
            nodes = super().select(tree, cycle)
            selected.append((tree, nodes))
            return nodes

        def observe(self, features, next_tokens):
            kept = accepted_layout_indices(*selected[-1], next_tokens[0, :-1].tolist())
            branched.append(kept != list(range(len(kept))))
            fed.append((features.clone(), next_tokens.clone()))
            super().observe(features, next_tokens)

    out = model.generate(prompt, max_new_tokens=30, do_sample=False, assistant=Recording)
    assert torch.equal(out, tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False))
    assert sum(branched) >= 3  # the case under test happened, more than once
    features = torch.cat([f for f, _ in fed], dim=1)  # [1, n, 3H]
    tokens = torch.cat([t for _, t in fed], dim=1)  # [1, n]
    n = tokens.shape[1]
    assert torch.equal(tokens, out[:, 1:n + 1])  # pairs (feature of t_i, t_{i+1}), in order
    with torch.no_grad():
        hidden = tiny_moe()(out[:, :n], output_hidden_states=True).hidden_states  # embeddings, then each layer
    expected = torch.cat([hidden[i + 1] for i in model.specfit.drafter.config.aux_layer_ids], dim=-1)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)


def test_eagle3_verifies_max_nodes_and_specfit_fewer():
    prompt = PROMPTS[2]
    model = enabled(prompt, noise=0.5)
    model.generate(prompt, max_new_tokens=20, do_sample=False, assistant="eagle3")
    eagle = model.specfit.stats.last_generate
    configure(model, route_source="oracle")
    model.generate(prompt, max_new_tokens=20, do_sample=False, assistant="specfit")
    fit = model.specfit.stats.last_generate
    assert eagle.nodes_per_cycle == 7 and eagle.nodes_drafted == 18 * eagle.cycles
    assert fit.nodes_per_cycle < 7 and fit.nodes_drafted < 18 * fit.cycles
    # the oracle is measurement work inside the call: counted in the wall clock and shown apart
    assert 0 < fit.measurement_seconds < fit.decode_seconds and eagle.measurement_seconds == 0
    assert fit.tokens_per_second < fit.tokens_per_second_excluding_measurement
    assert fit.misses / fit.new_tokens < eagle.misses / eagle.new_tokens


def test_eos_inside_accepted_path_and_max_new_tokens():
    prompt = PROMPTS[3]
    free = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    eos = free[9]  # the 10th new token
    expected = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] == prompt.shape[1] + free.index(eos) + 1
    model = enabled(prompt, noise=0.0)
    for assistant in ("eagle3", "specfit"):
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant=assistant)
        assert torch.equal(out, expected)
        for n in (1, 2, 7, 13):
            out = model.generate(prompt, max_new_tokens=n, do_sample=False, assistant=assistant)
            assert out.shape[1] == prompt.shape[1] + n


def test_static_cache_and_return_dict():
    prompt = PROMPTS[1]
    reference = tiny_moe()
    expected = reference.generate(prompt, max_new_tokens=15, do_sample=False, return_dict_in_generate=True,
                                  output_scores=True, output_logits=True)
    model = enabled(prompt, noise=0.3)
    for assistant in ("eagle3", "specfit"):
        out = model.generate(prompt, max_new_tokens=15, do_sample=False, assistant=assistant,
                             return_dict_in_generate=True, output_scores=True, output_logits=True)
        assert torch.equal(out.sequences, expected.sequences)
        assert len(out.scores) == len(out.logits) == 15
        for got, want in zip(out.logits, expected.logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        static = model.generate(prompt, max_new_tokens=15, do_sample=False, assistant=assistant,
                                cache_implementation="static")
        assert torch.equal(static, expected.sequences)


def test_stop_strings_and_streamer(capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, TextStreamer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    prompt = PROMPTS[2]
    reference = tiny_moe()
    free = reference.generate(prompt, max_new_tokens=30, do_sample=False)
    text = tokenizer.decode(free[0, prompt.shape[1]:])
    stop = text[12:14]
    expected = reference.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop],
                                  tokenizer=tokenizer)
    assert expected.shape[1] < free.shape[1]
    model = enabled(prompt, noise=0.0)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer,
                         assistant="specfit")
    assert torch.equal(out, expected)

    reference.generate(prompt, max_new_tokens=20, do_sample=False, streamer=TextStreamer(tokenizer))
    plain = capsys.readouterr().out
    model.generate(prompt, max_new_tokens=20, do_sample=False, streamer=TextStreamer(tokenizer), assistant="eagle3")
    assert capsys.readouterr().out == plain and len(plain) > 20


def test_returned_cache_holds_only_committed_tokens():
    """eos inside an accepted path: the cache given back matches plain generate's (len(sequences) - 1)."""
    prompt = PROMPTS[3]
    free = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    eos = free[9]
    model = enabled(prompt, noise=0.0, sharpen=50.0)
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant="eagle3",
                         return_dict_in_generate=True)
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    plain = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                                return_dict_in_generate=True)
    assert out.cache.get_seq_length() == plain.cache.get_seq_length()


def test_errors():
    prompt = PROMPTS[0]
    model = enabled(prompt)
    with pytest.raises(ValueError, match="needs greedy or sampling"):
        model.generate(prompt, assistant="eagle3", prompt_lookup_num_tokens=3, max_new_tokens=3)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(prompt, assistant="eagle3", use_cache=False, max_new_tokens=3)
    first = model.generate(prompt, max_new_tokens=3, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="starts from an empty cache; the cache given holds"):
        model.generate(first.sequences, cache=first.cache, assistant="eagle3", max_new_tokens=3)
    with pytest.raises(ValueError, match="unknown assistant 'medusa'"):
        model.generate(prompt, assistant="medusa")
    with pytest.raises(ValueError, match="right-padded"):  # a batch decodes (test_batch_decoding.py) if left-padded
        model.generate(torch.cat([prompt, prompt]), attention_mask=torch.tensor(
            [[1] * (prompt.shape[1] - 1) + [0], [1] * prompt.shape[1]]),
                       assistant="specfit", max_new_tokens=3)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(prompt, assistant="specfit", num_beams=2, max_new_tokens=3)
    bare = specfit.enable(tiny_moe(), cache_slots=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        bare.generate(prompt, assistant="eagle3", max_new_tokens=3)
    with pytest.raises(ValueError, match="max_nodes"):
        configure(model, max_nodes=-1)


def skipped_before_probe(backoff, bound: int) -> int:
    """Cycles that skip drafting before the next probe, counted up to ``bound``: past it the backoff never probes."""
    for skipped in range(bound + 1):
        if not backoff.skip():
            return skipped
    raise AssertionError(f"the backoff skipped {bound + 1} cycles in a row: it never probes again")


def test_backoff_schedule():
    from specfit.decoding.assistants import Backoff

    b, pattern = Backoff(most=4), []
    for paid in (False, False, False, False, True, False, True, True, False):
        b.record(paid)
        pattern.append(skipped_before_probe(b, 4))
    # doubles after each failed probe, capped; a paying cycle halves the ladder, a run of them resets it
    assert pattern == [1, 2, 4, 4, 0, 4, 0, 0, 1]


@pytest.mark.parametrize("most", [1, 5, 32])
def test_backoff_probes_again_after_the_documented_number_of_cycles(most):
    """After ``k`` failed cycles in a row exactly ``min(2**(k-1), most)`` cycles skip drafting, then one probes
    (skip() is False), also long after the cap was reached; the probe's cycle drafts, so it records again."""
    from specfit.decoding.assistants import Backoff

    b = Backoff(most=most)
    assert not b.skipping and skipped_before_probe(b, 0) == 0  # nothing failed yet: draft
    for k in range(1, 12):
        b.record(paid=False)
        assert b.skipping
        assert skipped_before_probe(b, most) == min(2 ** (k - 1), most), f"after {k} failures"
        assert not b.skipping


def test_specfit_skips_drafting_that_does_not_pay_and_stays_lossless():
    """A drafter that drafts noise, under a cost model where only a near-sure draft node pays: the winner is mostly
    the root alone, so SpecFit stops drafting for a while (cycles with an empty pool) and its output is still exact."""
    prompt = PROMPTS[1]
    expected = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False)
    model = enabled(prompt, noise=1.0)
    configure(model, cost_model=CostModel(intercepts=(1.0,) + (1.9,) * 7, beta=0.01))
    model.specfit.stats.trace = []
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    pools = [c.pool for c in model.specfit.stats.trace]
    assert pools.count(0) > len(pools) / 2 and any(p > 0 for p in pools)  # mostly skipped, probed now and then


class ScriptedLevels:
    """A ``TreeDrafter`` stand-in that drafts a fixed pool, level by level: ``qs[d]`` are the conditional draft
    probabilities of level d + 1's two nodes (ranks 1 and 2, both under the previous level's rank-1 node). Counts the
    levels it was asked for; SpecFit stops asking by no longer iterating."""

    def __init__(self, qs):
        self.qs, self.drafted = qs, 0

    def levels(self):
        from specfit.drafting.tree import DraftTree

        tree, parent = DraftTree(), -1
        for q1, q2 in self.qs:
            above = 1.0 if parent < 0 else tree.path_probs[parent]
            top = tree.add(parent, 3, above * q1, 1)
            tree.add(parent, 4, above * q2, 2)
            parent = top
            self.drafted += 1
            yield tree


def specfit_drafting(qs):
    """SpecFit's draft() over a scripted pool, under the paper's path probabilities and routes that cost nothing
    (so the selector's winner follows the probabilities alone): (levels drafted, the winner's nodes, their depths)."""
    from specfit.decoding.assistants import SpecFitGenerator
    from specfit.selection.route_sources import Cycle

    model = enabled(PROMPTS[0], acceptance="paper")
    generator = SpecFitGenerator(model)
    generator.drafter = ScriptedLevels(qs)
    L, E = model.config.num_hidden_layers, model.config.num_experts
    generator.routes = lambda cycle, tree: (np.zeros((len(tree), L, E), bool), np.zeros((L, E), bool))
    tree = generator.draft(Cycle(model=model, cache=None, base=0, root=2))
    nodes = generator.select(tree, None)
    return generator.drafter.drafted, nodes, [tree.depths[v] for v in nodes]


def test_specfit_drafts_deeper_while_the_winner_takes_the_newest_level():
    """A winner that takes a node of the newest level makes SpecFit draft the next level, to the full depth; a
    winner that takes none stops drafting there (at level 1, 3 or 5 here), and it is never asked for a level more."""
    sure, unlikely = (0.97, 0.01), (1e-4, 1e-5)
    drafted, nodes, depths = specfit_drafting([sure] * 5)
    assert drafted == 5 and max(depths) == 5  # every level's rank-1 node won: drafted to depth 5
    drafted, nodes, depths = specfit_drafting([sure, sure, unlikely, sure, sure])
    assert drafted == 3 and nodes == (0, 2)  # level 3 gave the winner nothing: levels 4 and 5 never drafted
    drafted, nodes, depths = specfit_drafting([unlikely] + [sure] * 4)
    assert drafted == 1 and nodes == ()  # the root alone won at level 1


@pytest.mark.parametrize("assistant", ["eagle3", "specfit"])
def test_greedy_with_logits_processors_equals_plain_generate(assistant):
    """Processors that read the accepted prefix (repetition penalty, min length) take the general walk."""
    prompt = PROMPTS[2]
    kw = dict(max_new_tokens=20, min_new_tokens=20, repetition_penalty=1.3, do_sample=False)
    expected = tiny_moe().generate(prompt, **kw)
    model = enabled(prompt, noise=0.3)
    assert torch.equal(model.generate(prompt, assistant=assistant, **kw), expected)


def test_specfit_skips_drafting_whose_levels_cost_more_than_they_buy():
    """A profile that prices drafting per level: when a drafted level costs more than the tokens it may buy, even a
    winner with draft nodes does not pay, so SpecFit's rule alone (``guard=False``: the forecast decides, not the
    clock) skips drafting most of the time; output stays exact."""
    prompt = PROMPTS[1]
    expected = tiny_moe().generate(prompt, max_new_tokens=30, do_sample=False)
    model = enabled(prompt, noise=0.3)
    costly = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.01,
                       draft_level_seconds=(0.6, 0.1, 0.1, 0.1, 0.1))
    configure(model, cost_model=costly, guard=False)
    model.specfit.stats.trace = []
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    pools = [c.pool for c in model.specfit.stats.trace]
    assert pools.count(0) > len(pools) / 2
    model = enabled(prompt, noise=0.3, sharpen=8.0)  # a confident drafter, and cheap drafting: it pays
    configure(model, cost_model=CostModel((1.0,) * 8, 1e-4, draft_level_seconds=(0.01,) * 5), guard=False)
    model.specfit.stats.trace = []
    assert torch.equal(model.generate(prompt, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    assert [c.pool for c in model.specfit.stats.trace].count(0) < len(model.specfit.stats.trace) / 2
