"""`specfit export OUT` as a user types it (the console script in a subprocess, the embedded model, 16 slots), then
the folder in stock transformers with no SpecFit call in between: `from_pretrained(OUT, trust_remote_code=True)`
decodes with SpecFit (greedy tokens equal plain generate()'s, `model.specfit.stats` readable), without
`trust_remote_code` the model is plain, the same folder as a Hub repo (offline, from the hub cache), and stock
`transformers serve OUT --trust-remote-code` through the official openai client; a checkpoint folder exported without a
drafter. The refusals and the settings file are test_export_checks.py's."""

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specfit import cli, embedded
from specfit.export import settings as export_settings
from specfit.export.streamer import TokenByToken

pytestmark = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")

BIN = Path(sys.executable).parent  # the venv's console scripts: specfit, transformers
PROMPT = "Question: Tom has 3 boxes with 12 apples in each box. How many apples does he have?\nAnswer:"
NEW = 16


def environment(tmp: Path) -> dict:
    """The commands' environment: no network, transformers' modules cache and SpecFit's user cache in ``tmp``."""
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"),
                SPECFIT_CACHE=str(tmp / "specfit-cache"), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`specfit export OUT --slots 16`, typed: the folder, the command's output, and the environment to use it in."""
    tmp = tmp_path_factory.mktemp("export")
    env = environment(tmp)
    out = tmp / "out"
    done = subprocess.run([str(BIN / "specfit"), "export", str(out), "--slots", "16"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, done.stdout, env


@pytest.fixture(scope="module", autouse=True)
def caches(tmp_path_factory):
    """transformers' modules cache (where it copies custom_generate/generate.py) and SpecFit's user cache, in a
    scratch folder for this module: transformers reads HF_MODULES_CACHE once, at its import."""
    import transformers.dynamic_module_utils as dynamic

    tmp = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp / "modules"))
        patch.setenv("SPECFIT_CACHE", str(tmp / "specfit-cache"))
        yield tmp


@pytest.fixture(scope="module")
def loaded(exported):
    """The folder loaded by stock transformers twice: with trust_remote_code (SpecFit's generate) and without."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _ = exported
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return model, plain, AutoTokenizer.from_pretrained(out)


def prompt_ids(tokenizer):
    return tokenizer(PROMPT, return_tensors="pt").input_ids


def test_the_command_writes_a_folder_stock_transformers_loads(exported):
    out, stdout, _ = exported
    target = embedded.TARGET_DIR / "model.safetensors"
    assert (out / "model.safetensors").stat().st_ino == target.stat().st_ino  # linked, not copied
    assert "model.safetensors (26.4 MiB): hard-linked, no copy" in stdout  # and the command says which
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "drafter/config.json", "drafter/model.safetensors", "custom_generate/generate.py"):
        assert (out / name).is_file(), name
    assert (out / "config.json").stat().st_ino != (embedded.TARGET_DIR / "config.json").stat().st_ino  # a copy
    assert (out / "custom_generate" / "requirements.txt").read_text().startswith("specfit>=")
    settings = export_settings.read(out / export_settings.SETTINGS_FILE)
    assert settings["cache_slots"] == 16 and settings["assistant"] == "specfit" and settings["embedded"]
    assert settings["drafter"] == "drafter" and settings["link_ms"] is None and settings["cold"] is None
    card = (out / "README.md").read_text()
    assert "- custom_generate" in card.split("---")[1] and "\n## Base model\n" in card
    assert not list(out.parent.glob(".out.partial-*"))  # the scratch folder was renamed to OUT
    assert f"from_pretrained({str(out)!r}, trust_remote_code=True)" in stdout
    assert f"transformers serve {out} --trust-remote-code" in stdout


def test_trust_remote_code_decodes_with_specfit_and_equals_plain_greedy(loaded):
    model, plain, tokenizer = loaded
    assert getattr(model, "specfit", None) is None  # enabled lazily, at the first call
    ids = prompt_ids(tokenizer)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    stats = model.specfit.stats
    assert stats.last_method == "specfit" and stats.last_generate.cycles >= 1
    assert stats.last_generate.new_tokens == NEW and stats.last_generate.tokens_per_cycle > 1  # drafts accepted
    assert model.specfit.config.cache_slots == 16 and model.specfit.device == model.device  # the folder's settings
    assert "reference profile" in stats.cost_profile  # the embedded model's profile was found by its name
    reference = plain.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert out.tolist() == reference.tolist()
    # without trust_remote_code: transformers' own generate, nothing of SpecFit
    assert "generate" not in vars(plain) and getattr(plain, "specfit", None) is None
    assert isinstance(vars(model)["generate"], functools.partial)  # the folder's, as transformers installed it


def test_what_serving_passes_is_taken_streamer_one_token_per_entry(loaded):
    """streamer, stopping_criteria (a plain function), tokenizer and a generation config, as transformers serve
    passes them: the streamer sees the prompt, then 1-D puts whose tokens are the call's new tokens."""
    from transformers import GenerationConfig

    model, plain, tokenizer = loaded
    puts = []

    class Recorder:
        def put(self, value):
            puts.append(value.clone())

        def end(self):
            puts.append(None)

    def never(input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = prompt_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    out = model.generate(input_ids=ids, generation_config=config, streamer=Recorder(), stopping_criteria=[never],
                         tokenizer=tokenizer)
    assert model.specfit.stats.last_method == "specfit"
    assert puts[-1] is None and puts[0].reshape(-1).tolist() == ids[0].tolist()
    new = puts[1:-1]
    assert new and all(p.dim() == 1 for p in new) and any(p.numel() > 1 for p in new)  # flattened multi-token puts
    assert torch.cat(new).tolist() == out[0, ids.shape[1]:].tolist()
    assert out.tolist() == plain.generate(ids, generation_config=config).tolist()


def test_a_call_names_its_own_assistant_and_other_methods_are_refused_before_work(loaded):
    from transformers import GenerationConfig

    model, plain, tokenizer = loaded
    ids = prompt_ids(tokenizer)
    reference = plain.generate(ids, max_new_tokens=8, do_sample=False)
    assert model.generate(ids, max_new_tokens=8, do_sample=False, assistant=None).tolist() == reference.tolist()
    assert model.specfit.stats.last_method == "ar"
    model.generate(ids, max_new_tokens=8, do_sample=False)
    assert model.specfit.stats.last_method == "specfit"
    config = GenerationConfig(max_new_tokens=8, do_sample=False, assistant="none")  # as a served request's JSON
    assert model.generate(ids, generation_config=config).tolist() == reference.tolist()
    assert model.specfit.stats.last_method == "ar"
    model.generate(ids, max_new_tokens=8, do_sample=False)  # a call of the folder's assistant
    calls = model.specfit.stats.total.new_tokens
    with pytest.raises(ValueError, match=r"beam search: pass assistant=None to run it without the assistant"):
        model.generate(ids, max_new_tokens=8, num_beams=2)
    assert model.specfit.stats.total.new_tokens == calls  # refused before any forward
    beams = model.generate(ids, max_new_tokens=8, num_beams=2, assistant=None)
    assert beams.tolist() == plain.generate(ids, max_new_tokens=8, num_beams=2).tolist()


def test_token_by_token_passes_other_shapes_as_they_are():
    seen = []

    class Sink:
        flag = "kept"

        def put(self, value):
            seen.append(tuple(value.shape))

        def end(self):
            seen.append("end")

    wrapped = TokenByToken(Sink())
    for value in (torch.zeros(1, 3), torch.zeros(2), torch.zeros(2, 3)):
        wrapped.put(value)
    wrapped.end()
    assert seen == [(3,), (2,), (2, 3), "end"] and wrapped.flag == "kept"


HUB_RUN = """
import sys, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained("specfit-test/exported", trust_remote_code=True, dtype=torch.float32)
ids = torch.tensor([[5, 6, 7, 8]])
out = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
runtime = model.specfit
assert runtime.stats.last_method == "specfit", runtime.stats.last_method
assert str(runtime.drafter.name_or_path).startswith(sys.argv[1]), runtime.drafter.name_or_path
del model.generate  # transformers' own generate on the same enabled model: the same tokens
assert out == model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
print("ok", out)
"""


def test_the_folder_loads_as_a_hub_repo_from_the_hub_cache(exported, tmp_path):
    """The folder pushed to the Hub, read back offline from the hub cache in a fresh interpreter (the hub's cache
    folder is read once, at import): the settings and the drafter come from the repo."""
    out, _, env = exported
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--specfit-test--exported"
    shutil.copytree(out, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    done = subprocess.run([sys.executable, "-c", HUB_RUN, str(tmp_path / "hub")], capture_output=True, text=True,
                          env=dict(env, HF_HUB_CACHE=str(tmp_path / "hub")), timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]


# --- stock transformers serve ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stock_transformers_serve_serves_it_with_specfit(exported, loaded, tmp_path):
    """`transformers serve OUT --trust-remote-code --dtype float32` (5.25: the model in a spawned engine process;
    5.24: in the server's process), through the openai client: replies equal plain greedy decoding, streamed and
    not (text and usage), and each request's counters (SPECFIT_STATS_LOG) say SpecFit decoded it."""
    import httpx
    openai = pytest.importorskip("openai")

    out, _, env = exported
    _, plain, tokenizer = loaded
    ids = prompt_ids(tokenizer)
    expected = plain.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:]
    text = tokenizer.decode(expected, skip_special_tokens=True)
    log = tmp_path / "stats.jsonl"
    port = free_port()
    server = subprocess.Popen([str(BIN / "transformers"), "serve", str(out), "--trust-remote-code", "--dtype",
                               "float32", "--host", "127.0.0.1", "--port", str(port)],
                              env=dict(env, SPECFIT_STATS_LOG=str(log)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "transformers serve did not come up in 180 s"
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(model=str(out), prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert reply.choices[0].text == text and reply.usage.completion_tokens == NEW
        assert reply.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model=str(out), prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == NEW  # multi-token puts counted token by token
        lines, waited = [], time.monotonic() + 30  # a streamed reply can end before generate() returns and logs
        while len(lines) < 2 and time.monotonic() < waited:
            time.sleep(0.2)
            lines = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
        assert len(lines) == 2 and all(line["method"] == "specfit" and line["cycles"] >= 1 for line in lines)
        assert all(line["new_tokens"] == NEW and line["tokens_committed"] > line["cycles"] for line in lines)
        # a request's generation_config names the assistant: "none" is plain decoding (5.25 drops a null), the
        # same text
        plain_reply = client.completions.create(model=str(out), prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                extra_body={"generation_config": json.dumps({"assistant": "none"})})
        assert plain_reply.choices[0].text == text
        last = json.loads(log.read_text().splitlines()[-1])
        assert last["method"] == "ar" and last["new_tokens"] == NEW
    finally:
        os.killpg(server.pid, 15)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(10)


def test_a_drafterless_export_of_a_checkpoint_folder_runs_plain_decoding(tmp_path, caches):
    """--model FOLDER --assistant none: no drafter in the folder; generate() runs transformers' decoding on the
    offloaded experts (SpecFit's counters say so)."""
    from transformers import AutoModelForCausalLM

    moe = tmp_path / "moe"
    shutil.copytree(embedded.TARGET_DIR, moe)
    out = tmp_path / "plain-out"
    out.mkdir()  # an empty folder is taken
    assert cli.main(["export", str(out), "--model", str(moe), "--assistant", "none", "--slots", "8",
                     "--link-ms", "0.01", "--base-model", "specfit-test/moe"]) == 0
    settings = export_settings.read(out / export_settings.SETTINGS_FILE)
    assert settings["drafter"] is None and not (out / "drafter").exists() and settings["link_ms"] == 0.01
    assert settings["source"] == "specfit-test/moe" and not settings["embedded"]
    assert "base_model: specfit-test/moe" in (out / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert model.specfit.stats.last_method == "ar" and model.specfit.config.cache_slots == 8
    assert model.specfit.config.link is not None and model.specfit.drafter is None
    assert model.config._name_or_path == str(out)  # not named as the embedded model
    with pytest.raises(ValueError, match="needs a drafter"):
        model.generate(ids, max_new_tokens=5, assistant="specfit")
    del model.generate
    assert got.tolist() == model.generate(ids, max_new_tokens=5, do_sample=False, assistant=None).tolist()
