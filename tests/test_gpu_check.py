"""The prepared GPU check as a program (``tests/gpu/gpu_check.py``, issue 55 item 2): its arguments, the plan
its dry run reads from the stages' table (the call within the 600 s a command may run, with a rerun of part 3 within
12 device-minutes), the env stage's refusal of a missing package, the summary built from the stages' records (a poor
fit a figure, a failed stage and why), and the wheels the device's image lacks."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specfit.selection.cost_model import CostModel

BENCHMARKS = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402


GPU_CHECK = [sys.executable, str(BENCHMARKS / "gpu_check.py")]


def run(args, timeout=60, **env):
    environ = {k: v for k, v in os.environ.items() if k != "OUT"} | env
    return subprocess.run(args, capture_output=True, text=True, env=environ, timeout=timeout)


def test_gpu_check_arguments(tmp_path):
    help_text = run(GPU_CHECK + ["--help"])
    assert help_text.returncode == 0 and "usage: gpu_check.py" in help_text.stdout and "Parts: 1" in help_text.stdout
    none = run(GPU_CHECK)
    assert none.returncode == 2 and "no output folder: pass one, or set OUT" in none.stderr
    assert "unrecognized arguments: --bogus" in run(GPU_CHECK + ["--bogus", str(tmp_path)]).stderr
    assert run(GPU_CHECK + [str(tmp_path / "a"), str(tmp_path / "b")]).returncode == 2
    bad_stage = run(GPU_CHECK + ["--stages", "env,warp", str(tmp_path)])
    assert bad_stage.returncode == 2 and "unknown stage 'warp'" in bad_stage.stderr
    standin = run(GPU_CHECK + [str(tmp_path)], STANDIN="1", ALLOW_CPU="0")
    assert standin.returncode == 2 and "STANDIN=1 is a CPU run on the CUDA stand-in: set ALLOW_CPU=1" in standin.stderr
    assert run([sys.executable, str(BENCHMARKS / "gpu_stages.py"), "wheels", "--help"]).returncode == 0


def test_gpu_check_dry_run_writes_the_plan_to_one_log(tmp_path):
    """Issue 39, 3 and issue 52, 3: the three parts in one call inside the 600 s command limit, start-up priced at
    150 s, and a rerun of part 3 (the part most likely to fail) inside 12 device-minutes."""
    out = tmp_path / "out"
    dry = run(GPU_CHECK + ["--dry-run"], OUT=str(out))  # the folder from $OUT
    assert dry.returncode == 0, dry.stderr
    log = (out / "gpu_check.log").read_text()
    assert log == dry.stdout and list(out.iterdir()) == [out / "gpu_check.log"]
    for expected in ("pytest -m cuda tests/test_cuda.py", "--preset qwen3-30b-a3b --layers 6",
                     "--slots 48 --cache-mode cached", "decode_check.py", "tests/gpu/host_expert_check.py",
                     "--profile " + str(out / "profile-cached.json"), "--reference --require-pinned --require-grouped",
                     "part 1 (env pytest bandwidth host-experts): 195s; part 2 (env checkpoint calibrate decode): "
                     "215s; part 3 (env users): 115s",
                     "this call (part 1+2+3): 445s of the 600s a command may run: fits; with start-up 595s "
                     "(9.9 device-minutes); run it with timeout_s 600",
                     "with one rerun of part 3 (the part most likely to fail, 115s) at once on the warm machine: "
                     "710s (11.8 device-minutes) of the plan's 720s, margin 10s: fits; after a fresh start 860s "
                     "(14.3 device-minutes) of the 900s: fits", "gpu_users.py --tokens 16 --log",
                     "--lane-seconds 25", "gpu_stages.py bandwidth"):
        assert expected in log, expected
    # calibrate: a verdict to report, not a gate; enough records; no plot
    assert "--probes 48 --max-new-tokens 48" in log and "--plot none --lane-seconds 25 --force" in log
    assert "--cache-mode cleared" not in log  # one profile prices every cache mode: calibrate runs once


@pytest.mark.parametrize("part, stages, absent", [
    ("1", ("pytest -m cuda", "bandwidth 25", "host_expert_check.py"), "decode_check.py"),
    ("2", ("synthetic_checkpoint.py", "decode_check.py"), "pytest -m"),
    ("3", ("users 75", "gpu_users.py"), "decode_check.py")])
def test_gpu_check_parts_plan_their_own_stages(tmp_path, part, stages, absent):
    dry = run(GPU_CHECK + ["--dry-run", "--part", part, str(tmp_path)])
    assert dry.returncode == 0, dry.stderr
    log = (tmp_path / f"gpu_check-part{part}.log").read_text()
    assert all(s in log for s in stages) and absent not in log.split("dry run: the stages")[1]
    assert "run the others at once after it, inside the warm window" in log


def test_gpu_check_dry_run_fails_when_the_plan_would_not_fit(tmp_path):
    short = run(GPU_CHECK + ["--dry-run", str(tmp_path)], COMMAND_LIMIT="300")  # the three parts need 445 s
    assert short.returncode == 1 and "445s of the 300s a command may run: OVER" in short.stdout
    slow_start = run(GPU_CHECK + ["--dry-run", str(tmp_path)], STARTUP="161")  # with the rerun: 721 s
    assert slow_start.returncode == 1 and "of the plan's 720s, margin -1s: OVER: leave a stage" in slow_start.stdout
    assert run(GPU_CHECK + ["--dry-run", str(tmp_path)], STARTUP="160").returncode == 0  # 720 s: just fits
    assert "invalid choice: 4" in run(GPU_CHECK + ["--part", "4", str(tmp_path)]).stderr




def fake_python(tmp_path):
    """A PYTHON for gpu_check.py's stages that runs the real interpreter, except ``-m specfit.cli calibrate``, which
    writes a poor fit's profile to --out and exits 0 only with --force (calibrate's exit status for a poor fit is 3),
    ``tests/gpu/decode_check.py``, which fails as its gate does, naming the profile it was handed, and
    ``tests/gpu/synthetic_checkpoint.py``, which writes nothing (nothing reads the checkpoint)."""
    profile = CostModel(intercepts=(0.01,) * 8, beta=1e-4, copy_overhead=2e-4, link_share=1.0,
                        meta=dict(quality=dict(verdict="poor", heldout_r2=0.12, reasons=["held-out R^2 0.120 < 0.5"])))
    profile.save(tmp_path / "poor.json")
    script = tmp_path / "python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m specfit.cli calibrate" ]; then
    out=$(echo " $* " | sed -E 's/.* --out ([^ ]+) .*/\\1/')
    case " $* " in *" --force "*) cp {tmp_path / "poor.json"} "$out"; exit 0 ;; esac
    exit 3
fi
if [ "$1" = tests/gpu/synthetic_checkpoint.py ]; then
    mkdir -p "$2" && exit 0  # the calibrate and decode below are fakes too: no checkpoint to write
fi
if [ "$1" = tests/gpu/decode_check.py ]; then
    echo "handed: $(echo " $* " | sed -E 's/.* --profile ([^ ]+) .*/\\1/')"
    echo "FAIL (--reference): the slot cache's experts outputs are 1.5 standard deviations from the reference's"
    exit 1
fi
exec {sys.executable} "$@"
""")
    script.chmod(0o755)
    return str(script)


CPU_PART2 = dict(ALLOW_CPU="1", PRESET="tiny", LAYERS="4", SLOTS="12", OMP_NUM_THREADS="1", TOTAL_BUDGET="400")


def test_gpu_check_env_fails_on_a_missing_package(tmp_path):
    """Issue 29, 5: a package the run imports that is not on the machine (here: platformdirs, absent from the GPU
    image) fails the env stage and names the remedy."""
    shadow = tmp_path / "shadow" / "platformdirs"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not in this image')\n")
    res = run(GPU_CHECK + ["--part", "2", "--stages", "env", str(tmp_path / "out")], timeout=300,
              PYTHONPATH=str(tmp_path / "shadow"), PYTHON=sys.executable, WORK=str(tmp_path / "work"), **CPU_PART2)
    assert res.returncode != 0, res.stdout[-2000:]
    assert "platformdirs     MISSING" in res.stdout and "FAIL: missing on this machine: platformdirs" in res.stdout
    assert "python tests/gpu/gpu_check.py --wheels" in res.stdout and "[env] FAIL" in res.stdout
    assert re.search(r"RESULT stage env: FAIL \(exit 1\) \(\d+s\): FAIL: missing on this machine: platformdirs",
                     res.stdout)


def test_gpu_check_reports_the_fit_verdict_and_why_a_stage_failed(tmp_path):
    """Issue 39, 2 and 3: a poor fit is a figure (the stage passes, the profile goes to decode), and the summary says
    in one place what passed, what failed and why."""
    out = tmp_path / "out"
    res = run(GPU_CHECK + ["--part", "2", "--stages", "env,checkpoint,calibrate,decode", str(out)], timeout=400,
              PYTHON=fake_python(tmp_path), WORK=str(tmp_path / "work"), **CPU_PART2)
    text = res.stdout
    assert "[env] PASS" in text and "[checkpoint] PASS" in text and "[calibrate] PASS" in text, text[-3000:]
    assert "RESULT calibration verdict: POOR (held-out R^2 0.120 < 0.5); the profile goes to decode either way" in text
    assert f"handed: {out / 'profile-cached.json'}" in text
    summary = text.split("SUMMARY")[1]
    assert re.search(r"RESULT stage calibrate: PASS \(\d+s\)", summary)
    assert re.search(r"RESULT stage decode: FAIL \(exit 1\) \(\d+s\): FAIL \(--reference\): the slot cache's "
                     r"experts outputs are 1.5 standard deviations", summary), summary
    assert "RESULT check: FAIL: 3 of 4 stages passed; not passed: decode" in summary and res.returncode != 0




def test_gpu_check_fp8_stage_is_the_next_runs_unless_it_fits(tmp_path):
    """Issue 39, 4: the FP8 decode at real shapes is optional (FP8=1); with it the plan leaves no room for a rerun
    after a fresh start, and the dry run says so."""
    dry = run(GPU_CHECK + ["--dry-run", str(tmp_path)], FP8="1")
    assert dry.returncode == 1 and "part 2 (env checkpoint calibrate decode fp8): 305s" in dry.stdout
    assert "OVER: leave a stage to the next run" in dry.stdout and "--fp8-block 128" in dry.stdout
    alone = run(GPU_CHECK + ["--dry-run", "--part", "2", "--stages", "env,checkpoint,fp8", str(tmp_path)], FP8="1")
    assert alone.returncode == 0 and "this call (part 2): 175s of the 600s" in alone.stdout


def test_the_plan_and_the_run_read_one_table(tmp_path, monkeypatch, capsys):
    """A stage's limit is written once, in STAGES: the plan's parts, the call and the rerun follow it."""
    users = next(s for s in gpu_check.STAGES if s.name == "users")
    monkeypatch.setattr(gpu_check, "STAGES", tuple(s if s is not users else gpu_check.Stage(
        "users", 3, 95, users.run, users.plan) for s in gpu_check.STAGES))
    monkeypatch.delenv("OUT", raising=False)
    assert gpu_check.main(["--dry-run", str(tmp_path)]) == 1  # 20 s more: the call and its rerun, 40 s over
    out = capsys.readouterr().out
    assert "part 3 (env users): 135s" in out and "this call (part 1+2+3): 465s" in out
    assert "at once on the warm machine: 750s (12.5 device-minutes) of the plan's 720s, margin -30s: OVER" in out
    assert "  users 95: " in out


def fake_stages(tmp_path):
    """Three stages whose commands print a figure and pass, fail saying why, and outlast their limit."""
    def command(code):
        return lambda c: c.stage_command([sys.executable, "-c", code])

    return (gpu_check.Stage("env", 0, 5, command("print('RESULT env: fake')"), lambda c: "env"),
            gpu_check.Stage("figure", 1, 5, command("print('RESULT figure: 42 tok/s')"), lambda c: "figure"),
            gpu_check.Stage("broken", 1, 5, command("print('FAIL: the wrong expert'); raise SystemExit(3)"),
                            lambda c: "broken"),
            gpu_check.Stage("slow", 1, 6, command(
                "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
                f"time.sleep(60)']); open({str(tmp_path / 'child.pid')!r}, 'w').write(str(child.pid)); "
                "print('started', flush=True); time.sleep(60)"), lambda c: "slow"),
            gpu_check.Stage("after", 1, 5, command("print('RESULT after: never')"), lambda c: "after",
                            needs_checkpoint=True))


def test_the_summary_comes_from_the_stages_records(tmp_path, monkeypatch, capsys):
    """Each stage under its own limit (killed with its children at it), recorded as it ends; the summary lists the
    records, the stages' RESULT lines once each, and the verdict; the log holds all of it."""
    monkeypatch.setattr(gpu_check, "STAGES", fake_stages(tmp_path))
    monkeypatch.setattr(gpu_check, "NAMES", [s.name for s in gpu_check.STAGES])
    monkeypatch.setenv("WORK", str(tmp_path / "work"))
    monkeypatch.delenv("LIMIT_SCALE", raising=False)
    monkeypatch.delenv("ALLOW_CPU", raising=False)
    assert gpu_check.main(["--part", "1", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    summary = out.split("SUMMARY")[1]
    assert re.search(r"RESULT stage env: PASS \(\d+s\)\n", summary) and "RESULT stage figure: PASS" in summary
    assert re.search(r"RESULT stage broken: FAIL \(exit 3\) \(\d+s\): FAIL: the wrong expert", summary)
    assert re.search(r"RESULT stage slow: TIMEOUT \(limit 6s\) \(\d+s\): last line: started", summary)
    assert "RESULT stage after: SKIPPED (0s): no checkpoint" in summary
    assert summary.count("  figure: 42 tok/s") == 1 and "  env: fake" in summary
    assert "RESULT check: FAIL: 2 of 5 stages passed; not passed: broken slow after" in summary
    assert (tmp_path / "out" / "gpu_check-part1.log").read_text() == out
    assert not (tmp_path / "work").exists()  # the work folder goes unless KEEP=1
    status = Path(f"/proc/{(tmp_path / 'child.pid').read_text()}/status")  # the stage's own child: killed with it
    time.sleep(0.5)
    assert not status.exists() or "State:\tZ" in status.read_text()


def test_the_env_stage_runs_under_its_limit(tmp_path):
    """Review 7 item 9: the env stage had no overall limit (only its pip calls had one): a hanging install now ends
    the stage at its limit, and the summary says so."""
    slow = tmp_path / "python"
    slow.write_text(f"#!/usr/bin/env bash\nif [ \"$1 $2\" = \"-m pip\" ]; then sleep 60; fi\n"
                    f"exec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    res = run(GPU_CHECK + ["--part", "3", "--stages", "env", str(tmp_path / "out")], timeout=120, PYTHON=str(slow),
              WORK=str(tmp_path / "work"), ALLOW_CPU="1", LIMIT_SCALE="0.2", TOTAL_BUDGET="100")
    assert res.returncode == 1 and re.search(r"RESULT stage env: TIMEOUT \(limit 6s\)", res.stdout), res.stdout[-2000:]


def test_the_wheels_are_the_ones_transformers_5_25_needs(tmp_path, monkeypatch, capsys):
    """transformers 5.25.0 and what it added beyond the image's packages (huggingface-hub >= 2.4 and its httpx2
    stack, kernels 0.19 and tomlkit), one version each for the device's CPython 3.12, kept out of git."""
    names = {w.split("==")[0] for w in gpu_stages.WHEELS}
    assert "transformers==5.25.0" in gpu_stages.WHEELS and {"huggingface-hub", "kernels", "httpx2", "httpcore2",
                                                              "tomlkit", "regex", "platformdirs"} <= names
    fake = tmp_path / "python"  # a pip that "downloads" an empty wheel per requirement
    fake.write_text("#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do case $1 in -d) dest=$2; shift 2;; *==*) "
                    "touch \"$dest/${1%%==*}.whl\"; shift;; *) shift;; esac; done\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_stages, "ROOT", tmp_path)
    assert gpu_stages.wheels(tmp_path / ".whl", python=str(fake)) == 0
    assert len(list((tmp_path / ".whl").glob("*.whl"))) == len(gpu_stages.WHEELS)
    assert f"wheels: {len(gpu_stages.WHEELS)} files, 0.0 MiB" in capsys.readouterr().out
