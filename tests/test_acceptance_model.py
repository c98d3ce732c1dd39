"""The acceptance model (pure Python): convergence on synthetic label streams with known acceptance, correction of a
drafter whose probabilities are off by a known amount, back-off, decay, tables on disk."""

import doctest
import json
import math
import random
import subprocess
import sys

import pytest

import specfit.selection.acceptance_model
from specfit.evaluation.reliability import ece, ece_floor
from specfit.selection.acceptance_model import (FILENAME, Q_EDGES, AcceptanceModel, AcceptanceTable,
                                                AcceptanceTables, bin_centers)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def logit(p):
    return math.log(p / (1.0 - p))


def stream(truth, cycles, rng, per_cycle=12, depths=5):
    """Synthetic cycles of ``(depth, rank, q, label)``: random depths, ranks 1/2 and q (rank 2 below rank 1's share),
    labels drawn with probability ``truth(depth, rank, q)``."""
    for _ in range(cycles):
        cycle = []
        for _ in range(per_cycle):
            depth, rank = rng.randint(1, depths), rng.choice((1, 2))
            q = rng.random() if rank == 1 else rng.random() * 0.5
            cycle.append((depth, rank, q, float(rng.random() < truth(depth, rank, q))))
        yield cycle


def test_estimator_converges_on_a_stream_with_known_acceptance():
    """Acceptance that depends on rank, q and depth (none of it what the default prior says): after a few thousand
    labels every bucket's estimate is within a few points of the truth at the bucket's centre."""
    def truth(depth, rank, q):
        return sigmoid(logit(min(max(q, 1e-3), 1 - 1e-3)) + (1.5 if rank == 1 else -0.5) - 0.2 * (depth - 1))

    model = AcceptanceModel(AcceptanceTables.default().greedy, decay=1.0)  # a stationary stream: keep every label
    for cycle in stream(truth, 3000, random.Random(0)):
        model.update(cycle)
    errors = []
    for depth in (1, 3, 5):
        for rank, bins in ((1, range(1, 10)), (2, range(1, 5))):
            for b in bins:
                q = bin_centers()[b]
                errors.append(abs(model.predict(depth, rank, q) - truth(depth, rank, q)))
    assert max(errors) < 0.07 and sum(errors) / len(errors) < 0.025


def test_a_drafter_whose_probabilities_are_shifted_is_corrected():
    """The target accepts sigmoid(logit q + 1.2): q understates acceptance by 1.2 logits. Online, the predictions made
    before each label is seen become calibrated (ECE far below the raw q's), and the expected tokens of drafted
    paths (products along the path) match the true ones."""
    shift = 1.2

    def truth(depth, rank, q):
        return sigmoid(logit(min(max(q, 1e-3), 1 - 1e-3)) + shift)

    model = AcceptanceModel(AcceptanceTables.default().greedy, decay=1.0)
    predicted, raw, labels = [], [], []
    for i, cycle in enumerate(stream(truth, 400, random.Random(1))):
        if i >= 50:  # after a short warm-up: what the selector sees from then on
            predicted += [model.predict(d, r, q) for d, r, q, _ in cycle]
            raw += [q for _, _, q, _ in cycle]
            labels += [y for *_, y in cycle]
        model.update(cycle)
    assert ece(raw, labels) > 0.15 and ece(predicted, labels) < 0.04
    # expected committed tokens of chains of 4 top-ranked children, 1 + sum of path values, summed over many chains
    # (what predicted / realized tokens measures; one chain is only as exact as a q-bin is narrow) against the truth
    rng = random.Random(2)
    predicted = true = paper = 0.0
    for _ in range(200):
        qs = [rng.uniform(0.05, 0.9) for _ in range(4)]
        predicted += 1 + sum(math.prod(model.predict(d + 1, 1, q) for d, q in enumerate(qs[: k + 1])) for k in range(4))
        true += 1 + sum(math.prod(truth(d + 1, 1, q) for d, q in enumerate(qs[: k + 1])) for k in range(4))
        paper += 1 + sum(math.prod(qs[: k + 1]) for k in range(4))
    assert abs(predicted / true - 1) < 0.03 and paper / true < 0.8


def test_sparse_buckets_follow_the_shift_of_their_coarser_bucket():
    """Labels only in one bucket: its neighbours at other depths (no labels of their own) move the same way on the
    logit scale, while keeping the table's shape between q-bins."""
    model = AcceptanceModel(AcceptanceTables.default().greedy, strength=4.0, decay=1.0)
    before = {q: model.predict(4, 1, q) for q in (0.1, 0.3, 0.6)}
    model.update([(1, 1, 0.3, 1.0)] * 30 + [(1, 1, 0.1, 1.0)] * 30 + [(1, 1, 0.6, 1.0)] * 30)
    after = {q: model.predict(4, 1, q) for q in (0.1, 0.3, 0.6)}
    assert all(after[q] > before[q] + 0.05 for q in before)
    assert after[0.1] < after[0.3] < after[0.6]
    assert model.predict(1, 2, 0.1) > AcceptanceModel(AcceptanceTables.default().greedy).predict(1, 2, 0.1)


def test_decay_forgets_an_earlier_prompt():
    """A prompt that drafts well, then one that drafts badly: with decay the estimate follows the second within a
    few dozen cycles; without decay it stays in between."""
    def run(decay):
        model = AcceptanceModel(AcceptanceTables.default().greedy, decay=decay)
        for _ in range(100):
            model.update([(1, 1, 0.3, 1.0)] * 5)
        for _ in range(60):
            model.update([(1, 1, 0.3, 0.0)] * 5)
        return model.predict(1, 1, 0.3)

    assert run(0.9) < 0.05 < 0.3 < run(1.0)


def test_update_rescales_without_changing_estimates():
    model = AcceptanceModel(AcceptanceTables.default().greedy, decay=0.5)
    for i in range(1200):  # 2**1200 overflows the weight unless it is rescaled
        model.update([(2, 1, 0.4, 0.0), (2, 1, 0.4, 1.0)])
        if i == 300:
            early = model.predict(2, 1, 0.4)
    assert model.predict(2, 1, 0.4) == pytest.approx(early, abs=1e-9) and abs(early - 0.5) < 0.05


def test_predictions_are_probabilities_everywhere():
    model = AcceptanceModel(AcceptanceTables.default().greedy)
    for d in (1, 2, 6, 40):
        for r in (1, 2, 3, 9):
            for q in (0.0, 1e-9, 0.02, 0.5, 0.97, 1.0):
                assert 0.0 < model.predict(d, r, q) < 1.0
    with pytest.raises(ValueError, match="decay"):
        AcceptanceModel(AcceptanceTable(), decay=0.0)
    with pytest.raises(ValueError, match="strength"):
        AcceptanceModel(AcceptanceTable(), strength=0)


def test_default_prior_is_the_documented_curve():
    tables = AcceptanceTables.default()
    greedy, sampling = AcceptanceModel(tables.greedy), AcceptanceModel(tables.sampling)
    # greedy: well above q where drafters are unsure, never certain; sampling: about q
    assert greedy.predict(1, 1, 0.2) > 0.4 and greedy.predict(1, 1, 0.99) <= 0.99
    for q in bin_centers():
        assert abs(sampling.predict(1, 1, q) - q) < 0.02


def test_tables_fit_save_and_load(tmp_path):
    records = [(1, 1, 0.9, 1.0), (1, 1, 0.9, 1.0), (1, 2, 0.05, 0.0), (7, 3, 0.2, 1.0)]
    table = AcceptanceTable.fit(records)
    # q 0.9 is in bin 7 (0.881-0.953), q 0.2 in bin 3; depth 7 is pooled into the last depth (6)
    assert table.counts[(1, 1, 7)] == (2.0, 2.0) and table.counts[(6, 3, 3)] == (1.0, 1.0)
    tables = AcceptanceTables(table, AcceptanceTable.fit(records[:1]), {"prompts": 2})
    path = tables.save(tmp_path / FILENAME)
    data = json.loads(path.read_text())
    assert data["format"] == "specfit-acceptance" and data["version"] == 1
    loaded = AcceptanceTables.load(path)
    assert loaded.greedy.counts == table.counts and loaded.meta == {"prompts": 2}
    assert loaded.greedy.edges == Q_EDGES
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99"):
        AcceptanceTables.load(path)
    path.write_text(json.dumps({"format": "specfit-cost-profile"}))
    with pytest.raises(ValueError, match="not a SpecFit acceptance table"):
        AcceptanceTables.load(path)


def test_a_table_shapes_the_estimates_until_labels_arrive():
    """Offline evidence that rank 1 is accepted far more than q says and rank 2 less: the model starts there."""
    rng = random.Random(3)
    records = [(1, r, q, float(rng.random() < (0.9 if r == 1 else 0.05))) for r in (1, 2) for q in
               [rng.uniform(0.1, 0.4) for _ in range(300)]]
    model = AcceptanceModel(AcceptanceTable.fit(records))
    assert model.predict(1, 1, 0.25) > 0.8 and model.predict(1, 2, 0.25) < 0.1
    assert model.predict(3, 1, 0.25) > 0.8  # a depth without evidence takes its (rank, bin)


def test_docstring_examples_run_and_no_torch():
    assert doctest.testmod(specfit.selection.acceptance_model).failed == 0
    code = "import sys, specfit.selection.acceptance_model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_expected_calibration_error_and_its_floor():
    assert ece([0.2] * 10, [1.0] * 2 + [0.0] * 8) == pytest.approx(0.0)
    assert ece([0.9, 0.9], [0.0, 0.0]) == pytest.approx(0.9)
    assert math.isnan(ece([], []))
    # a perfectly calibrated predictor still scores about 0.8 sqrt(p (1 - p) / labels per bin) on few labels
    rng = random.Random(0)
    few, many = [rng.uniform(0.2, 0.6) for _ in range(300)], [rng.uniform(0.2, 0.6) for _ in range(30000)]
    assert 0.03 < ece_floor(few) < 0.09 and ece_floor(many) < 0.01


def test_an_unlabelled_bucket_backs_off_to_its_own_ranks_shift():
    """Rank 1 is accepted far less than the table says and rank 2 far more, each seen in one q-bin only: every
    bucket of a rank with no labels of its own (other bins, other depths) moves by that rank's shift, the same
    amount on the logit scale for all of them, down for rank 1 and up for rank 2; rank 3, with no labels at all,
    moves as the whole table did (in between). None takes another rank's shift."""
    table = AcceptanceTables.default().greedy
    model, fresh = AcceptanceModel(table, decay=1.0), AcceptanceModel(table, decay=1.0)
    model.update([(1, 1, 0.6, 0.0)] * 40 + [(1, 2, 0.1, 1.0)] * 40)
    unlabelled = [(d, q) for d in (1, 3, 5) for q in (0.03, 0.3, 0.9)]  # not the bins of 0.6 and 0.1
    shifts = {rank: [logit(model.predict(d, rank, q)) - logit(fresh.predict(d, rank, q)) for d, q in unlabelled]
              for rank in (1, 2, 3)}
    for rank in (1, 2, 3):
        assert max(shifts[rank]) - min(shifts[rank]) < 1e-6, (rank, shifts[rank])
    assert shifts[1][0] < -2.0 and shifts[2][0] > 2.0  # both far from the table
    assert shifts[1][0] + 1.0 < shifts[3][0] < shifts[2][0] - 1.0
