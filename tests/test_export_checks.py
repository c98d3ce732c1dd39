"""`specfit export`'s checks: every refusal of the command before anything is written or loaded (in this process,
with the command's work replaced by a failure, and once as typed), the settings file read strictly, the exported
folder found from a loaded model (a local folder, a Hub repo), and settings the loaded model cannot run refused
before SpecFit is enabled."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_export import BIN, caches, environment, exported  # noqa: F401  (fixtures)

from specfit import cli, embedded
from specfit.export import settings as export_settings

pytestmark = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


@pytest.fixture
def no_work(monkeypatch):
    from specfit.export import command

    def work(args):
        raise AssertionError("specfit export's main ran: the refusal came after the work")

    monkeypatch.setattr(command, "main", work)


def refused(capsys, *argv) -> str:
    assert cli.main(["export", *map(str, argv)]) == 2
    return capsys.readouterr().err


def test_an_output_that_is_not_empty_or_cannot_be_written_is_refused(tmp_path, no_work, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    err = refused(capsys, tmp_path / "full")
    assert f"OUT '{tmp_path / 'full'}' exists and is not empty (it holds 'notes.txt')" in err
    assert "give a new folder or an empty one" in err
    err = refused(capsys, tmp_path / "full" / "notes.txt" / "out")
    assert "cannot be written" in err and "notes.txt' on the way is a file" in err
    if Path("/proc/self").is_dir():
        assert "a file in '/proc' cannot be created" in refused(capsys, "/proc/specfit-export")
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_a_model_without_moe_layers_or_weights_or_a_missing_drafter_is_refused(tmp_path, no_work, capsys):
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (dense / "model.safetensors").write_bytes(b"")
    (dense / "tokenizer.json").write_text("{}")
    err = refused(capsys, tmp_path / "a", "--model", dense, "--assistant", "none")
    assert f"--model '{dense}': LlamaForCausalLM has no MoE layers" in err
    moe = tmp_path / "moe"
    shutil.copytree(embedded.TARGET_DIR, moe, ignore=shutil.ignore_patterns("*.safetensors"))
    assert "holds no weights" in refused(capsys, tmp_path / "a", "--model", moe, "--assistant", "none")
    shutil.copy(embedded.TARGET_DIR / "model.safetensors", moe)
    err = refused(capsys, tmp_path / "a", "--model", moe)
    assert "--assistant specfit needs a drafter for --model" in err and "pass --drafter FOLDER" in err
    err = refused(capsys, tmp_path / "a", "--model", moe, "--drafter", tmp_path / "nowhere")
    assert f"--drafter '{tmp_path / 'nowhere'}': no such folder" in err
    (tmp_path / "empty").mkdir()
    assert "holds no config.json" in refused(capsys, tmp_path / "a", "--drafter", tmp_path / "empty")
    err = refused(capsys, tmp_path / "a", "--model", "Qwen/Qwen3-30B-A3B")
    assert "hf download Qwen/Qwen3-30B-A3B --local-dir DIR" in err
    assert "--slots must be in 1..64" in refused(capsys, tmp_path / "a", "--slots", "65")
    assert "--link-ms must be" in refused(capsys, tmp_path / "a", "--link-ms", "-1")
    assert "drop one of them" in refused(capsys, tmp_path / "a", "--cold", "host", "--link-ms", "0.1")
    assert "is not a Hub model id" in refused(capsys, tmp_path / "a", "--base-model", "not an id")
    assert not (tmp_path / "a").exists()


def test_a_refusal_as_typed_exits_2_with_one_line(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    done = subprocess.run([str(BIN / "specfit"), "export", str(tmp_path / "full")], capture_output=True, text=True,
                          env=environment(tmp_path), timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("specfit export: error: OUT ")
    assert "Traceback" not in done.stderr



# --- the settings file ---------------------------------------------------------------------------------------------
def test_settings_are_checked_when_read(tmp_path):
    good = export_settings.build(cache_slots=8, cache_mode="cached", cache_policy="lru", cold=None, link_ms=0.5,
                                 assistant="eagle3", drafter=True, decoding={"depth": 3, "topk": None},
                                 embedded=False, source="x")
    assert good["decoding"] == {"depth": 3} and good["link_ms"] == 0.5
    kwargs = export_settings.enable_kwargs(good, tmp_path)
    assert kwargs == dict(cache_slots=8, cache_mode="cached", cache_policy="lru", depth=3, link=0.5e-3,
                          drafter=str(tmp_path / "drafter"))
    assert export_settings.assistant(good) == "eagle3"
    assert export_settings.assistant(dict(good, assistant="none")) is None
    path = tmp_path / "specfit.json"
    for broken, message in [
        (dict(good, cache_slot=8), "unknown key 'cache_slot'"),
        ({k: v for k, v in good.items() if k != "cache_mode"}, "no 'cache_mode'"),
        (dict(good, cache_slots="8"), "'cache_slots' is '8'"),
        (dict(good, cache_slots=True), "'cache_slots' is True"),
        (dict(good, assistant="medusa"), "'assistant' is 'medusa'"),
        (dict(good, drafter=None), "needs a drafter, and 'drafter' is null"),
        (dict(good, decoding={"max_node": 3}), "'decoding' has 'max_node'"),
        (dict(good, version=2), "version 2; this specfit reads version 1"),
        (dict(good, format="other"), "format 'other'"),
    ]:
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            export_settings.read(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        export_settings.read(path)


# --- where the folder is, and what the loaded model cannot run ------------------------------------------------------
def test_the_folder_is_found_from_the_model_or_refused_with_how_to_load_it(tmp_path, exported, monkeypatch):
    import fnmatch
    from types import SimpleNamespace

    import huggingface_hub

    from specfit.export.location import exported_folder

    out, _, _ = exported

    def model(source):
        return SimpleNamespace(name_or_path=source, config=SimpleNamespace(_name_or_path=source))

    assert exported_folder(model(str(out))) == out.resolve()
    with pytest.raises(ValueError, match=r"holds no custom_generate/specfit.json: load it with AutoModelForCausalLM"):
        exported_folder(model(str(embedded.TARGET_DIR)))
    with pytest.raises(ValueError, match="neither a folder nor a Hub repo id"):
        exported_folder(model(str(tmp_path / "gone")))
    with pytest.raises(ValueError, match=r"the Hub repo 'specfit-test/not-cached' \(revision main\): its "
                                         r"custom_generate/specfit.json and drafter/ could not be fetched"):
        exported_folder(model("specfit-test/not-cached"))  # offline (conftest), and not in the hub cache

    def hub(repo_id, revision=None, allow_patterns=()):  # the Hub, holding the folder: gives what is asked for
        local = tmp_path / "fetched" / repo_id
        for f in out.rglob("*"):
            name = f.relative_to(out).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    fetched = exported_folder(model("specfit-test/online"))
    assert (fetched / "custom_generate" / "specfit.json").is_file() and (fetched / "drafter" / "config.json").is_file()
    assert (fetched / "drafter" / "model.safetensors").is_file()
    assert not (fetched / "model.safetensors").exists()  # the target's weights are transformers' to fetch, once


def test_settings_the_loaded_model_cannot_run_are_refused_before_enabling(tmp_path, caches):
    """A folder exported with --cold host, loaded on the CPU: no host lane there; a model spread over two devices:
    refused, naming the file or the load call, and the model stays plain."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "host"
    assert cli.main(["export", str(out), "--cold", "host", "--slots", "8"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": 0}
    with pytest.raises(ValueError, match=r"loaded over \['0', 'cpu'\].*load the folder with device_map='cuda'"):
        model.generate(ids, max_new_tokens=2)
    del model.hf_device_map
    with pytest.raises(ValueError, match=r"specfit.json: 'cold' 'host' cannot run on cpu .*set it to 'copy' or null"):
        model.generate(ids, max_new_tokens=2)
    assert getattr(model, "specfit", None) is None
    assert model.model.layers[0].mlp.experts.gate_up_proj.device.type == "cpu"  # the experts untouched
