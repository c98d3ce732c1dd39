"""``specfit train-drafter`` on a tiny random Qwen3-MoE target and a tokenizer trained in code (no shipped weights)."""

import json
import random

import pytest
import torch

import specfit
from specfit.evaluation.datasets import CNN_PROMPT, GSM8K_PROMPT
from specfit.drafting.formats import load_drafter, save_drafter
from specfit.training.drafter import make_drafter
from specfit.training.drafter_loop import DrafterTrainConfig, TargetTap, evaluate, fixed_batches, split, train
from specfit.training.responses import ResponseConfig, build_prompts, generate_responses
from specfit.training.target import make_config
from specfit.training.target_report import save_final
from specfit.training.tokenizer import EOS_ID, encode_batch, train_tokenizer
from specfit.training.ttt import draft_vocab_from_counts

WORDS = ("the government economy history society river empire trade people court law market planet star "
         "citizens power war culture science theory price labor class state family").split()
RCFG = ResponseConfig(num_prompts=24, max_new_tokens=12, batch_size=8, prose_chars=(100, 400), article_chars=(200, 600),
                      seed=0)


def gsm_rows(n, seed, tag="train"):
    rng = random.Random(seed)
    return [{"question": f"{tag} {rng.choice(WORDS)} has {rng.randint(2, 40)} apples. How many?",
             "answer": f"{rng.randint(2, 9)} + 1 = <<1+1=2>>2\n#### 2"} for _ in range(n)]


def book_rows(n, seed):
    rng = random.Random(seed)
    return [{"id": f"book/m{i}", "book": "us-history", "title": f"Section {i}",
             "text": f"Section {i}\n\n" + "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(40)) + "."
                                                   for _ in range(6))} for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [GSM8K_PROMPT.format(question=r["question"]) + " " + r["answer"] for r in gsm_rows(200, 1)]
    return train_tokenizer(texts + [r["text"] for r in book_rows(20, 2)], vocab_size=384)


def tiny_target(seed=0):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(make_config("tiny", vocab_size=384, num_hidden_layers=4, max_position_embeddings=512,
                                             output_router_logits=False))
    with torch.no_grad():
        model.model.norm.weight.mul_(12.0)  # peaky next-token distributions: something definite to learn
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def prompts():
    return build_prompts(RCFG, gsm8k_rows=gsm_rows(40, 1), openstax_rows=book_rows(10, 2))


@pytest.fixture(scope="module")
def data(tokenizer, prompts, tmp_path_factory):
    return generate_responses(tiny_target(), tokenizer, prompts, RCFG, tmp_path_factory.mktemp("work"),
                              progress=False)


def new_drafter(target, data, train_idx, seed=0):
    counts = torch.bincount(data.response_tokens(train_idx), minlength=target.config.vocab_size)
    d2t, t2d = draft_vocab_from_counts(counts, 192, target.config.vocab_size)
    return make_drafter(target, d2t, t2d, intermediate_size=64, seed=seed)


CFG = DrafterTrainConfig(steps=8, batch_size=4, lr=3e-3, warmup_steps=2, eval_every=4, ckpt_every=100)


# ------------------------------------------------------------------------------------------------ data


def test_prompts_use_train_questions_and_passages_only(prompts):
    kinds = [p["kind"] for p in prompts]
    assert {k: kinds.count(k) for k in set(kinds)} == {"gsm8k": 15, "prose": 6, "summary": 3}
    train_questions = {GSM8K_PROMPT.format(question=r["question"]) for r in gsm_rows(40, 1)}
    for p in prompts:
        if p["kind"] == "gsm8k":
            assert p["text"] in train_questions
        elif p["kind"] == "summary":
            assert p["text"].startswith("Article: ") and p["text"].endswith("\nSummary:")
            assert len(p["text"]) <= len(CNN_PROMPT.format(article="")) + RCFG.article_chars[1]
        else:
            assert p["text"] and not p["text"].startswith(("Question:", "Article:"))
    assert build_prompts(RCFG, gsm8k_rows=gsm_rows(40, 1), openstax_rows=book_rows(10, 2)) == prompts  # seeded


def test_responses_mask_only_generated_tokens(data, tokenizer, prompts, tmp_path):
    prompt_ids = encode_batch(tokenizer, [p["text"] for p in prompts])
    assert len(data) == len(prompts) and 0 < sum(data.sampled) < len(data)
    for i, seq in enumerate(data.sequences):
        p = data.prompt_lens[i]
        response = seq[p:].tolist()
        assert seq[:p].tolist() == prompt_ids[i] and p == len(prompt_ids[i])
        assert 1 <= len(response) <= RCFG.max_new_tokens
        assert EOS_ID not in response[:-1]  # cut after the first eos
        assert data.loss_mask(i).tolist() == [0] * p + [1] * len(response)
    # greedy records are what unbatched greedy generate() gives: the left padding and attention mask are right
    target = tiny_target()
    greedy = [i for i in range(len(data)) if not data.sampled[i]][:3]
    for i in greedy:
        ids = torch.tensor([prompt_ids[i]])
        out = target.generate(ids, max_new_tokens=RCFG.max_new_tokens, do_sample=False, eos_token_id=EOS_ID,
                              pad_token_id=EOS_ID)[0].tolist()
        end = out.index(EOS_ID, len(prompt_ids[i])) + 1 if EOS_ID in out[len(prompt_ids[i]):] else len(out)
        assert data.sequences[i].tolist() == out[:end]
    # right padding for training: eos-padded ids, mask 0 on padding
    ids, mask = data.batch([0, 1, 2])
    for row, i in enumerate([0, 1, 2]):
        n = len(data.sequences[i])
        assert ids[row, :n].tolist() == data.sequences[i].tolist() and not mask[row, n:].any()
        assert (ids[row, n:] == EOS_ID).all()


def test_responses_are_cached(tokenizer, prompts, tmp_path):
    target = tiny_target()
    first = generate_responses(target, tokenizer, prompts, RCFG, tmp_path, progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("generate() called although the responses are cached")

    target.generate = refuse
    again = generate_responses(target, tokenizer, prompts, RCFG, tmp_path, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first.sequences, again.sequences))
    assert first.sampled == again.sampled


# ------------------------------------------------------------------------------------------------ training


def test_make_drafter_keeps_aux_layers_in_layer_order():
    """The features are fused in ascending layer order (as vLLM, SGLang and EAGLE capture them), whatever the order
    the ids are passed in; the config records them that way."""
    target = tiny_target()
    d2t, t2d = draft_vocab_from_counts(torch.ones(384), 192, 384)
    drafter = make_drafter(target, d2t, t2d, intermediate_size=64, aux_layer_ids=(3, 0, 2))
    assert drafter.config.aux_layer_ids == (0, 2, 3)
    assert make_drafter(target, d2t, t2d, intermediate_size=64).config.aux_layer_ids == (1, 2, 3)


def test_training_lowers_heldout_loss(data, tmp_path):
    target = tiny_target()
    train_idx, heldout_idx = split(data, heldout_fraction=0.2)
    drafter = new_drafter(target, data, train_idx)
    tap = TargetTap(target, drafter.config.aux_layer_ids)
    held = fixed_batches([len(s) for s in data.sequences], heldout_idx, 4)
    before = evaluate(drafter, tap, data, held, CFG.ttt_steps, CFG.decay)
    tap.remove()
    cfg = DrafterTrainConfig(**{**CFG.__dict__, "steps": 24, "eval_every": 24})
    state = train(drafter, target, data, train_idx, heldout_idx, cfg, tmp_path, progress=False)
    after = state["history"][-1]
    assert state["step"] == 24 and len(after["heldout_acc"]) == CFG.ttt_steps
    assert sum(after["heldout_loss"]) < 0.9 * sum(before["loss"])
    assert not target.model.layers[1]._forward_hooks  # the tap is removed


def test_resume_reproduces_uninterrupted_run(data, tmp_path):
    train_idx, heldout_idx = split(data, heldout_fraction=0.2)
    target = tiny_target()
    straight = new_drafter(target, data, train_idx)
    train(straight, target, data, train_idx, heldout_idx, CFG, tmp_path / "a", progress=False)
    first = new_drafter(target, data, train_idx)
    state = train(first, target, data, train_idx, heldout_idx, CFG, tmp_path / "b", stop_at=3, progress=False)
    assert state["step"] == 3
    resumed = new_drafter(target, data, train_idx, seed=123)  # different init: the checkpoint must replace it
    state = train(resumed, target, data, train_idx, heldout_idx, CFG, tmp_path / "b", resume=True, progress=False)
    assert state["step"] == CFG.steps
    a, b = straight.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_saved_drafter_loads_and_decodes_losslessly(data, tmp_path):
    train_idx, heldout_idx = split(data, heldout_fraction=0.2)
    target = tiny_target()
    drafter = new_drafter(target, data, train_idx)
    train(drafter, target, data, train_idx, heldout_idx, CFG, tmp_path / "work", progress=False)
    save_drafter(drafter, tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    loaded = load_drafter(tmp_path / "drafter", target=target)
    assert loaded.embed_tokens is None and torch.equal(loaded.d2t, drafter.d2t)
    reference = [target.generate(data.sequences[i][None, : data.prompt_lens[i]], max_new_tokens=20, do_sample=False)
                 for i in (0, 1)]
    specfit.enable(target, cache_slots=target.config.num_experts, drafter=loaded)
    for i, expected in zip((0, 1), reference):
        out = target.generate(data.sequences[i][None, : data.prompt_lens[i]], max_new_tokens=20, do_sample=False,
                              assistant="eagle3")
        assert torch.equal(out, expected)


def test_cli_end_to_end(tokenizer, tmp_path, monkeypatch):
    """The subcommand on a data folder and a saved tiny target: responses, training, saving, measures, model card."""
    from specfit.cli import main

    root = tmp_path / "data"
    # --data-dir sets SPECFIT_DATA_DIR for the process (as the command should); restored after this test, so later
    # tests in this worker read the real data folder, not this one
    monkeypatch.setenv("SPECFIT_DATA_DIR", str(root))
    for rel, rows in [("gsm8k/train.jsonl", gsm_rows(40, 1)), ("gsm8k/test.jsonl", gsm_rows(5, 3, tag="test")),
                      ("openstax/train.jsonl", book_rows(10, 2)),
                      ("cnn_dailymail/test.jsonl", [{"article": r["text"], "highlights": "x"} for r in book_rows(2, 4)])]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_final(tiny_target(), tokenizer, tmp_path / "target")
    out = tmp_path / "drafter"
    args = ["train-drafter", "--target", str(tmp_path / "target"), "--out", str(out), "--work-dir",
            str(tmp_path / "work"), "--data-dir", str(root), "--num-prompts", "16", "--max-new-tokens", "8",
            "--steps", "4", "--batch-size", "4", "--eval-every", "2", "--draft-vocab", "128", "--intermediate-size",
            "64", "--eval-gsm8k", "2", "--eval-cnn", "1", "--eval-new-tokens", "8", "--acceptance-prompts", "2",
            "--quiet"]
    assert main(args) == 0
    assert sorted(f.name for f in out.iterdir()) == ["README.md", "acceptance.json", "config.json",
                                                      "model.safetensors", "training_report.json"]
    tables = specfit.AcceptanceTables.load(out / "acceptance.json")
    assert tables.greedy.labels > 0 and tables.meta["prompts"] == 2
    report = json.loads((out / "training_report.json").read_text())
    assert report["acceptance_tables"]["prompts"] == 2 and "acceptance.json" in (out / "README.md").read_text()
    assert report["steps"] == 4 and report["lossless"]["equal_to_plain_generate"]
    assert set(report["acceptance"]) == {"gsm8k", "cnn"} and report["acceptance"]["gsm8k"]["acceptance_length"] >= 1
    assert "OpenStax" in (out / "README.md").read_text()
