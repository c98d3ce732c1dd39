"""The rules and loading suites (``benchmarks/rules.py``, ``benchmarks/loading.py``) through their ``main``, as
``python benchmarks/run.py rules PART ...`` and ``... load PART ...`` call it, at tiny settings: what each part prints
and writes, checked against the same figures computed here, and a clear refusal of a bad option before anything runs.
"""

import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specfit.offload.policies import POLICIES, make_policy
from specfit.offload.slots import SlotBook
from specfit.selection.cost_model import CostModel
from specfit.selection.selector import select_subtree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loading  # noqa: E402
import rules  # noqa: E402

NUMBER = r"([\d.]+)"


def figures(pattern: str, text: str) -> list[float]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return [float(g) for g in match.groups()]


def test_selector_times_the_paper_shaped_pools(capsys):
    assert rules.main(["selector", "--calls", "25", "--seed", "1", "--max-nodes", "5"]) == 0
    out = capsys.readouterr().out
    assert "pools: 25 x 18 nodes, routes 48x128 top-8, max_nodes=5, calls=25, seed=1, load average" in out
    for name in ("wall time", "thread CPU time"):
        median, p90, low = figures(rf"{name} per call: median {NUMBER} ms, p90 {NUMBER} ms, min {NUMBER} ms", out)
        assert 0 < low <= median <= p90
    # the same pools and calls here: the counts printed are theirs, at the --max-nodes given
    rng = np.random.default_rng(1)
    picks = [select_subtree(*rules.eagle_pool(rng), CostModel.default(5), max_nodes=5) for _ in range(25)]
    scored = [p.subtrees for p in picks]
    assert (f"subtrees scored per call: mean {np.mean(scored):.1f} (min {min(scored)}, max {max(scored)})\n"
            f"selected draft nodes (default cost model): mean {np.mean([len(p.nodes) for p in picks]):.2f}") in out


def test_selector_pools_have_the_paper_shape():
    parents, probs, routes, root = rules.eagle_pool(np.random.default_rng(0))
    assert len(parents) == len(probs) == 18 and routes.shape == (18, 48, 128) and root.shape == (48, 128)
    assert parents[:2] == [-1, -1] and all(-1 <= p < i for i, p in enumerate(parents))
    assert (routes.sum(axis=2) == 8).all() and (root.sum(axis=1) == 8).all()  # top-8 in every layer
    assert all(probs[i] < (probs[p] if p >= 0 else 1.0) for i, p in enumerate(parents))  # path probabilities
    shared = [(routes[i] & (routes[p] if p >= 0 else root)).sum() / (48 * 8) for i, p in enumerate(parents)]
    assert 0.35 < np.mean(shared) < 0.65  # a child keeps about half of its parent's experts
    depth = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 0)
    for d in range(4):  # the 2 most probable nodes of each level are the ones expanded
        level = [i for i in range(18) if depth[i] == d]
        assert {parents[i] for i in range(18) if depth[i] == d + 1} == set(sorted(level, key=lambda i: -probs[i])[:2])


class CpuClock:
    """The real wall clock, and a thread CPU clock that advances 500 ns per reading: a timed span's CPU time is
    500 ns exactly, so the figures printed as CPU time show which clock they came from."""

    perf_counter_ns = staticmethod(time.perf_counter_ns)

    def __init__(self):
        self.ns = 0

    def thread_time_ns(self) -> int:
        self.ns += 500
        return self.ns


def test_the_rules_print_each_clock_under_its_own_name(monkeypatch, capsys):
    monkeypatch.setattr(rules, "time", CpuClock())
    assert rules.main(["selector", "--calls", "5"]) == 0
    assert rules.main(["slot-plan", "--rounds", "1", "--forwards", "64", "--slots", "6"]) == 0
    out = capsys.readouterr().out
    assert "thread CPU time per call: median 0.0005 ms, p90 0.0005 ms, min 0.0005 ms" in out
    assert figures(rf"wall time per call: median {NUMBER} ms", out)[0] > 0.001  # a selection takes ~0.2 ms
    for line in [line for line in out.splitlines() if " slots: " in line]:  # 1 timed span of 63 plans per replay
        cells = re.findall(r"([\d.]+)/([\d.]+) us", line)
        assert len(cells) == len(POLICIES) and all(cpu == "0.01" and float(wall) > 0.05 for cpu, wall in cells)


def test_slot_plan_traces_are_shaped_like_the_embedded_models():
    decode, verify = (rules.trace(np.random.default_rng(0), 130, tokens) for tokens in (1, 8))
    for forwards, tokens in ((decode, 1), (verify, 8)):
        assert len(forwards) == 130
        for i, (needed, uses) in enumerate(forwards):
            assert needed == sorted(set(needed)) and all(0 <= e < 64 for e in needed)
            if i % 64 == 0:  # a 128-token prompt
                assert sum(uses) == 128 * 4
            elif tokens == 1:
                assert uses is None and len(needed) == 4
            else:
                assert sum(uses) == 8 * 4 and 4 <= len(needed) <= 32


def test_slot_plan_times_every_policy_and_a_reference(tmp_path, capsys):
    reference = tmp_path / "lru_before.py"  # an LRU slot cache from before the policy seam: no ``uses``
    reference.write_text("from specfit.offload.slots import SlotBook\n\n\nclass LRUSlots(SlotBook):\n"
                         "    def plan(self, needed, confirmed=True):\n"
                         "        return super().plan(needed, confirmed)\n")
    argv = ["slot-plan", "--rounds", "2", "--forwards", "130", "--slots", "6", "24", "--seed", "3"]
    assert rules.main(argv + ["--reference", str(reference)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 rounds x 130 plans per trace, 64 experts top-4, load average")
    lines = [line for line in out.splitlines() if " slots: " in line]
    assert [line.split(":")[0] for line in lines] == ["decode  6 slots", "decode 24 slots", "verify  6 slots",
                                                      "verify 24 slots"]
    rng, misses = np.random.default_rng(3), {}
    for line, (kind, slots) in zip(lines, itertools.product(("decode", "verify"), (6, 24))):
        if slots == 6:
            forwards = rules.trace(rng, 130, 1 if kind == "decode" else 8)
        cells = re.findall(r"([a-z][a-z -]*?) ([\d.]+)/([\d.]+) us \(([\d.]+)\)", line.split(": ", 1)[1])
        assert [c[0] for c in cells] == list(POLICIES) + ["reference lru"]
        assert all(float(cpu) > 0 and float(wall) > 0 for _, cpu, wall, _ in cells)
        misses[kind, slots] = {name: float(m) for name, _, _, m in cells}
        # the misses per timed plan, counted here: the prompts (forwards 0, 64, 128) planned untimed
        for name in POLICIES:
            book, count = SlotBook(slots, 64, make_policy(name, 64)), 0
            for i, (needed, uses) in enumerate(forwards):
                plan = book.plan(needed, confirmed=i % 64 == 0, uses=uses)
                book.confirm(e for e, _ in plan.loads)
                count += (len(plan.loads) + len(plan.streamed)) * (i % 64 != 0)
            assert misses[kind, slots][name] == round(count / 127, 2)
        assert misses[kind, slots]["reference lru"] == misses[kind, slots]["lru"]
    assert misses["decode", 24]["lru"] < misses["decode", 6]["lru"] < misses["verify", 6]["lru"]


@pytest.fixture
def gsm8k_folder(tmp_path, monkeypatch):
    """A data folder of 104 GSM8K-style test questions (rule-gap decodes from the 101st on)."""
    (tmp_path / "gsm8k").mkdir()
    rows = [dict(question=f"Tom has {i} apples and buys {i % 7 + 2} more bags of {i % 5 + 3} apples. How many apples "
                          f"does he have now?", answer="#### 0") for i in range(104)]
    (tmp_path / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("SPECFIT_DATA_DIR", str(tmp_path))
    return tmp_path


def test_rule_gap_compares_ascent_with_the_exact_optimum(gsm8k_folder, monkeypatch, capsys):
    """Every pool the batch rule priced is searched pair by pair and whole at the cap; the gaps printed are those
    of these searches. The first search's ascent is halved here, so the arithmetic shows (a 50% gap)."""
    from specfit.decoding import batch_rows
    from specfit.evaluation import harness

    priced, searches, rule, gap_to_exact = [], [], batch_rows.select_batch, rules.gap_to_exact
    decoded, load_instances = [], harness.load_instances

    def load(*args, **kwargs):  # the embedded model as the benchmark loads it, its generate watched
        models, tokenizer = load_instances(*args, **kwargs)
        generate = models["specfit"].generate

        def watched(ids, **kw):
            decoded.extend(tokenizer.batch_decode(ids))
            return generate(ids, **kw)

        models["specfit"].generate = watched
        return models, tokenizer

    def price(rows, *rest):  # the batch rule as decoding calls it: every pool the benchmark records
        priced.append(list(rows))
        return rule(rows, *rest)

    def search(rows, *prices):
        ascent, exact = gap_to_exact(rows, *prices)
        searches.append((list(rows), ascent, exact))
        return (ascent * 0.5 if len(searches) == 1 else ascent), exact

    monkeypatch.setattr(batch_rows, "select_batch", price)
    monkeypatch.setattr(rules, "gap_to_exact", search)
    monkeypatch.setattr(harness, "load_instances", load)
    assert rules.main(["rule-gap", "--prompts", "3", "--tokens", "6", "--cap", "1"]) == 0
    assert batch_rows.select_batch is price  # the benchmark put back the rule it found
    out = capsys.readouterr().out
    assert [re.search(r"Question: Tom has (\d+) apples", text)[1] for text in decoded] == ["100", "101", "102"]
    assert priced and all(len(rows) == 3 for rows in priced)  # one row per prompt, every cycle
    assert f"{len(priced)} recorded batch pools (3 rows, GSM8K held out, 12 slots)" in out
    for _, ascent, exact in searches:
        assert 0 < ascent <= exact * (1 + 1e-12)  # the exact optimum is never below coordinate ascent
    pairs, whole, calls = [], [], iter(searches)
    for rows in priced:
        for a, b in itertools.combinations(rows, 2):
            got, ascent, exact = next(calls)
            assert got[0] is a and got[1] is b  # the recorded rows at their own budget
            pairs.append(1 - ascent / exact)
        got, ascent, exact = next(calls)
        assert [r.max_nodes for r in got] == [min(r.max_nodes, 1) for r in rows]
        assert [r.parents for r in got] == [r.parents for r in rows]
        whole.append(1 - ascent / exact)
    assert next(calls, None) is None
    (pairs if len(priced[0]) > 1 else whole)[0] = 1 - 0.5 * searches[0][1] / searches[0][2]
    for name, gaps in (("row pairs, full budget", pairs), ("all rows, <= 1 nodes per row", whole)):
        g = np.array(gaps)
        assert (f"  {name}: {len(g)} searches, gap to exact mean {g.mean():.4%}, worst {g.max():.4%}, exact "
                f"reached in {np.mean(g <= 1e-12):.0%}") in out


@pytest.mark.parametrize("argv, message", [
    (["selector", "--calls", "0"], "--calls must be >= 1, got 0"),
    (["selector", "--max-nodes", "-1"], "--max-nodes must be >= 1, got -1"),
    (["slot-plan", "--forwards", "1"], "--forwards must be >= 2 (a prompt, then the timed plans), got 1"),
    (["slot-plan", "--slots", "6", "65"], "--slots must be in 1..64 (the trace's experts), got 65"),
    (["slot-plan", "--reference", "no/such/lru.py"], "--reference no/such/lru.py is not a file"),
    (["slot-plan", "--reference", "{other}"], "--reference {other} defines no LRUSlots class"),
    (["rule-gap", "--prompts", "1"], "--prompts must be >= 2 (the rows of a batch), got 1"),
    (["rule-gap", "--cap", "0"], "--cap must be >= 1, got 0"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_rules_refuse_a_bad_option_before_running(argv, message, tmp_path, monkeypatch, capsys):
    from specfit.evaluation import harness

    other = tmp_path / "other.py"  # a Python file without the slot cache class
    other.write_text("class LRU:\n    pass\n")
    argv, message = [a.replace("{other}", str(other)) for a in argv], message.replace("{other}", str(other))
    monkeypatch.setattr(harness, "load_instances", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(rules, "eagle_pool", lambda *a, **k: pytest.fail("built pools"))
    monkeypatch.setattr(rules, "trace", lambda *a, **k: pytest.fail("built traces"))
    with pytest.raises(SystemExit) as exit:
        rules.main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_loader_measures_both_paths(tmp_path, capsys):
    folder, results = tmp_path / "ckpt", tmp_path / "out" / "loader.json"
    rc = loading.main(["loader", "--dir", str(folder), "--preset", "tiny", "--layers", "1", "--shard-size", "200KB",
                       "--repeats", "1", "--json", str(results)])
    out = capsys.readouterr().out
    shards = sorted(folder.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    assert f"wrote {folder}: {len(shards)} shards" in out and len(shards) > 1
    assert f"checkpoint: {total:,} bytes ({total / 1e9:.2f} GB) in {len(shards)} shards" in out
    saved = json.loads(results.read_text())
    assert (saved["checkpoint_bytes"], saved["shards"]) == (total, len(shards))
    assert saved["largest_shard"] == max(p.stat().st_size for p in shards)
    for mode, label in (("specfit", "specfit.from_pretrained"), ("naive", "AutoModelForCausalLM.from_pretrained + "
                                                                           "enable")):
        r = saved["results"][mode]
        assert len(r["runs"]) == 1 and r["runs"][0]["mode"] == mode and r["runs"][0]["expert_bytes"] > 0
        assert r["peak"] == r["runs"][0]["peak"] > 0 and r["load_s"] > 0 and r["ratio"] == r["peak"] / total
        assert (r["enable_s"] > 0) == (mode == "naive")  # specfit.from_pretrained enables as it loads
        assert (f"| {label} | {r['peak'] / 1e9:.2f} GB | {r['ratio']:.2f}x | {(r['peak'] - total) / 1e6:+.0f} MB | "
                f"{r['after'] / 1e9:.2f} GB | {r['load_s']:.1f} | {r['enable_s']:.1f} |") in out
    ratio = saved["results"]["specfit"]["ratio"]  # a tiny checkpoint is far below the process's own growth
    assert rc == (0 if ratio <= 1.2 else 1)
    assert f"peak / checkpoint = {ratio:.3f} (bound 1.2): {'PASS' if ratio <= 1.2 else 'FAIL'}" in out


def test_loader_reports_the_medians_of_interleaved_loads(tmp_path, monkeypatch, capsys):
    """The table, verdict and results from given loads (the real ones: the test above): medians over repeats of
    loads taken in turn, the ratio from the peak, exit status 0 within the bound."""
    folder, calls = tmp_path / "ckpt", []
    loading.ensure_checkpoint(folder, "tiny", "200KB", 1)
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    factors = dict(specfit=[1.1, 1.5, 1.0], naive=[2.0, 3.0, 2.5])  # peak / checkpoint of each load, in turn

    def measure(path, mode, threads):
        calls.append((path, mode, threads))
        peak = factors[mode][sum(m == mode for _, m, _ in calls) - 1] * total
        return dict(mode=mode, peak=peak, after=peak / 2, load_s=len(calls), enable_s=0.5, expert_bytes=1)

    monkeypatch.setattr(loading, "measure", measure)
    results = tmp_path / "loader.json"
    assert loading.main(["loader", "--dir", str(folder), "--preset", "tiny", "--layers", "1", "--shard-size",
                         "200KB", "--repeats", "3", "--threads", "2", "--json", str(results)]) == 0
    assert calls == [(folder, mode, 2) for _ in range(3) for mode in ("specfit", "naive")]
    out, saved = capsys.readouterr().out, json.loads(results.read_text())["results"]
    assert f"reusing {folder}" in out and "medians of 3 fresh processes" in out
    assert saved["specfit"]["ratio"] == pytest.approx(1.1) and saved["naive"]["ratio"] == pytest.approx(2.5)
    assert (saved["specfit"]["load_s"], saved["naive"]["load_s"]) == (3, 4)
    assert f"| specfit.from_pretrained | {1.1 * total / 1e9:.2f} GB | 1.10x | {0.1 * total / 1e6:+.0f} MB | " \
           f"{0.55 * total / 1e9:.2f} GB | 3.0 | 0.5 |" in out
    assert "specfit.from_pretrained peak / checkpoint = 1.100 (bound 1.2): PASS" in out
    factors["specfit"] = [1.3, 1.3, 1.3]
    calls.clear()
    assert loading.main(["loader", "--dir", str(folder), "--preset", "tiny", "--layers", "1", "--shard-size",
                         "200KB", "--repeats", "3"]) == 1
    assert "(bound 1.2): FAIL" in capsys.readouterr().out
    calls.clear()
    assert loading.main(["loader", "--dir", str(folder), "--preset", "tiny", "--layers", "1", "--shard-size",
                         "200KB", "--repeats", "1", "--modes", "naive"]) == 0  # no bound without specfit's path
    assert "bound" not in capsys.readouterr().out


def test_a_checkpoint_is_reused_only_when_written_with_the_same_settings(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    loading.ensure_checkpoint(folder, "tiny", "4GB", 1)
    first = (folder / "model-00001-of-00001.safetensors").stat().st_mtime_ns
    loading.ensure_checkpoint(folder, "tiny", "4GB", 1)
    assert capsys.readouterr().out.splitlines()[-1] == f"reusing {folder}"
    assert (folder / "model-00001-of-00001.safetensors").stat().st_mtime_ns == first
    loading.ensure_checkpoint(folder, "tiny", "4GB", 2)  # another setting: written again
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((folder / "synthetic.json").read_text())["layers"] == 2
    loading.ensure_checkpoint(folder, "tiny", "4GB", 2, rewrite=True)
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"wrote {folder}: 1 shards")


def test_offload_measures_slots_with_and_without_the_link(tmp_path, monkeypatch, capsys):
    results, calls, decode = tmp_path / "out" / "offload.json", [], loading.decode

    def watched(model, prompt, new_tokens):  # every generate: (prompt tokens, slots, link s/expert, its counters)
        link = model.specfit.config.link
        calls.append((prompt.shape[1], model.specfit.config.cache_slots, link and link.seconds_per_expert,
                      decode(model, prompt, new_tokens)))
        return calls[-1][-1]

    monkeypatch.setattr(loading, "decode", watched)
    assert loading.main(["offload", "--models", "tiny", "--repeats", "1", "--new-tokens", "4", "--layers", "1",
                         "--dir", f"tiny={tmp_path / 'tiny'}", "--json", str(results)]) == 0
    out = capsys.readouterr().out
    (r,) = json.loads(results.read_text())["models"]
    assert (r["model"], r["layers"], r["experts"], r["top_k"], r["new_tokens"]) == ("tiny", 1, 128, 8, 4)
    assert math.isclose(r["link_ms"], 1.4 * r["compute_ms_per_token"] / (1 * 8))
    # first every expert resident: a warm-up, then the timed run that prices the link; then per configuration
    assert [c[:3] for c in calls[:2]] == [(64, 128, None), (16, 128, None)]
    assert math.isclose(r["compute_ms_per_token"], 1e3 / calls[1][3].tokens_per_second)
    all_slots = r["rows"][0]["tokens_per_second"]  # the effective ratio is against its own compute per token
    assert r["effective_ratio"] == pytest.approx(1.4 * r["compute_ms_per_token"] / 1e3 * all_slots)
    assert f"a full-miss token's copies take {r['effective_ratio']:.2f}x the compute of the all-slots row" in out
    assert len(calls) == 2 + 2 * len(r["rows"])
    for row, warm, timed in zip(r["rows"], calls[2::2], calls[3::2]):  # a warm-up, then the timed run it reports
        link = row["link_ms"] and pytest.approx(row["link_ms"] / 1e3)
        assert warm[:3] == (64, row["slots"], link) and timed[:3] == (16, row["slots"], link)
        assert row["tokens_per_second"] == timed[3].tokens_per_second and row["hit_rate"] == timed[3].hit_rate
    link = f"CPU, emulated link ({r['link_ms']:.3f} ms/expert)"
    assert [(row["regime"], row["slots"], row["slots_label"]) for row in r["rows"]] == [
        (regime, slots, label) for regime in ("CPU, memcpy (no link)", link)
        for slots, label in ((128, "all"), (48, "37.5%"), (12, "9.4%"))]
    for row in r["rows"]:
        assert row["link_ms"] == (None if "memcpy" in row["regime"] else r["link_ms"])
        assert row["tokens_per_second"] == row["tokens_per_second_runs"][0] > 0
        assert (f"| {row['regime']} | {row['slots']} ({row['slots_label']}) | {row['tokens_per_second']:.1f} | "
                f"{row['copies_per_token']:.1f} | {row['hit_rate']:.2f} | {row['copy_wait_share']:.0%} |") in out
    for rows in (r["rows"][:3], r["rows"][3:]):
        assert rows[0]["copies_per_token"] == 0 and rows[0]["hit_rate"] == 1.0
        assert 0 < rows[1]["copies_per_token"] < rows[2]["copies_per_token"]
        assert 1.0 > rows[1]["hit_rate"] > rows[2]["hit_rate"]
    assert r["rows"][5]["copy_wait_share"] > r["rows"][2]["copy_wait_share"]  # the link's copies are waited for
    assert "tiny: 1 layers x 128 experts, top-8, bfloat16, 4 new tokens, median of 1" in out


@pytest.mark.parametrize("argv, message", [
    (["loader", "--modes", "specfit,fast"], "--modes: unknown 'fast'; choose from specfit, naive"),
    (["loader", "--preset", "huge"], "invalid choice: 'huge'"),
    (["loader", "--shard-size", "12XB"], "--shard-size: size '12XB': expected e.g. 4GB"),
    (["loader", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["loader", "--dir", "{real}"], "holds files but no synthetic.json"),
    (["offload", "--models", "tiny,large"], "--models: unknown 'large'; choose from tiny, medium"),
    (["offload", "--models", "tiny", "--dir", "tiny"], "--dir tiny: expected MODEL=FOLDER"),
    (["offload", "--models", "tiny", "--dir", "medium=x"], "--dir medium=x: expected MODEL=FOLDER, MODEL one of"),
    (["offload", "--models", "tiny", "--dir", "tiny={real}"], "holds files but no synthetic.json"),
    (["offload", "--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
])
def test_loading_refuses_a_bad_option_before_writing_or_loading(argv, message, tmp_path, monkeypatch, capsys):
    real = tmp_path / "real"  # a folder holding someone's checkpoint: never overwritten
    real.mkdir()
    (real / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(loading, "ensure_checkpoint", lambda *a, **k: pytest.fail("wrote a checkpoint"))
    with pytest.raises(SystemExit) as exit:
        loading.main([a.replace("{real}", str(real)) for a in argv])
    assert exit.value.code == 2 and message in capsys.readouterr().err
    assert (real / "model.safetensors").read_bytes() == b"weights"
