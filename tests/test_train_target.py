"""The embedded target's training code on a small text built in code (no data folder needed)."""

import json
import random

import numpy as np
import pytest
import torch

from specfit.evaluation.datasets import EOS_TEXT
from specfit.training import corpus, routing_stats as rs
from specfit.training.target import make_config
from specfit.training.target_loop import TrainConfig, lr_at, train
from specfit.training.tokenizer import EOS_ID, load_tokenizer, train_tokenizer

NAMES = ["Janet", "Tom", "Maria", "Ken", "Ali", "Rosa"]
ITEMS = ["apples", "eggs", "books", "marbles", "pencils", "cookies"]
WORDS = ("the government economy history society river empire trade people court law market planet star "
         "citizens power war culture science theory price labor class state family").split()


def gsm_rows(n, seed):
    rng, rows = random.Random(seed), []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        rows.append({"question": f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
                     "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}"})
    return rows


def book_rows(n, seed):
    rng = random.Random(seed)
    return [{"id": f"book/m{i}", "book": "us-history", "title": f"Section {i}",
             "text": f"Section {i}\n\n" + " ".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "."
                                                 for _ in range(30))} for i in range(n)]


@pytest.fixture(scope="module")
def splits():
    return corpus.build_splits(seed=0, gsm8k_val=20, gsm8k_rows=gsm_rows(300, 1), openstax_rows=book_rows(40, 2))


@pytest.fixture(scope="module")
def tokenizer(splits):
    return train_tokenizer(splits.all_train_text(), vocab_size=512)


@pytest.fixture(scope="module")
def streams(splits, tokenizer):
    return {split: {s: corpus.encode_stream(tokenizer, docs) for s, docs in getattr(splits, split).items()}
            for split in ("train", "val")}


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for rel, rows in [("gsm8k/train.jsonl", gsm_rows(400, 1)), ("gsm8k/test.jsonl", gsm_rows(60, 3)),
                      ("openstax/train.jsonl", book_rows(40, 2))]:
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tiny_model(seed=0):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(make_config("tiny"))


# ------------------------------------------------------------------------------------------------ tokenizer, corpus


def test_tokenizer_round_trip_special_token_and_determinism(splits, tokenizer, tmp_path):
    text = "Question: Janet has 16 eggs.\nAnswer:  ünïcode 🙂 $5.50\t<<3*4=12>>12" + EOS_TEXT + "next"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(EOS_TEXT) == EOS_ID == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert ids.count(EOS_ID) == 1
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path).encode(text) == ids
    again = train_tokenizer(splits.all_train_text(), vocab_size=512)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_corpus_format_splits_and_sampler(splits, streams):
    doc = splits.train["gsm8k"][0]
    assert doc.startswith("Question: ") and "\nAnswer: " in doc and doc.endswith(EOS_TEXT)
    assert splits.sizes() == {"train": {"gsm8k": 280, "openstax": 39}, "val": {"gsm8k": 20, "openstax": 1}}
    assert not set(splits.train["gsm8k"]) & set(splits.val["gsm8k"])
    assert streams["train"]["gsm8k"].dtype == np.int16
    sampler = corpus.WindowSampler(streams["train"], seq_len=32, seed=0)
    sampler.sample(3)
    state = sampler.state_dict()
    a = sampler.sample(4)
    sampler.load_state_dict(state)
    assert np.array_equal(a, sampler.sample(4)) and a.shape == (4, 33)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


# ------------------------------------------------------------------------------------------------ training


def small_cfg(steps, **kw):
    return TrainConfig(steps=steps, batch_size=4, seq_len=64, warmup_steps=5, eval_every=10, eval_windows=4,
                       ckpt_every=1000, **kw)


def test_training_loss_decreases(streams, tmp_path):
    state = train(tiny_model(), streams, small_cfg(40), tmp_path, progress=False)
    first, last = state["history"][0], state["history"][-1]
    assert state["step"] == 40 and len(state["history"]) == 4
    assert last["val_ce_gsm8k"] < first["val_ce_gsm8k"] - 0.5
    assert last["train_ce"] < first["train_ce"]
    assert 1.0 < last["aux"] < 4.0  # Switch aux term ~ top_k at balance


def test_resume_reproduces_the_uninterrupted_run(streams, tmp_path):
    straight = tiny_model()
    train(straight, streams, small_cfg(12), tmp_path / "a", progress=False)
    (tmp_path / "b").mkdir()
    state = train(tiny_model(), streams, small_cfg(12), tmp_path / "b", stop_at=5, progress=False)
    assert state["step"] == 5
    resumed = tiny_model(seed=123)  # different init: everything must come from the checkpoint
    state = train(resumed, streams, small_cfg(12), tmp_path / "b", resume=True, progress=False)
    assert state["step"] == 12
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_finished_run_extended_by_a_second_phase_equals_one_run_with_both(streams, tmp_path):
    """--continue-steps after a finished run (resumed from its last checkpoint) trains exactly what one run with
    both phases trains: phase 1 does not depend on phase 2; another phase 2 is refused once it has begun."""
    from dataclasses import replace

    both = replace(small_cfg(8), continue_steps=4, continue_lr=1e-3, continue_gsm8k_share=0.8)
    straight = tiny_model()
    train(straight, streams, both, tmp_path / "a", progress=False)
    train(tiny_model(), streams, small_cfg(8), tmp_path / "b", progress=False)  # phase 1 alone, finished
    extended = tiny_model(seed=7)
    state = train(extended, streams, both, tmp_path / "b", resume=True, progress=False)
    assert state["step"] == 12 and state["history"][-1]["step"] == 12
    for (name, a), b in zip(straight.state_dict().items(), extended.state_dict().values()):
        assert torch.equal(a, b), name
    assert lr_at(8, both) < lr_at(9, both) and lr_at(11, both) < 1e-3  # a warm restart, then down
    with pytest.raises(ValueError, match="another second phase"):
        train(tiny_model(), streams, replace(both, continue_steps=6), tmp_path / "b", resume=True, progress=False)


def test_cli_run_saves_a_loadable_folder(data_folder, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfit.cli import main

    monkeypatch.setenv("SPECFIT_DATA_DIR", str(data_folder))
    out = tmp_path / "target"
    argv = ["train-target", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--preset", "tiny",
            "--steps", "6", "--seq-len", "64", "--eval-every", "3", "--warmup", "2", "--final-eval-windows", "2",
            "--stats-windows", "2", "--data-dir", str(data_folder), "--quiet"]
    assert main(argv) == 0
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md",
            "training_report.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.output_router_logits is False and model.generation_config.eos_token_id == 0
    assert tok.eos_token_id == 0 and tok.decode(tok.encode("Question: x\nAnswer: 4")) == "Question: x\nAnswer: 4"
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 6 and set(report["val"]) == {"gsm8k", "openstax"} and len(report["samples"]) == 3
    card = (out / "README.md").read_text()
    assert "CC BY 4.0" in card and "OpenStax, Rice University" in card and "MIT" in card


# ------------------------------------------------------------------------------------------------ routing statistics


def test_union_curve_and_reuse_on_literal_routes():
    # one layer, one sequence of 4 tokens, E = 6, K = 2
    routes = np.array([[[[0, 1], [0, 1], [1, 2], [4, 5]]]])
    mask = rs.expert_mask(routes, 6)
    assert rs.union_curve(mask, 4)[0].tolist() == [2.0, (2 + 3 + 4) / 3, (3 + 5) / 2, 5.0]
    assert rs.adjacent_reuse(mask)["reuse"] == [pytest.approx((2 + 1 + 0) / 3 / 2)]
    lb = rs.load_balance(mask)
    assert lb["dead_experts"] == [1] and lb["max_over_mean_load"][0] == pytest.approx(3 / (8 / 6))
    assert rs.uniform_union(64, 4, 8) == pytest.approx(25.81, abs=0.01)


def test_routing_stats_on_a_tiny_model():
    model = tiny_model()
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    windows = torch.randint(1, 512, (4, 48), generator=torch.Generator().manual_seed(0))
    stats = rs.routing_stats(model, windows, max_k=6, sibling_positions=8)
    for k, (mean, shuffled) in enumerate(zip(stats["union"]["mean"], stats["union"]["shuffled_mean"]), 1):
        assert K <= mean <= min(E, k * K) and K <= shuffled <= min(E, k * K)
    assert all(0 < r <= 1 for r in stats["entropy_ratio"]) and len(stats["reuse"]) == 2
    assert all(K <= v <= 2 * K for v in stats["siblings"]["per_layer"]["top2"])
    assert stats["siblings"]["positions"] == 8
    text = rs.format_tables(stats) + rs.summary(stats)
    assert "k=6" in text and "top4" in text


def test_appended_routes_match_a_plain_forward():
    model = tiny_model().eval()
    window = torch.randint(1, 512, (20,), generator=torch.Generator().manual_seed(1))
    positions, tokens = np.array([5, 12]), np.array([[7, 9, 11], [3, 4, 5]])
    appended = rs.collect_appended_routes(model, window, positions, tokens)  # [L, P, C, K]
    for i, p in enumerate(positions):
        for j, t in enumerate(tokens[i]):
            ids = torch.cat([window[: p + 1], torch.tensor([t])])[None]
            with torch.no_grad():
                logits = model(input_ids=ids, output_router_logits=True).router_logits
            plain = [set(lg[-1].topk(2).indices.tolist()) for lg in logits]
            assert [set(appended[layer, i, j].tolist()) for layer in range(len(plain))] == plain
