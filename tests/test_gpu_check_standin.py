"""The GPU check's parts and their commands on the CUDA stand-in (issues 43, 52 and 55): ``specfit calibrate``,
``decode_check.py --reference``, ``gpu_stages.py`` (bandwidth, the speed factor) and ``gpu_users.py`` take the GPU's
flow on the CPU (``SPECFIT_CUDA_STANDIN=1``: its doubles, its second device); the whole part 2 of
``tests/gpu/gpu_check.py`` (``STANDIN=1``) passes under the device's own stage limits scaled by the measured speed
factor it prints, and fails on a planted wrong expert, and part 3 passes (slow: ~2 minutes each; the fast tests run
the stages' code)."""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from specfit import cli
from specfit.offload import standin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import decode_check  # noqa: E402
import gpu_stages  # noqa: E402
import gpu_users  # noqa: E402
import synthetic_checkpoint as sc  # noqa: E402

# a planted defect: every layer-1 load brings the next expert's weights (a wrong expert). As a subprocess's
# sitecustomize it patches specfit.offload.cache when that is first imported (nothing else is imported at start-up)
WRONG_EXPERT = """
import importlib.util
import sys


def plant(module):
    copy = module.LayerCache._copy

    def wrong(self, loads, *a, **k):
        return copy(self, [((e + 1) % 128 if self.layer == 1 else e, s) for e, s in loads], *a, **k)

    module.LayerCache._copy = wrong


class Plant:
    def find_spec(self, name, path, target=None):
        if name != "specfit.offload.cache":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (run(module), plant(module))
        return spec


if __name__ == "sitecustomize":
    sys.meta_path.insert(0, Plant())
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("standin")
    summary = sc.write_checkpoint(root / "ckpt", "tiny", shard_size="200KB", workers=1)
    sc.write_drafter(root / "drafter", summary["config"], draft_vocab_size=256)
    return root


@pytest.fixture
def on(monkeypatch, tmp_path):
    monkeypatch.setenv(standin.ENV, "1")
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))


def test_calibrate_runs_its_cuda_flow_on_the_stand_in(tiny, on, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = cli.main(["calibrate", "--model", str(tiny / "ckpt"), "--drafter", str(tiny / "drafter"), "--slots", "12",
                     "--prompts", "random", "--num-prompts", "1", "--probes", "13", "--repeats", "1",
                     "--bootstrap", "20", "--max-new-tokens", "40", "--dtype", "bfloat16", "--out", str(out),
                     "--plot", "none", "--force"])
    text = capsys.readouterr().out
    assert code == 0
    assert "link='real copies', cold='auto', host='the host CPU'" in text  # the runtime CUDA builds
    assert "links: real copies, host lanes: the host CPU" in text  # probe_links / probe_lanes as on CUDA
    verdict = re.search(r"^verdict     (GOOD|POOR)", text, re.M)
    profile = json.loads(out.read_text())
    assert verdict and profile["n_records"] >= 13 and any(profile["probes"]["lanes"])


def reference_check(root, *extra):
    return decode_check.main(["--model", str(root / "ckpt"), "--drafter", str(root / "drafter"), "--slots", "12",
                              "--dtype", "bfloat16", "--device", "cpu", "--threads", "1", "--modes", "ar,specfit",
                              "--prompts", "1", "--prompt-len", "16", "--new-tokens", "3", "--reference",
                              "--require-pinned", *extra])


def test_decode_check_passes_on_the_stand_in_and_fails_on_a_wrong_expert(tiny, on, capsys, monkeypatch):
    assert reference_check(tiny) == 0
    out = capsys.readouterr().out
    assert "RESULT reference: pass" in out and "RESULT tokens SpecFit: pass" in out
    import specfit.offload.cache as cache

    monkeypatch.setattr(cache.LayerCache, "_copy", cache.LayerCache._copy)  # the original, restored after the test
    namespace = {"__name__": "plant"}
    exec(WRONG_EXPERT, namespace)  # noqa: S102  (the defect the slow test plants in the subprocess)
    namespace["plant"](cache)
    assert reference_check(tiny) == 1
    assert "RESULT reference: FAIL" in capsys.readouterr().out


def part(out, which="2", plant=None, timeout=400, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "LIMIT_SCALE")} | dict(
        STANDIN="1", ALLOW_CPU="1", PRESET="tiny", LAYERS="4", SLOTS="12", DECODE_PROMPTS="1", DECODE_TOKENS="8",
        OMP_NUM_THREADS="1", PYTHON=sys.executable, WORK=str(out / "work")) | extra
    if plant:
        site = out / "plant"
        site.mkdir()
        (site / "sitecustomize.py").write_text(plant)
        env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "--part", which, str(out)],
                         env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, (out / f"gpu_check-part{which}.log").read_text()


@pytest.mark.slow
def test_part_2_passes_on_the_stand_in_under_the_scaled_device_limits(tmp_path):
    code, log = part(tmp_path)
    factor = re.search(r"RESULT speed factor: (\d+\.\d+) .*stage limits x (\d+\.\d+)", log)
    assert factor, log[-3000:]
    scale = float(factor[2])
    assert abs(scale - max(1.0, float(factor[1]))) < 2e-3  # scaled by the measured factor only, never below 1
    assert f"[calibrate] limit {int(70 * scale + 0.999)}s" in log  # the device's 70 s, scaled
    assert code == 0 and "RESULT check: PASS: all 4 stages passed" in log, (code, log[-3000:])
    assert "link='real copies', cold='auto', host='the host CPU'" in log


@pytest.mark.slow
def test_part_2_fails_on_a_planted_wrong_expert(tmp_path):
    code, log = part(tmp_path, plant=WRONG_EXPERT)
    assert code != 0 and "RESULT stage decode: FAIL" in log and "RESULT check: FAIL" in log, log[-3000:]


FAKE_SMI = [sys.executable, "-c", "print('5, 5, 16, 16')"]  # nvidia-smi's answer for an H200's trained-up link


def test_the_bandwidth_stage_runs_its_cuda_flow_on_the_stand_in(on, capsys):
    """Issue 52, 4: the three sources through the runtime's copy streams and events, the registered arena pinned by
    the store's pinning path, the PCIe generation read while copies run; the floor gates."""
    kw = dict(experts=6, hidden=1024, intermediate=384)
    assert gpu_stages.bandwidth(None, query=FAKE_SMI, **kw) == 0
    out = capsys.readouterr().out
    for line in ("| registered | True |", "| pin_memory | True |", "| pageable | False |",
                 "RESULT pcie link: gen 5, max gen 5, width x 16, max width x 16 (under load",
                 "RESULT h2d head-of-line: one demand copy", "RESULT bandwidth expectation: pass"):
        assert line in out, line
    assert "floor 1 GB/s: the stand-in's memcpy" in out
    assert gpu_stages.bandwidth(1e6, query=["no-such-nvidia-smi"], **kw) == 1  # a floor no link reaches
    out = capsys.readouterr().out
    assert "RESULT pcie link: not read (no-such-nvidia-smi" in out
    assert "registered: " in out and "below the floor 1e+06 GB/s (given (MIN_H2D_GBPS))" in out


def test_the_bandwidth_floor_is_set_by_the_gpu():
    gpu = lambda capability: types.SimpleNamespace(capability=capability)  # noqa: E731
    assert gpu_stages.floor_gbps(gpu((9, 0)), None)[0] == 35.0  # H100/H200: PCIe 5
    assert gpu_stages.floor_gbps(gpu((8, 0)), None)[0] == 20.0  # A100: PCIe 4
    assert gpu_stages.floor_gbps(gpu((9, 0)), 42.0) == (42.0, "given (MIN_H2D_GBPS)")


def test_the_users_part_passes_on_the_stand_in(on, monkeypatch, tmp_path, capsys):
    """Issue 52, 3: generate() on 2 left-padded rows and one row per assistant (host ids, the model on the
    stand-in's device) against plain decoding, then `specfit serve` (its own process, on the stand-in too) through
    the openai client: questions alone, at once (a batch), one streamed."""
    monkeypatch.setenv("ALLOW_CPU", "1")
    torch.set_num_threads(1)
    assert gpu_users.users(tokens=8, log=tmp_path / "serve.log") == 0, (tmp_path / "serve.log").read_text()[-2000:]
    out = capsys.readouterr().out
    for name in ("eagle3", "specfit"):
        assert f"RESULT users generate {name} (2 left-padded rows, host ids): equal to plain decoding" in out
        assert f"RESULT users generate {name} (one row, host ids): equal to plain decoding" in out
    assert "on standin:0" in out and "every answer equal to plain decoding" in out, out[-2000:]
    assert "RESULT users: pass" in out


@pytest.mark.slow
def test_part_3_passes_on_the_stand_in(tmp_path):
    code, log = part(tmp_path, "3", LIMIT_SCALE="4", USERS_TOKENS="8")
    assert code == 0 and "RESULT check: PASS: all 2 stages passed" in log, (code, log[-3000:])
    assert "RESULT users serve: up in" in log


def test_the_host_expert_stage_times_the_copy_on_the_stand_in(on, tmp_path, capsys):
    """The host-experts stage's copy column: one expert's bytes from the pinned arena through the copy engine's
    streams (``copy_seconds``), on the stand-in's device."""
    import host_expert_check

    out = tmp_path / "host.json"
    assert host_expert_check.main(["--hidden", "64", "--intermediate", "32", "--block", "16", "--experts", "2",
                                   "--repeats", "1", "--threads", "1", "--formats", "bf16", "--json", str(out)]) == 0
    assert "(pinned: True)" in capsys.readouterr().out
    row, = json.loads(out.read_text())["rows"]
    assert row["copy_ms"] > 0


def test_decode_check_counts_syncs_with_the_stand_ins_debug_mode(tiny, on, tmp_path):
    """decode_check's CUDA sync count (debug mode plus the host waits it does not report) on the stand-in's device:
    its debug mode reports each host read of a device tensor, as CUDA's does."""
    out = tmp_path / "decode.json"
    assert reference_check(tiny, "--json", str(out)) == 0
    report = json.loads(out.read_text())
    assert report["info"]["device"] == "the CUDA stand-in (a CPU)"
    for mode, r in report["results"].items():
        assert r["sync_counter"] == "cuda sync debug mode + host waits (the CUDA stand-in's)", mode
        assert r["syncs"] > 0 and r["syncs_per_cycle"] > 0


def test_the_stand_ins_sync_debug_mode_reports_host_reads():
    import warnings

    from specfit.offload import standin_device

    dev = standin_device.register()
    x = torch.arange(4, device=dev)
    standin_device.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x.sum().item(), x.tolist(), x.cpu(), torch.zeros(4, dtype=torch.long).copy_(x), (x > 1).nonzero()
            _ = x + 1  # on the device: nothing to report
            torch.zeros(4, dtype=torch.long).copy_(x, non_blocking=True)  # to pinned memory: asynchronous
        assert [str(w.message).startswith("called a synchronizing CUDA operation") for w in caught] == [True] * 5
        standin_device.set_sync_debug_mode(2)
        with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
            x.sum().item()
    finally:
        standin_device.set_sync_debug_mode("default")
    assert standin_device.get_sync_debug_mode() == 0 and x.sum().item() == 6
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        standin_device.set_sync_debug_mode("loud")


def test_the_bandwidth_stage_takes_cudas_seams_on_a_gpu(monkeypatch):
    """Where a GPU is (faked here: no call is made), the stage takes CUDA's own streams and pinned buffers, and the
    floor from the GPU's generation."""
    monkeypatch.delenv(standin.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    from specfit.offload.cache import CudaStreams
    from specfit.offload.host_compute import HostCopies

    seams = gpu_stages.device_seams()
    assert isinstance(seams.streams, CudaStreams) and isinstance(seams.copies, HostCopies)
    assert seams.device == torch.device("cuda") and seams.label == "NVIDIA H200"
    assert gpu_stages.floor_gbps(seams, None)[0] == 35.0
    assert not seams.copies.is_pinned(torch.zeros(2))  # pageable memory, as torch says
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_stages.device_seams(required=False) is None
    with pytest.raises(SystemExit, match="no CUDA device here"):
        gpu_stages.device_seams()


def test_the_bandwidth_gate_fails_a_link_that_is_not_page_locked_or_asynchronous(on, monkeypatch, capsys):
    monkeypatch.setattr(standin.HostCopies, "is_pinned", lambda self, t: False)
    monkeypatch.setattr(gpu_stages.Link, "bench", lambda self, src, batch, reps=40: (1.0, 0.9, 1.0))  # ms
    assert gpu_stages.bandwidth(None, experts=2, hidden=64, intermediate=32, query=FAKE_SMI) == 1
    out = capsys.readouterr().out
    for kind in ("registered", "pin_memory"):
        assert f"{kind}: not page-locked" in out
        assert f"{kind}: the host took 0.900 ms to issue a 1.000 ms copy: not asynchronous" in out


def test_the_link_generation_is_said_when_nvidia_smi_does_not_answer(on):
    seams = gpu_stages.device_seams()
    link = gpu_stages.Link(seams, 2 * 64 * 32 * 3)
    src = torch.zeros(2, 64 * 32 * 3, dtype=torch.bfloat16)
    slow = [sys.executable, "-c", "import time; time.sleep(30)"]
    assert link.generation(src, slow, limit=0.5).startswith("not read (")  # killed at the limit
    assert link.generation(src, [sys.executable, "-c", "print('n/a')"]) == f"not read ({sys.executable} said: n/a)"


def test_require_pinned_says_what_was_not_pinned():
    report = dict(info=dict(cuda=True, pinned_bytes=10, expert_bytes=20), results={"ar": {"pageable_copies": 3}})
    assert decode_check.pageable_failure(report) == ("10 of 20 expert bytes pinned; copies from pageable memory: "
                                                     "{'ar': 3} (synchronous: they overlap nothing)")
    report["info"]["pinned_bytes"], report["results"]["ar"]["pageable_copies"] = 20, 0
    assert decode_check.pageable_failure(report) is None
    report["info"]["cuda"] = False
    assert decode_check.pageable_failure(report).startswith("not a CUDA run")


def test_the_speed_factor_is_measured_on_the_stand_in(on, capsys):
    assert gpu_stages.speed(forwards=6) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    factor = re.search(r"RESULT speed factor: (\d+\.\d+) .*stage limits x (\d+\.\d+)", lines[0])
    assert factor and float(lines[-1]) == float(factor[2]) == max(1.0, float(factor[1]))


def test_the_speed_factor_is_for_the_stand_in_only(monkeypatch, capsys):
    monkeypatch.delenv(standin.ENV, raising=False)
    assert gpu_stages.speed() == 1 and "set SPECFIT_CUDA_STANDIN=1" in capsys.readouterr().out


def test_the_summarys_result_lines_of_a_profile_and_a_decode(tmp_path, capsys):
    profile = dict(beta=2e-4, r2=0.93, n_records=96, copy_overhead_s=1e-5, link_share=0.9,
                   probes=dict(link_seconds=[0.0, 2e-4]), quality=dict(verdict="poor", heldout_r2=0.41,
                                                                        reasons=["held-out R^2 0.410 < 0.5"]))
    (tmp_path / "p.json").write_text(json.dumps(profile))
    assert gpu_stages.main(["fit", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "over 96 records (probe configurations x link and lane settings)" in out
    assert "RESULT calibration verdict: POOR (held-out R^2 0.410 < 0.5); the profile goes to decode either way" in out
    row = dict(tokens_per_second=12.5, copies_per_token=3.0, nodes_per_cycle=4.0, tokens_per_cycle=2.5,
               seconds_per_cycle=0.05, copy_bandwidth=4.8e10, pageable_copies=0, syncs_per_cycle=7.0,
               sync_counter="cuda sync debug mode + host waits", route_source="gate")
    (tmp_path / "d.json").write_text(json.dumps(dict(results=dict(specfit=row))))
    assert gpu_stages.main(["decoded", str(tmp_path / "d.json")]) == 0
    assert capsys.readouterr().out.startswith("RESULT decode SpecFit (gate routes): 12.50 tok/s (wall clock), 3.0 "
                                              "copies/token, 4.00 nodes/cycle, 2.50 tokens/cycle, 50.0 ms/cycle, "
                                              "copies at 48.0 GB/s, 0 pageable copies, 7.0 host syncs/cycle")


def test_the_env_checks_pass_here(monkeypatch, capsys):
    monkeypatch.setenv("ALLOW_CPU", "1")
    assert gpu_stages.env("transformers torch") == 0
    out = capsys.readouterr().out
    assert "RESULT env: torch" in out
    needs = gpu_stages.transformers_needs()  # the installed transformers' own (5.25: kernels, hub >= 2.4, ...)
    assert {"huggingface_hub", "tokenizers", "safetensors", "yaml"} <= set(needs)
    assert all(f"  {name:16s} " in out for name in needs), out
    monkeypatch.delenv("ALLOW_CPU")
    if not torch.cuda.is_available():
        assert gpu_stages.env("transformers") == 1 and "FAIL: torch.cuda.is_available() is False" in \
            capsys.readouterr().out
    assert gpu_stages.env("no_such_module") == 1
    assert "FAIL: missing on this machine: no_such_module" in capsys.readouterr().out


def test_the_users_part_says_what_differs(monkeypatch):
    """A row that leaves plain decoding (a real difference, or a near tie said as such), an answer the server got
    wrong, a streamed one, concurrent requests that never shared a call."""

    class Model:  # generate(): plain decoding, or an assistant's rows with row 1's last token changed
        device = torch.device("cpu")
        specfit = types.SimpleNamespace(stats=types.SimpleNamespace(last_generate=types.SimpleNamespace(new_tokens=4)))

        def generate(self, ids, attention_mask=None, assistant=None, **kw):
            out = torch.cat([ids, torch.tensor([[7, 8]] * ids.shape[0])], 1)
            if assistant is not None:
                out[-1, -1] = 9
            return out

        def __call__(self, ids, **kw):  # plain decoding's logits there: 8 ahead of 9 by `margin`
            logits = torch.zeros(1, ids.shape[1], 16)
            logits[0, -1, 8], logits[0, -1, 9] = 1.0, 1.0 - self.margin
            return types.SimpleNamespace(logits=logits)

    model, ids = Model(), torch.tensor([[0, 3, 4], [5, 6, 2]])
    model.margin = 0.5
    diffs = gpu_users.check_rows(model, "specfit", ids, torch.tensor([[0, 1, 1], [1, 1, 1]]), 2)
    assert diffs == ["generate specfit 2 left-padded rows: row 1 position 4: margin 5.00e-01"]
    model.margin = 1e-6
    assert gpu_users.check_rows(model, "specfit", ids, None, 2) == []  # a near tie: said, not failed
    plain = {"a": "x", "b": "y"}
    ok = [("a", "x", {"batch": 2}), ("b", "y", {"batch": 2})]
    assert gpu_users.serve_differences(plain, ok, "x") == []
    alone = [("a", "x", {"batch": 1}), ("b", "z", {"batch": 1})]
    assert gpu_users.serve_differences(plain, alone, "w") == [
        "serve 'b': 'z' != plain 'y'", "serve streamed 'w' != plain 'x'",
        "serve: no two of 2 concurrent requests shared a call (batch sizes [1, 1])"]


def test_the_env_line_names_the_gpu(monkeypatch, capsys):
    h200 = types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30, multi_processor_count=132, major=9,
                                 minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h200)
    assert gpu_stages.env("transformers") == 0
    assert "NVIDIA H200, 141 GiB, 132 SMs, sm_90" in capsys.readouterr().out
