"""SpecFit's prepared GPU check: its stages in one device call, each under its own time limit, one log, and a summary
whose RESULT lines say in one place what passed, what failed and why. The plan (``--dry-run``), the run and the
summary read one table, ``STAGES``: a stage is a name, a part, a time limit on the device, and a function.

    python tests/gpu/gpu_check.py [--dry-run] [--part 1|2|3] [--stages LIST] [OUT_DIR]   # OUT_DIR default: $OUT
    python tests/gpu/gpu_check.py --wheels     # where PyPI is reachable: the wheels the device's image lacks

Parts: 1 (env, pytest, bandwidth, host-experts), 2 (env, checkpoint, calibrate, decode; fp8 with FP8=1), 3 (env,
users); by default all three in one call (env once). The plan prices each part at its stage limits plus a reserve,
start-up at STARTUP seconds, and fits the call into the 600 s a command may run and the call with a rerun of part 3
(the part most likely to fail: ``RERUN``) into PLAN_LIMIT (720 s, 12 of the 15 device-minutes). What each stage runs:
``docs/gpu-check.md``. Settings (environment): PRESET, LAYERS (6), SLOTS (48), WORK, STARTUP (150), COMMAND_LIMIT
(600), DEVICE_LIMIT (900), PLAN_LIMIT (720), PYTHON (the stages' interpreter), KEEP, FP8, FP8_BLOCK (128), CAL_ARGS,
DECODE_PROMPTS (1), DECODE_TOKENS (16), USERS_TOKENS (16), REQUIRED, MIN_H2D_GBPS (default: by the GPU),
LIMIT_SCALE, TOTAL_BUDGET; ALLOW_CPU=1 runs it on a CPU (limits x 2), with STANDIN=1 on the CUDA stand-in (limits x
the measured speed factor, ``gpu_stages.py speed``). The stages' own code: ``gpu_stages.py`` (env checks, bandwidth)
and ``gpu_users.py`` (part 3).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
RESERVE = 10  # seconds kept for cleanup and the summary
RERUN = 3  # the part the plan reruns: what users run (batches, the server, the client) has never run on a GPU


@dataclass(frozen=True)
class Stage:
    name: str
    part: int  # 0: every part (env)
    limit: int  # seconds on the device
    run: Callable  # (Check) -> int: the stage's exit status
    plan: Callable  # (Check) -> str: what it runs, for the dry run
    needs_checkpoint: bool = False


class Settings(dict):
    """The check's settings: the environment."""

    def get(self, name: str, default: str = "") -> str:
        return super().get(name) or default

    def num(self, name: str, default: float) -> float:
        return float(super().get(name) or default)


class Check:
    """One run (or dry run): the settings, the stages chosen, the log, each stage's record."""

    def __init__(self, out: Path, part: int | None, stages: list[str], dry: bool, settings: Settings):
        self.out, self.part, self.chosen, self.dry, self.s = out, part, stages, dry, settings
        self.py = settings.get("PYTHON", "python3")
        self.work = Path(settings.get("WORK", "/tmp/specfit-gpu-check"))
        self.site = self.work / "site"
        self.preset, self.layers = settings.get("PRESET", "qwen3-30b-a3b"), int(settings.num("LAYERS", 6))
        self.slots = int(settings.num("SLOTS", 48))
        self.cpu, self.standin = settings.get("ALLOW_CPU") == "1", settings.get("STANDIN") == "1"
        given = settings.get("LIMIT_SCALE")
        self.scale = float(given) if given else 2.0 if self.cpu and not self.standin else 1.0
        self.scale_given = bool(given)
        self.records: list[tuple[str, str, int, str]] = []  # (stage, status, seconds, why)
        self.outputs: list[str] = []  # every stage's output lines (the summary's RESULT lines come from them)
        self.log = (out / f"gpu_check{f'-part{part}' if part else ''}.log").open("w")
        self.deadline = 0.0
        self.child_env = dict(settings, PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1",
                              TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                              SPECFIT_CACHE=str(self.work / "specfit-cache"))  # keep the user cache clean
        if self.standin:
            self.child_env["SPECFIT_CUDA_STANDIN"] = "1"

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def wanted(self) -> list[Stage]:
        """The stages this run takes, in order: env always, the others chosen and in the run's part(s)."""
        return [s for s in STAGES if s.name == "env" or (s.name in self.chosen and self.part in (None, s.part))]

    def part_seconds(self, part: int | None) -> int:
        """A part's (None: every part's) stage limits, the chosen ones and env, plus the reserve."""
        return RESERVE + sum(s.limit for s in STAGES if (s.name == "env" or s.name in self.chosen)
                             and (s.part == 0 or part is None or s.part == part))

    def scaled(self, seconds: float) -> int:
        return int(seconds * self.scale + 0.999)

    def command(self, argv: list[str], limit: float, env: dict | None = None) -> tuple[int, str]:
        """Run ``argv`` in the repository (its own process group), its output to the log as it comes, killed with
        its children at ``limit`` seconds: (exit status, 124 at the limit; its output)."""
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env or self.child_env, start_new_session=True, errors="replace")
        lines: list[str] = []

        def pump():
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                self.say(lines[-1])

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(0.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        reader.join(5)
        self.outputs += lines
        return rc, "\n".join(lines)

    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE

    def run_stage(self, stage: Stage) -> bool:
        """Run one stage under its limit (capped by what is left of the call's budget); record it."""
        limit = min(self.scaled(stage.limit), int(self.left()))
        if limit < 5:
            self.record(stage.name, "SKIPPED", 0, "the call's budget was spent")
            return False
        self.say()
        self.say(f"=== [{stage.name}] limit {limit}s")
        self.stage_limit, t0, start = limit, time.monotonic(), len(self.outputs)
        rc = stage.run(self)
        dt = int(time.monotonic() - t0)
        status = "PASS" if rc == 0 else f"TIMEOUT (limit {limit}s)" if rc == 124 else f"FAIL (exit {rc})"
        self.record(stage.name, status, dt, "" if rc == 0 else why(self.outputs[start:]))
        return rc == 0

    def stage_command(self, argv: list[str], env: dict | None = None) -> int:
        """The stage's one command under the stage's limit."""
        return self.command(argv, self.stage_limit, env)[0]

    def record(self, name: str, status: str, seconds: int, reason: str = "") -> None:
        self.records.append((name, status, seconds, reason))
        self.say(f"=== [{name}] {status} ({seconds}s){': ' + reason if reason else ''}")


def why(lines: list[str]) -> str:
    """A stage's reason: the first FAIL line it printed, else its last line."""
    line = next((x for x in lines if re.match(r"^(FAIL|RESULT [^:]*: FAIL)", x)), None)
    if line is None:
        line = "last line: " + next((x for x in reversed(lines) if x.strip()), "")
    return line[:600]


def env_stage(c: Check) -> int:
    """Packages without network: the carried wheels, specfit built (or copied), then the import and version checks
    (``gpu_stages.py env``) under that path, and the machine's figures; all under the stage's limit."""
    stop = time.monotonic() + c.stage_limit
    c.say(f"python: {shutil.which(c.py) or c.py}")
    wheels = sorted(str(p) for p in (ROOT / ".whl").glob("*.whl"))
    pip = [c.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    if wheels:
        rc = c.command(pip + ["--upgrade", "--target", str(c.site / "deps")] + wheels, stop - time.monotonic())[0]
        if rc:
            c.say("FAIL: installing the carried wheels from .whl/")
            return rc
        c.say(f"carried wheels installed into {c.site / 'deps'}: {' '.join(Path(w).name for w in wheels)}")
    else:
        c.say("no .whl/ folder: using the image's packages (python tests/gpu/gpu_check.py --wheels beforehand, "
              "carry .whl)")
    built = c.command(pip + ["--no-build-isolation", "--target", str(c.site / "pkg"), "."], stop - time.monotonic())
    if built[0]:
        c.say("pip could not build specfit offline; using a copy of src/specfit")
        shutil.rmtree(c.site / "pkg", ignore_errors=True)
        shutil.copytree(ROOT / "src" / "specfit", c.site / "pkg" / "specfit")
        if (ROOT / "calibration").is_dir() and not (ROOT / "src" / "specfit" / "calibration").is_dir():
            shutil.copytree(ROOT / "calibration", c.site / "pkg" / "specfit" / "calibration")
    path = f"{c.site / 'pkg'}:{c.site / 'deps'}"
    c.child_env["PYTHONPATH"] = path + (f":{c.child_env['PYTHONPATH']}" if c.child_env.get("PYTHONPATH") else "")
    rc = c.command([c.py, "tests/gpu/gpu_stages.py", "env"], stop - time.monotonic())[0]
    if rc:
        return rc  # 124: the stage's time ran out
    smi = shutil.which("nvidia-smi")
    if smi:
        c.command([smi], stop - time.monotonic())
        c.command([smi, "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,"
                        "pcie.link.width.current,clocks.max.sm", "--format=csv"], stop - time.monotonic())
    else:
        c.say("nvidia-smi: not found")
    import resource
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    c.work.mkdir(parents=True, exist_ok=True)
    c.say(f"cores: {os.cpu_count()}; memlock: {'unlimited' if memlock == resource.RLIM_INFINITY else memlock}; "
          f"disk at {c.work}: {shutil.disk_usage(c.work).free / 2**30:.0f} GiB free")
    return 0


def pytest_stage(c: Check) -> int:
    """The CUDA tests; FAILS unless tests ran and none skipped (an all-skipped run would otherwise pass)."""
    rc, out = c.command([c.py, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "tests/test_cuda_lane.py", "-q",
                         "-rs", "-p", "no:cacheprovider"], c.stage_limit, dict(c.child_env, SPECFIT_REQUIRE_CUDA="1"))
    found = re.findall(r"^=* *[0-9]+ (?:passed|failed|skipped|errors?|deselected).*$", out, re.M)
    summary = found[-1] if found else "no summary line"
    c.say(f"RESULT pytest: {summary}")
    if rc:
        return rc
    if re.search(r"[0-9]+ skipped", summary) or not re.search(r"(^|[^0-9])[1-9][0-9]* passed", summary):
        c.say(f"FAIL: the CUDA tests did not all run ({summary}): a GPU check must not pass on skips")
        return 1
    return 0


def checkpoint_stage(c: Check) -> int:
    need_mb = c.layers * 1300 + 1800  # qwen3-30b-a3b: 1.21 GB of experts per layer, 1.6 GB more
    c.work.mkdir(parents=True, exist_ok=True)
    free_mb = shutil.disk_usage(c.work).free // 2**20
    c.say(f"checkpoint: preset {c.preset}, {c.layers} layers (qwen3-30b-a3b: the real shapes, {c.layers} of 48 "
          f"layers, needs ~{need_mb} MB); {free_mb} MB free at {c.work}")
    if c.preset == "qwen3-30b-a3b" and free_mb <= need_mb:
        c.say(f"FAIL: not enough disk at {c.work} (set LAYERS lower)")
        return 1
    rc = c.stage_command(checkpoint_cmd(c), dict(c.child_env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    if rc == 0:
        size = sum(p.stat().st_size for p in (c.work / "ckpt").rglob("*") if p.is_file())
        c.say(f"RESULT checkpoint: {size} bytes, preset {c.preset}, {c.layers} layers")
    return rc


def checkpoint_cmd(c: Check, fp8: bool = False) -> list[str]:
    # one OpenMP thread per generator thread: nproc generators x nproc OpenMP threads would oversubscribe the cores
    out = ["ckpt-fp8", "--fp8-block", c.s.get("FP8_BLOCK", "128")] if fp8 else ["ckpt", "--drafter-out",
                                                                               str(c.work / "drafter")]
    return [c.py, "tests/gpu/synthetic_checkpoint.py", str(c.work / out[0]), "--preset", c.preset, "--layers",
            str(c.layers), *out[1:], "--workers", str(os.cpu_count() or 1)]


def calibrate_cmd(c: Check) -> list[str]:
    # --force: the fit's verdict is a figure (gpu_stages.py fit), and decode gets the profile either way; a planning
    # round, a link round and a host-lane round of 2 prompts x ~47 cycles (~280 cycles), the lane round skipped (said)
    # when the lane's measured speed says it would take over 25 s
    return [c.py, "-m", "specfit.cli", "calibrate", "--model", str(c.work / "ckpt"), "--drafter",
            str(c.work / "drafter"), "--slots", str(c.slots), "--cache-mode", "cached", "--prompts", "random",
            "--num-prompts", "2", "--probes", "48", "--max-new-tokens", "48", "--repeats", "1", "--dtype", "bfloat16",
            "--out", str(c.out / "profile-cached.json"), "--plot", "none", "--lane-seconds", "25", "--force",
            *shlex.split(c.s.get("CAL_ARGS"))]


def calibrate_stage(c: Check) -> int:
    env = dict(c.child_env, TQDM_MININTERVAL="10")  # tqdm progress every 10 s
    env.pop("TQDM_DISABLE")
    rc = c.stage_command(calibrate_cmd(c), env)
    if rc == 0:  # the fit's figures and verdict, for the summary
        c.command([c.py, "tests/gpu/gpu_stages.py", "fit", str(c.out / "profile-cached.json")], 30)
    return rc


def decode_cmd(c: Check, fp8: bool = False) -> list[str]:
    cmd = [c.py, "tests/gpu/decode_check.py", "--model", str(c.work / ("ckpt-fp8" if fp8 else "ckpt")), "--drafter",
           str(c.work / "drafter"), "--slots", str(c.slots)]
    if (c.out / "profile-cached.json").is_file() or c.dry:
        cmd += ["--profile", str(c.out / "profile-cached.json")]
    cmd += (["--modes", "ar,specfit", "--prompts", "1"] if fp8 else ["--prompts", c.s.get("DECODE_PROMPTS", "1")])
    cmd += ["--prompt-len", "32", "--new-tokens", c.s.get("DECODE_TOKENS", "16"), "--dtype", "bfloat16", "--json",
            str(c.out / ("decode-fp8.json" if fp8 else "decode.json")), "--reference"]
    if not c.cpu:
        return cmd + ["--require-pinned"] + ([] if fp8 else ["--require-grouped"])
    return cmd + (["--require-pinned"] if c.standin and not fp8 else [])  # the stand-in registers as CUDA does


def decode_stage(c: Check) -> int:
    if not (c.out / "profile-cached.json").is_file():
        c.say("note: no calibrated profile: SpecFit uses its default cost model")
    rc = c.stage_command(decode_cmd(c))
    if (c.out / "decode.json").is_file():  # rewritten after each mode: the modes done so far, even after a timeout
        c.command([c.py, "tests/gpu/gpu_stages.py", "decoded", str(c.out / "decode.json")], 30)
    return rc


def fp8_stage(c: Check) -> int:
    """The synthetic checkpoint's FP8 twin (same random weights, quantized), decoded with the gate."""
    stop = time.monotonic() + c.stage_limit
    rc = c.command(checkpoint_cmd(c, fp8=True), stop - time.monotonic(),
                   dict(c.child_env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))[0]
    return rc or c.command(decode_cmd(c, fp8=True), stop - time.monotonic())[0]


def users_cmd(c: Check) -> list[str]:
    return [c.py, "tests/gpu/gpu_users.py", "--tokens", c.s.get("USERS_TOKENS", "16"), "--log",
            str(c.out / "serve.log")]


STAGES = (
    Stage("env", 0, 30, env_stage, lambda c: f"install .whl/*.whl into {c.site / 'deps'}, build specfit into "
                                             f"{c.site / 'pkg'}, versions, nvidia-smi"),
    Stage("pytest", 1, 100, pytest_stage,
          lambda c: "SPECFIT_REQUIRE_CUDA=1 pytest -m cuda tests/test_cuda.py tests/test_cuda_lane.py, no skips"),
    Stage("bandwidth", 1, 25, lambda c: c.stage_command([c.py, "tests/gpu/gpu_stages.py", "bandwidth"]),
          lambda c: f"{c.py} tests/gpu/gpu_stages.py bandwidth: H2D of one 9,437,184-byte expert, registered / "
                    f"pinned / pageable; floor {c.s.get('MIN_H2D_GBPS', 'by the GPU (35 GB/s at sm_90+)')}"),
    Stage("host-experts", 1, 30, lambda c: c.stage_command(host_cmd(c)), lambda c: " ".join(host_cmd(c))),
    Stage("checkpoint", 2, 45, checkpoint_stage, lambda c: " ".join(checkpoint_cmd(c)[1:])),
    Stage("calibrate", 2, 70, calibrate_stage, lambda c: " ".join(calibrate_cmd(c)), needs_checkpoint=True),
    Stage("decode", 2, 60, decode_stage, lambda c: " ".join(decode_cmd(c)), needs_checkpoint=True),
    Stage("fp8", 2, 90, fp8_stage, lambda c: f"{' '.join(checkpoint_cmd(c, True)[1:])}; then "
                                             f"{' '.join(decode_cmd(c, True))}", needs_checkpoint=True),
    Stage("users", 3, 75, lambda c: c.stage_command(users_cmd(c)), lambda c: " ".join(users_cmd(c))),
)
NAMES = [s.name for s in STAGES]


def host_cmd(c: Check) -> list[str]:
    return [c.py, "tests/gpu/host_expert_check.py", "--json", str(c.out / "host_experts.json")]


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def plan(c: Check) -> int:
    """The dry run: seconds per part and call, the call with a rerun of part ``RERUN``; 1 if it does not fit."""
    startup, command_limit = int(c.s.num("STARTUP", 150)), int(c.s.num("COMMAND_LIMIT", 600))
    device_limit, plan_limit = int(c.s.num("DEVICE_LIMIT", 900)), int(c.s.num("PLAN_LIMIT", 720))
    parts = {p: c.part_seconds(p) for p in (1, 2, 3)}
    one = c.part_seconds(c.part)
    call = one + startup
    warm, rerun = call + parts[RERUN], parts[RERUN]
    cold = warm + startup
    named = {p: " ".join(s.name for s in STAGES if (s.part in (0, p)) and (s.name == "env" or s.name in c.chosen))
             for p in (1, 2, 3)}
    c.say(f"plan (seconds; each part's and each call's estimate is the sum of its stage limits plus {RESERVE}s of "
          f"reserve; a fresh machine's start-up priced at {startup}s):")
    c.say("  " + "; ".join(f"part {p} ({named[p]}): {parts[p]}s" for p in (1, 2, 3)))
    c.say(f"  this call (part {c.part or '1+2+3'}): {one}s of the {command_limit}s a command may run: "
          f"{'fits' if one <= command_limit else 'OVER'}; with start-up {call}s ({minutes(call)} device-minutes); "
          f"run it with timeout_s {command_limit}")
    c.say(f"  with one rerun of part {RERUN} (the part most likely to fail, {rerun}s) at once on the warm machine: "
          f"{warm}s ({minutes(warm)} device-minutes) of the plan's {plan_limit}s, margin {plan_limit - warm}s: "
          f"{'fits' if warm <= plan_limit else 'OVER: leave a stage to the next run'}; after a fresh start {cold}s "
          f"({minutes(cold)} device-minutes) of the {device_limit}s: {'fits' if cold <= device_limit else 'OVER'}")
    c.say(f"  a rerun of part 1 ({parts[1]}s) or part 2 ({parts[2]}s) at once instead: {call + parts[1]}s or "
          f"{call + parts[2]}s of the {device_limit}s")
    if c.part:
        c.say("  (a part alone: run the others at once after it, inside the warm window: no second start-up)")
    c.say("dry run: the stages (limits in seconds)")
    for stage in c.wanted():
        c.say(f"  {stage.name} {stage.limit}: {stage.plan(c)}")
    return 0 if one <= command_limit and warm <= plan_limit else 1


def run(c: Check) -> int:
    """Every stage this run takes, in order; 1 unless all passed."""
    if c.standin and not c.scale_given:
        rc, out = c.command([c.py, "tests/gpu/gpu_stages.py", "speed"], 300,
                            dict(c.child_env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src")))
        if rc:
            c.say("FAIL: the speed factor could not be measured")
            return 2
        c.scale = float(out.strip().splitlines()[-1])
    c.deadline = time.monotonic() + int(c.s.num("TOTAL_BUDGET", c.scaled(c.part_seconds(c.part))))
    c.work.mkdir(parents=True, exist_ok=True)
    (c.work / ".specfit-gpu-check").touch()
    stages = c.wanted()
    if not c.run_stage(stages[0]):  # env
        c.say("the environment is not usable: only the bandwidth stage (torch alone) still runs")
        for stage in stages:
            if stage.name == "bandwidth":
                c.run_stage(stage)
        return 1
    have = {"env"}
    for stage in stages[1:]:
        if stage.needs_checkpoint and "checkpoint" not in have:
            c.record(stage.name, "SKIPPED", 0, "no checkpoint")
        elif c.run_stage(stage):
            have.add(stage.name)
    return 0 if all(r[1] == "PASS" for r in c.records) else 1


def summary(c: Check, started: float) -> bool:
    """What passed, what failed and why, in one place; True when every stage passed."""
    c.say()
    c.say("=" * 32 + " SUMMARY " + "=" * 32)
    c.say(f"SpecFit GPU check, part {c.part or '1+2+3'}: {c.preset} with {c.layers} layers (the real per-layer "
          f"shapes, {c.layers} of 48 layers, for qwen3-30b-a3b), SLOTS={c.slots}; {int(time.monotonic() - started)}s")
    failed = [name for name, status, _, _ in c.records if status != "PASS"]
    for name, status, seconds, reason in c.records:
        c.say(f"RESULT stage {name}: {status} ({seconds}s){': ' + reason if status != 'PASS' else ''}")
    for line in dict.fromkeys(x for x in c.outputs if x.startswith("RESULT ") and not x.startswith("RESULT stage ")):
        c.say("  " + line[len("RESULT "):])
    if not failed:
        c.say(f"RESULT check: PASS: all {len(c.records)} stages passed; log: {c.log.name}")
    else:
        c.say(f"RESULT check: FAIL: {len(c.records) - len(failed)} of {len(c.records)} stages passed; not passed: "
              f"{' '.join(failed)} (reasons in the RESULT stage lines above); log: {c.log.name}")
    return not failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=os.environ.get("OUT"), help="the log's and the results' folder ($OUT)")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the plan; run nothing")
    p.add_argument("--part", type=int, choices=(1, 2, 3), default=None, help="one part (default: all three)")
    p.add_argument("--stages", default=None, help=f"comma-separated subset of: {','.join(NAMES)} (env always; "
                                                  f"calibrate, decode and fp8 need checkpoint; fp8 only with FP8=1)")
    p.add_argument("--wheels", action="store_true", help="fetch the wheels the device's image lacks into .whl/ "
                                                          "(gpu_stages.py wheels: where PyPI is reachable)")
    args = p.parse_args(argv)
    if args.wheels:
        return subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_stages.py"), "wheels"]).returncode
    settings = Settings(os.environ)
    chosen = args.stages.split(",") if args.stages else [n for n in NAMES if n != "fp8" or settings.get("FP8") == "1"]
    unknown = [n for n in chosen if n not in NAMES]
    if unknown:
        p.error(f"unknown stage '{unknown[0]}' (stages: {' '.join(NAMES)})")
    if not args.out:
        p.error("no output folder: pass one, or set OUT")
    if settings.get("STANDIN") == "1" and settings.get("ALLOW_CPU") != "1":
        p.error("STANDIN=1 is a CPU run on the CUDA stand-in: set ALLOW_CPU=1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = Check(out, args.part, chosen, args.dry_run, settings)
    started = time.monotonic()
    c.say(f"SpecFit GPU check, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, host {os.uname().nodename}, "
          f"repo {ROOT}")
    c.say(f"settings: PRESET={c.preset} LAYERS={c.layers} SLOTS={c.slots} WORK={c.work} part={c.part or 'all'} "
          f"stages={','.join(chosen)} log={c.log.name} LIMIT_SCALE={c.scale:g}")
    if args.dry_run:
        return plan(c)
    try:
        rc = run(c)
        passed = summary(c, started)
    finally:
        if settings.get("KEEP") != "1" and (c.work / ".specfit-gpu-check").is_file():
            shutil.rmtree(c.work, ignore_errors=True)
    return 0 if passed and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
