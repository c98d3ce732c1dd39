"""The GPU check's part 2 and its commands on the CUDA stand-in (issue 43): ``specfit calibrate`` and
``decode_check.py --reference`` take the GPU's flow on the CPU (``SPECFIT_CUDA_STANDIN=1``); the whole part 2 of
``benchmarks/gpu_check.sh`` (``STANDIN=1``) passes under the device's own stage limits scaled by the measured speed
factor it prints, and fails on a planted wrong expert (slow: ~2 minutes each; the fast tests run its commands)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specfit import cli
from specfit.offload import standin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_check  # noqa: E402
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


def part2(out, plant=None, timeout=400):
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | dict(
        STANDIN="1", ALLOW_CPU="1", PRESET="tiny", LAYERS="4", SLOTS="12", DECODE_PROMPTS="1", DECODE_TOKENS="8",
        OMP_NUM_THREADS="1", PYTHON=sys.executable, WORK=str(out / "work"))
    env.pop("LIMIT_SCALE", None)
    if plant:
        site = out / "plant"
        site.mkdir()
        (site / "sitecustomize.py").write_text(plant)
        env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--part", "2", str(out)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    return res.returncode, (out / "gpu_check-part2.log").read_text()


@pytest.mark.slow
def test_part_2_passes_on_the_stand_in_under_the_scaled_device_limits(tmp_path):
    code, log = part2(tmp_path)
    factor = re.search(r"RESULT speed factor: (\d+\.\d+) .*stage limits x (\d+\.\d+)", log)
    assert factor, log[-3000:]
    scale = float(factor[2])
    assert abs(scale - max(1.0, float(factor[1]))) < 2e-3  # scaled by the measured factor only, never below 1
    assert f"[calibrate] limit {int(70 * scale + 0.999)}s" in log  # the device's 70 s, scaled
    assert code == 0 and "RESULT check: PASS: all 4 stages passed" in log, (code, log[-3000:])
    assert "link='real copies', cold='auto', host='the host CPU'" in log


@pytest.mark.slow
def test_part_2_fails_on_a_planted_wrong_expert(tmp_path):
    code, log = part2(tmp_path, plant=WRONG_EXPERT)
    assert code != 0 and "RESULT stage decode: FAIL" in log and "RESULT check: FAIL" in log, log[-3000:]
