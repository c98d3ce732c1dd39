"""The acceptance model inside decoding: labels of every drafted child the target scored (unverified ones too), the
sampling label matching what the walk accepts, calibrated SpecFit learning a drafter that understates itself while
staying lossless, expected tokens in the stats, tables beside the drafter, fitting them, the command."""

import shutil

import numpy as np
import pytest
import torch
from conftest import SelfDrafter, tiny_moe

import specfit
from specfit.decoding.acceptance import Acceptance, child_labels, walk
from specfit.drafting.tree import DraftTree, verify_layout
from specfit.evaluation import reliability
from specfit.patch import configure, set_drafter
from specfit.selection.acceptance_model import FILENAME, AcceptanceTable, AcceptanceTables
from specfit.selection.cost_model import CostModel
from specfit.transfer import Staging

PROMPT = torch.randint(2, 256, (1, 8), generator=torch.Generator().manual_seed(8))
COST = CostModel(intercepts=(1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35), beta=0.002, copy_overhead=0.008,
                 link_share=1.0)  # a resident expert costs its compute, a missing one 5x that


def pool() -> DraftTree:
    """Root children 0 (token 5) and 1 (token 6); under 0: 2 (token 7) and 3 (token 8); under 1: 4 (token 9);
    under 2: 5 (token 3)."""
    tree = DraftTree()
    for parent, token, rank, q in ((-1, 5, 1, 0.6), (-1, 6, 2, 0.3), (0, 7, 1, 0.5), (0, 8, 2, 0.4), (1, 9, 1, 0.9),
                                   (2, 3, 1, 0.7)):
        tree.add(parent, token, (1.0 if parent < 0 else tree.path_probs[parent]) * q, rank)
    return tree


def layout_of(tree, nodes):
    return verify_layout(tree, nodes, root_token=2, base=4, kv_len=16, dtype=torch.float32, staging=Staging("cpu"))


def test_tree_keeps_rank_and_conditional_probability():
    tree = pool()
    assert tree.ranks == [1, 2, 1, 2, 1, 1]
    assert tree.qs == pytest.approx([0.6, 0.3, 0.5, 0.4, 0.9, 0.7])


def test_greedy_labels_every_child_of_every_verified_node():
    """Verified: pool 0 and 2. The target's argmax: 5 at the root (pool 0 accepted), 8 at pool 0 (pool 3, which was
    not verified), 4 at pool 2. Labelled: the root's children, pool 0's (3 among them, a 1 although unverified) and
    pool 2's; pool 4 (child of the unverified pool 1) is not."""
    tree = pool()
    layout = layout_of(tree, (0, 2))
    nodes, labels = child_labels(tree, layout, Acceptance(path=[1], tokens=[5, 8]), [5, 8, 4], sampling=False)
    assert dict(zip(nodes, labels)) == {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0, 5: 0.0}
    # the walk's path (logits processors): only the positions it scored, the root and accepted pool 0
    nodes, labels = child_labels(tree, layout, Acceptance(path=[1], tokens=[5, 8]), None, sampling=False)
    assert dict(zip(nodes, labels)) == {0: 1.0, 1: 0.0, 2: 0.0, 3: 1.0}


def test_sampling_labels_are_the_target_probabilities_of_the_children():
    tree = pool()
    layout = layout_of(tree, (0, 2))
    root_scores, scores_at_0 = torch.randn(12), torch.randn(12)
    acc = Acceptance(path=[1], tokens=[5, 7], scores=[root_scores, scores_at_0])
    nodes, labels = child_labels(tree, layout, acc, None, sampling=True)
    p_root, p_0 = torch.softmax(root_scores, -1), torch.softmax(scores_at_0, -1)
    want = {0: p_root[5], 1: p_root[6], 2: p_0[7], 3: p_0[8]}
    assert nodes == [0, 1, 2, 3]
    assert labels == pytest.approx([float(want[v]) for v in nodes], rel=1e-6)


def test_walk_accepts_each_child_with_its_target_probability():
    """The one-hot draft scheme: children tried in turn, p renormalised after each rejection. The chance that child
    x is accepted is p(x) whatever its place among the siblings; that is the sampling label."""
    p = torch.tensor([0.1, 0.3, 0.25, 0.2, 0.15])
    parents, tokens = [-1, 0, 0, 0], [None, 1, 2, 3]
    children = lambda t: [c for c, q in enumerate(parents) if q == t]
    torch.manual_seed(0)
    n, hits = 20000, np.zeros(4)
    for _ in range(n):
        acc = walk(children, tokens, lambda t, acc: torch.log(p), do_sample=True)
        if acc.path:
            hits[acc.path[0]] += 1
        if len(acc.tokens) > 1:  # the walk stops at the accepted child (a leaf here): bonus drawn there
            pass
    freq = hits[1:] / n
    sigma = np.sqrt(p[1:4].numpy() * (1 - p[1:4].numpy()) / n)
    assert np.all(np.abs(freq - p[1:4].numpy()) < 4 * sigma)


def enabled(noise=0.0, sharpen=0.3, **kw):
    model = tiny_moe()
    drafter = SelfDrafter(model, first_token=int(PROMPT[0, 0]), noise=noise, sharpen=sharpen)
    return specfit.enable(model, cache_slots=4, drafter=drafter, cost_model=COST, **kw)


def test_calibrated_specfit_learns_a_drafter_that_understates_itself_and_stays_lossless():
    """A drafter whose top choice is always the target's but whose probabilities are flattened (sharpen 0.3): the
    paper's reward believes almost nothing gets accepted; the calibrated model learns from the labels (of unverified
    children too), verifies more and commits more tokens per cycle, with an expected / realized ratio near 1. Greedy
    output equals plain generate() either way."""
    expected = tiny_moe().generate(PROMPT, max_new_tokens=60, do_sample=False)
    result = {}
    for acceptance in ("paper", "calibrated"):
        model = enabled(acceptance=acceptance, guard=False)  # SpecFit's rule every cycle: the rule is under test
        model.specfit.acceptance_log = []
        out = model.generate(PROMPT, max_new_tokens=60, do_sample=False, assistant="specfit")
        assert torch.equal(out, expected)
        result[acceptance] = (model.specfit.stats.last_generate, model.specfit.acceptance_log)
    paper, (calibrated, log) = result["paper"][0], result["calibrated"]
    assert not result["paper"][1]  # the paper's reward learns nothing
    assert calibrated.tokens_per_cycle > paper.tokens_per_cycle and calibrated.nodes_verified > paper.nodes_verified
    assert len(log) > calibrated.nodes_verified  # children the selector left out were labelled too
    assert 0.8 < calibrated.expected_over_committed < 1.2
    assert paper.tokens_per_cycle < 1.2  # the paper's reward hardly ever verifies a node of this drafter
    summary = reliability.summary(log)
    assert summary["ece_calibrated"] < summary["ece_raw"]


def test_sampling_learns_the_sampling_table_and_greedy_output_is_unchanged_by_what_was_learned():
    model = enabled(noise=0.3, sharpen=1.0, guard=False)  # trees every cycle (the guard may settle on plain ones)
    torch.manual_seed(0)
    model.generate(PROMPT, max_new_tokens=20, do_sample=True, temperature=0.8, assistant="specfit")
    models = model.specfit.acceptance_models
    assert set(models) == {"sampling"} and models["sampling"].labels_seen > 0
    expected = tiny_moe().generate(PROMPT, max_new_tokens=30, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant="specfit"), expected)
    assert set(models) == {"sampling", "greedy"}


def test_expected_tokens_in_the_stats():
    model = enabled(noise=0.3, sharpen=1.0)
    model.specfit.stats.trace = []
    model.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant="eagle3")
    g = model.specfit.stats.last_generate
    assert g.expected_tokens >= g.cycles and g.as_dict()["expected_over_committed"] == g.expected_over_committed
    model.generate(PROMPT, max_new_tokens=20, do_sample=False)  # AR: one token expected per step, one committed
    g = model.specfit.stats.last_generate
    assert g.expected_tokens == g.tokens_committed == g.cycles and g.expected_over_committed == 1.0


class DepthRankEstimates:
    """An acceptance model whose estimate differs by depth, rank and q, so that every product along a path is its
    own number; counts its predictions."""

    def __init__(self):
        self.calls = 0

    def predict(self, depth, rank, q):
        self.calls += 1
        return 0.95 - 0.15 * depth - 0.1 * rank + 0.05 * q


def test_path_values_are_products_along_the_whole_path():
    """SpecFit's path value of a node is the product of the acceptance estimates from the root down to it, at every
    depth (a depth-4 chain here, and branches); each node is estimated once, when its level is drafted. At depth 3
    and below, the product of the node's and its parent's estimates alone is a different number."""
    from specfit.decoding.assistants import SpecFitGenerator
    from specfit.drafting.tree import ancestors_or_self

    levels = [((-1, 1, 0.6), (-1, 2, 0.3)), ((0, 1, 0.5), (0, 2, 0.4), (1, 1, 0.9)), ((2, 1, 0.7), (4, 1, 0.2)),
              ((5, 1, 0.8),)]  # (parent, rank, q) per node, level by level
    generator = SpecFitGenerator(enabled())
    generator.acceptance, generator.values, generator.estimates = DepthRankEstimates(), [], []
    tree = DraftTree()
    for level in levels:  # as draft() calls it: after each level, the newest level's nodes are estimated
        for parent, rank, q in level:
            tree.add(parent, 3, (1.0 if parent < 0 else tree.path_probs[parent]) * q, rank)
        values = generator._path_values(tree)
    assert tree.depths == [1, 1, 2, 2, 2, 3, 3, 4] and generator.acceptance.calls == len(tree)
    estimate = [DepthRankEstimates().predict(d, r, q) for d, r, q in zip(tree.depths, tree.ranks, tree.qs)]
    assert generator.estimates == pytest.approx(estimate, rel=1e-12)
    for v in range(len(tree)):
        path = list(ancestors_or_self(tree.parents, v))
        assert values[v] == pytest.approx(np.prod([estimate[u] for u in path]), rel=1e-12), f"node {v}"
        if len(path) >= 3:  # the mutant a depth-2 test cannot see: the parent's estimate alone
            assert values[v] != pytest.approx(estimate[v] * estimate[path[1]], rel=1e-6)


def test_acceptance_option_is_checked():
    model = enabled()
    with pytest.raises(ValueError, match="acceptance must be 'calibrated'"):
        configure(model, acceptance="oracle")
    assert model.specfit.options.acceptance == "calibrated"
    assert configure(model, acceptance="paper").acceptance == "paper"


def test_tables_beside_the_drafter_are_loaded_else_the_default(tmp_path, monkeypatch):
    from specfit import embedded
    from specfit.selection.acceptance_cache import user_tables_path

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))  # no tables calibrated on this machine leak in

    if not embedded.available():
        pytest.skip("the embedded model is not installed")
    model, _ = embedded.load(64)
    shipped = model.specfit.acceptance_tables
    assert (embedded.DRAFTER_DIR / FILENAME).is_file() and shipped is not None and shipped.greedy.labels > 0
    folder = tmp_path / "drafter"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(embedded.DRAFTER_DIR / name, folder / name)
    set_drafter(model, folder)
    assert model.specfit.acceptance_tables is None and model.specfit.acceptance_models == {}
    mine = AcceptanceTables(AcceptanceTable.fit([(1, 1, 0.5, 1.0)]), AcceptanceTable(), {"source": "test"})
    mine.save(folder / FILENAME)
    set_drafter(model, folder)
    assert model.specfit.acceptance_tables.meta == {"source": "test"}
    # tables calibrated for this drafter (in the user cache, under its content) are read before the folder's own
    calibrated = AcceptanceTables(AcceptanceTable.fit([(1, 1, 0.5, 0.0)]), AcceptanceTable(), {"source": "cache"})
    user_tables_path(folder).parent.mkdir(parents=True)
    calibrated.save(user_tables_path(folder))
    set_drafter(model, folder)
    assert model.specfit.acceptance_tables.meta == {"source": "cache"}


def test_fit_tables_from_the_eagle3_assistant():
    from specfit.evaluation.acceptance_tables import collect, describe, fit_tables

    model = enabled(noise=0.0, sharpen=1.0)  # deterministic drafting: the same greedy labels twice
    prompts = [PROMPT, PROMPT[:, :5]]
    greedy = collect(model, prompts, max_new_tokens=10)
    assert greedy and {y for *_, y in greedy} <= {0.0, 1.0}
    assert any(r[0] > 1 for r in greedy) and any(r[1] == 2 for r in greedy)
    tables = fit_tables(model, prompts, max_new_tokens=10)
    assert tables.greedy.labels == len(greedy)  # greedy decoding is deterministic
    assert 0 < tables.sampling.labels and all(0.0 <= s <= n for s, n in tables.sampling.counts.values())
    assert tables.meta["labels"]["greedy"] == len(greedy) and "greedy:" in describe(tables)


def test_calibrate_acceptance_only_writes_tables(tmp_path, capsys):
    from specfit import embedded
    from specfit.cli import main
    from specfit.evaluation import datasets

    if not embedded.available() or datasets.data_dir() is None:
        pytest.skip("needs the embedded model and the local data folder")
    out = tmp_path / FILENAME
    assert main(["calibrate", "--acceptance-only", "--num-prompts", "2", "--max-new-tokens", "8", "--out",
                 str(out)]) == 0
    tables = AcceptanceTables.load(out)
    assert tables.greedy.labels > 0 and tables.meta["prompts"] == 2
    assert "acceptance tables written to" in capsys.readouterr().out


def test_reliability_diagram(tmp_path):
    pytest.importorskip("matplotlib")
    log = [(d, r, q, min(0.99, q * 2), float(q > 0.3)) for d in (1, 2) for r in (1, 2) for q in
           np.linspace(0.01, 0.6, 40)]
    assert reliability.plot({"gsm8k": log, "cnn": log}, tmp_path / "r.png") == tmp_path / "r.png"
    assert (tmp_path / "r.png").stat().st_size > 1000
    s = reliability.summary(log)
    assert s["labels"] == len(log) and set(s["by_depth_rank"]) == {"1,1", "1,2", "2,1", "2,2"}
    assert "calibrated vs" in reliability.describe("x", s) and "no labelled" in reliability.describe("y", {})
