"""Every refusal that can come before the load does (issue 53, item 4): a model without MoE layers (none named, or 0
routed experts) in one message by every command (``serve`` included, with no ``--slots`` detour) and by
``specfit.from_pretrained``; a ``config.json`` that is not JSON, named by its path; an unwritable ``--plot`` or user
cache; a drafter that cannot be found, before the target loads (the command line and the Python API). Each command's
``main`` fails the test here, and the Python API's loader raises if it is reached, so a refusal that came after the
work fails. (How long each takes, on this machine: the report's figures, measured by hand.)"""

import json
from pathlib import Path

import pytest
import torch

import specfit
from specfit import cli, embedded

needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
QWEN = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "moe_intermediate_size": 16, "num_experts_per_tok": 2, "head_dim": 8}



@pytest.fixture
def no_load(monkeypatch):
    """specfit.from_pretrained's loader (the first thing that reads the checkpoint's weights) fails the test."""
    import specfit.patch

    def load(*args, **kwargs):
        raise AssertionError("the target was loaded before the refusal")
    monkeypatch.setattr(specfit.patch, "load_offloaded", load)


def refusal(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


def folder(tmp_path, name: str, config, weights: bytes = b"not safetensors") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (path / "model.safetensors").write_bytes(weights)  # garbage: whatever reads it fails otherwise
    (path / "tokenizer.json").write_text("{}")
    return path


DENSE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize("argv", [["serve", "--model", "M"], ["serve", "--model", "M", "--slots", "4"],
                                  ["calibrate", "--model", "M", "--prompts", "random"]])
def test_a_dense_folder_is_refused_in_one_message_without_a_slots_detour(argv, tmp_path, no_work, capsys):
    pytest.importorskip("fastapi")
    dense = folder(tmp_path, "dense", DENSE)
    err = refusal([str(dense) if a == "M" else a for a in argv], capsys)
    assert f"--model '{dense}': LlamaForCausalLM has no MoE layers" in err and "Qwen3MoeForCausalLM" in err
    assert "pass --slots" not in err


@pytest.mark.parametrize("command", [["calibrate", "--prompts", "random"], ["serve"], ["train-router", "--out", "R"]])
def test_zero_routed_experts_is_a_model_without_moe_layers(command, tmp_path, no_work, capsys):
    pytest.importorskip("fastapi")
    zero = folder(tmp_path, "zero", dict(QWEN, num_experts=0))
    argv = [a if a != "R" else str(tmp_path / "router") for a in command] + ["--model", str(zero)]
    err = refusal(argv, capsys)
    assert f"'{zero}': Qwen3MoeForCausalLM has no MoE layers (its config.json names num_experts: 0" in err


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]"])
def test_a_config_that_is_not_json_is_named_by_its_path(text, tmp_path, no_work, capsys):
    bad = folder(tmp_path, "bad", text)
    err = refusal(["calibrate", "--model", str(bad), "--prompts", "random"], capsys)
    assert f"--model '{bad}': {bad / 'config.json'}" in err
    assert "not a readable JSON file" in err or "holds a JSON list" in err
    assert not err.startswith("specfit calibrate: error: Expecting value")


def test_an_unwritable_plot_is_refused_before_any_work(tmp_path, no_work, capsys):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    plot = tmp_path / "notes.txt" / "fit.png"
    err = refusal(["calibrate", "--plot", str(plot)], capsys)
    assert f"--plot '{plot}' cannot be written" in err and "notes.txt' on the way is a file" in err
    assert cli.main(["calibrate", "--plot", "none", "--threads", "0"]) == 2  # 'none' is no path: the next check speaks
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_an_unwritable_user_cache_is_refused_before_the_calibration(tmp_path, monkeypatch, no_work, capsys):
    (tmp_path / "file").write_text("in the way")
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "file" / "cache"))
    err = refusal(["calibrate"], capsys)
    assert "the user cache ($SPECFIT_CACHE" in err and "cannot be written" in err
    out = tmp_path / "profile.json"  # with --out the cache is not needed for the profile
    with pytest.raises(AssertionError, match="main ran"):
        cli.main(["calibrate", "--out", str(out)])


def test_the_output_helper_checks_any_commands_output(tmp_path):
    """``cli_checks.output``: the helper a command with an output path (``export OUT``) calls in its checks."""
    from argparse import Namespace

    from specfit import cli_checks

    (tmp_path / "f").write_text("x")
    cli_checks.output(Namespace(out=None), "out")
    cli_checks.output(Namespace(out="none"), "out", kind="file")
    cli_checks.output(Namespace(out=str(tmp_path / "new")), "out")
    with pytest.raises(ValueError, match=r"^OUT '.*f/x' cannot be written"):
        cli_checks.output(Namespace(out=str(tmp_path / "f" / "x")), "out", what="OUT")
    with pytest.raises(ValueError, match=r"^--out-dir '.*' is a file"):
        cli_checks.output(Namespace(out_dir=str(tmp_path / "f")), "out_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("drafter, said", [
    ("eagle3-drafter-typo", "--drafter 'eagle3-drafter-typo': no local folder of that name, and the hub could not "
                            "give its config.json"),
    ("no/such/place", "--drafter 'no/such/place' is neither a local EAGLE-3 checkpoint folder"),
    ("EMPTY", "holds no config.json"),
    ("CONFIG_ONLY", "holds no drafter weights (model.safetensors"),
])
def test_a_drafter_that_cannot_be_found_is_refused_before_the_target_loads(drafter, said, tmp_path, no_work, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    drafter = {"EMPTY": str(tmp_path / "empty"), "CONFIG_ONLY": str(tmp_path / "config-only")}.get(drafter, drafter)
    assert said in refusal(["calibrate", "--drafter", drafter], capsys)


@needs_embedded
def test_the_embedded_drafter_passes_the_drafter_check():
    from specfit import cli_checks

    cli_checks.drafter_source(str(embedded.DRAFTER_DIR))


# --- the Python API ----------------------------------------------------------------------------------------------
def test_from_pretrained_refuses_a_dense_folder_before_reading_a_weight(tmp_path):
    dense = folder(tmp_path, "dense", DENSE)  # garbage weights: reading them would fail otherwise
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE layers"):
        specfit.from_pretrained(dense, cache_slots=2, device="cpu")


def test_from_pretrained_refuses_zero_routed_experts_before_the_load(tmp_path, no_load):
    zero = folder(tmp_path, "zero", dict(QWEN, num_experts=0))
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM has no MoE layers \(its config.json names "
                                         r"num_experts: 0"):
        specfit.from_pretrained(zero, cache_slots=2, device="cpu")


def test_from_pretrained_names_a_config_that_is_not_json_by_its_path(tmp_path, no_load):
    bad = folder(tmp_path, "bad", "{not json")
    with pytest.raises(ValueError, match=rf"{bad / 'config.json'} is not a readable JSON file"):
        specfit.from_pretrained(bad, cache_slots=2, device="cpu")


@needs_embedded
@pytest.mark.parametrize("drafter", ["eagle3-drafter-typo", "owner/no-such-drafter", "EMPTY"])
def test_from_pretrained_refuses_a_missing_drafter_before_the_target_loads(drafter, tmp_path, no_load):
    (tmp_path / "empty").mkdir()
    drafter = str(tmp_path / "empty") if drafter == "EMPTY" else drafter
    with pytest.raises(FileNotFoundError, match=r"specfit.from_pretrained\(\.\.\., drafter=.*nothing of the target "
                                                r"was loaded"):
        specfit.from_pretrained(embedded.TARGET_DIR, cache_slots=4, device="cpu", drafter=drafter)


def test_enable_refuses_moe_blocks_without_experts():
    """A built model whose MoE blocks hold 0 routed experts: "has no MoE layers", not a slot range of 1..0."""
    from specfit.enable_checks import _check_experts

    with pytest.raises(ValueError, match="MixtralForCausalLM has no MoE layers \\(its MoE blocks hold 0"):
        _check_experts(type("MixtralForCausalLM", (), {})(), 0)
    _check_experts(object(), 1)


@needs_embedded
def test_a_cast_keeps_the_acceptance_tables_read_with_the_drafter():
    """Issue 54: after ``model.to(torch.bfloat16)`` SpecFit is enabled again; the tables the drafter folder gave
    (its acceptance.json, or the user cache's) are the ones the new runtime reads, not the default prior."""
    model, tokenizer = embedded.load(16)
    tables = model.specfit.acceptance_tables
    assert tables is not None and tables.meta.get("source", "").startswith("specfit.evaluation")  # the folder's
    ids = tokenizer("Question: What is 7 times 8?\nAnswer:", return_tensors="pt").input_ids
    model.generate(ids, max_new_tokens=4, assistant="specfit")
    learned = model.specfit.acceptance_models
    model.to(torch.bfloat16)
    assert model.specfit.acceptance_tables is tables and model.specfit.acceptance_models is learned
    model.generate(ids, max_new_tokens=4, assistant="specfit")
    assert model.specfit.acceptance_models is learned  # still learning into the same models
