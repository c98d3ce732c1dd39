"""Every output path and every model folder a command is given is checked before any work: an output nothing can be
written to is refused in the flag's words, and a folder of a model without MoE layers is refused by every command
that takes one, with the Python API's words ("has no MoE layers"). Each command's ``main`` is replaced by a failure
here, so a refusal that came after the work (or not at all) fails the test."""

import json
from pathlib import Path

import pytest

from specfit import cli

UNWRITABLE = {  # command -> its arguments with OUT standing for the output path, and the flag the refusal names
    "calibrate": (["--out", "OUT/profile.json"], "--out"),
    "bench": (["--out", "OUT"], "--out"),
    "make-fp8": (["OUT"], "OUT"),
    "train-target": (["--out", "OUT"], "--out"),
    "train-drafter": (["--out", "OUT"], "--out"),
    "train-router": (["--out", "OUT"], "--out"),
}
MODEL_FOLDER = {  # command -> the option that names a model folder (and what else it needs)
    "calibrate": ["--model", "DENSE", "--prompts", "random"],
    "train-router": ["--model", "DENSE", "--out", "ROUTER"],
    "train-drafter": ["--target", "DENSE", "--out", "DRAFTER"],
    "make-fp8": ["FP8", "--source", "DENSE"],
}



def refusal(argv, capsys) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def a_file_in_the_way(tmp_path) -> str:
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    return str(tmp_path / "notes.txt" / "results")


@pytest.mark.parametrize("command", sorted(UNWRITABLE))
def test_an_output_under_a_file_is_refused_before_any_work(command, tmp_path, no_work, capsys):
    args, flag = UNWRITABLE[command]
    out = a_file_in_the_way(tmp_path)
    err = refusal([command] + [a.replace("OUT", out) for a in args], capsys)
    assert f"specfit {command}: error: {flag} '{out}" in err and "cannot be written" in err
    assert "notes.txt' on the way is a file" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be created")
@pytest.mark.parametrize("command", sorted(UNWRITABLE))
def test_an_output_where_no_file_can_be_created_is_refused_before_any_work(command, no_work, capsys):
    args, flag = UNWRITABLE[command]
    err = refusal([command] + [a.replace("OUT", "/proc/specfit-x") for a in args], capsys)
    assert f"{flag} '/proc/specfit-x" in err and "a file in '/proc' cannot be created" in err


def test_writable_outputs_pass_and_nothing_is_left_behind(tmp_path):
    from specfit import cli_checks

    assert cli_checks.writable(str(tmp_path / "new" / "deeper"), "--out") == tmp_path / "new" / "deeper"
    cli_checks.writable(str(tmp_path / "profile.json"), "--out", kind="file")
    assert list(tmp_path.iterdir()) == []  # neither folders made nor the scratch file kept
    with pytest.raises(ValueError, match="is a folder; it names the file"):
        cli_checks.writable(str(tmp_path), "--out", kind="file")


@pytest.fixture
def dense_folder(tmp_path) -> Path:
    """A dense checkpoint folder as the hub has them: config.json (Llama), weights and a tokenizer file."""
    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("command", sorted(MODEL_FOLDER))
def test_a_model_without_moe_layers_is_refused_by_every_command_as_the_api_refuses_it(
        command, dense_folder, tmp_path, no_work, capsys):
    argv = [a.replace("DENSE", str(dense_folder)) for a in MODEL_FOLDER[command]]
    argv = [str(tmp_path / a) if a in ("ROUTER", "DRAFTER", "FP8") else a for a in argv]
    err = refusal([command] + argv, capsys)
    assert f"'{dense_folder}': LlamaForCausalLM has no MoE layers" in err, err
    assert "Qwen3MoeForCausalLM" in err  # what it would take, as the API names it


def test_the_api_says_the_same_words(dense_folder):
    """specfit.from_pretrained on the same kind of folder (real weights): the phrase the commands repeat."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import specfit

    config = LlamaConfig(**{k: v for k, v in json.loads((dense_folder / "config.json").read_text()).items()
                            if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(dense_folder)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MoE layers"):
        specfit.from_pretrained(dense_folder, cache_slots=2, device="cpu")
