"""Coverage of the CUDA-only code by the CPU tests (issues 43 and 52): which lines of ``src/specfit`` and of the GPU
check's own Python scripts (``CHECK``) only a GPU run would take the CPU test run executes (through the CUDA stand-in,
``specfit.offload.standin`` and its second device, and the seams' test doubles).

A line is *CUDA-guarded* when it is
- in the body of an ``if`` whose test says CUDA (``device.type == "cuda"``, ``is_cuda``, ``torch.cuda.*``, the
  runtime's ``cuda`` flag, copy-engine streams, pinned staging, a real host lane), or in its ``else`` when the test
  says "not CUDA" (``!= "cuda"``, ``not ...``, ``streams is None``);
- a statement that calls ``torch.cuda.*``, or one of a conditional expression choosing the FP8 device dequantize;
- in a function or class that only CUDA runs (``CUDA_ONLY``: the threaded host lane, the CUDA seams, the link probe,
  the lane measurement, the check's bandwidth stage).

It runs the given tests (default ``TESTS``) under coverage.py (``pip install -e ".[dev]"`` has it), then prints the
share of guarded lines executed and every guarded line not executed, by file, function and line; a line not
executed must be listed, by its function's name, in ``tests/gpu/cuda_only_lines.txt`` with the reason only a real
kernel can run it (a script's as ``tests/gpu/NAME.py::function``). Exit 1 when an unexecuted line is not listed or
the share is below ``--goal``.

    python tests/gpu/cuda_coverage.py                    # the default tests, about 2-3 minutes here
    python tests/gpu/cuda_coverage.py --data .coverage   # an existing coverage data file (e.g. the full suite's)
    python tests/gpu/cuda_coverage.py -- tests/test_cuda_standin.py   # other tests
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "specfit"
LISTED = ROOT / "tests" / "gpu" / "cuda_only_lines.txt"
CHECK_DIR = ROOT / "tests" / "gpu"
# the GPU check's own Python: the program and what its stages run (tests/gpu/gpu_check.py)
CHECK = ["gpu_check.py", "gpu_stages.py", "gpu_users.py", "decode_check.py", "decode_gate.py", "host_expert_check.py",
         "synthetic_checkpoint.py"]
TESTS = ["tests/test_cuda_standin.py", "tests/test_cuda_standin_devices.py", "tests/test_cuda_standin_lane.py",
         "tests/test_cuda_seams.py", "tests/test_decode_gate_standin.py", "tests/test_gpu_check_standin.py",
         "tests/test_host_lane.py", "tests/test_copy_engine.py", "tests/test_transfer.py", "tests/test_fp8.py",
         "tests/test_syncs.py",
         "tests/test_gpu_scripts.py::test_decode_check_reference_passes_through_the_grouped_path",
         "tests/test_gpu_scripts.py::test_host_expert_check_runs_on_a_cpu", "tests/test_gpu_check.py"]
SKIP = {"offload/standin.py", "offload/standin_device.py"}  # the stand-in itself is CPU code
# functions and classes only CUDA runs: "file::qualname"
CUDA_ONLY = {"offload/host_compute.py::ThreadedLane", "offload/host_compute.py::HostCopies",
             "offload/cache.py::CudaStreams", "transfer.py::CudaCopies", "offload/store.py::CudaHostPinning",
             "offload/store.py::_clear_cuda_error", "offload/bandwidth.py::copy_seconds",
             "offload/runtime.py::SpecFitRuntime._measure_lane", "offload/runtime.py::SpecFitRuntime.measure_once",
             "tests/gpu/gpu_stages.py::bandwidth", "tests/gpu/gpu_stages.py::Link",
             "tests/gpu/gpu_stages.py::sources", "tests/gpu/gpu_stages.py::head_of_line",
             "tests/gpu/host_expert_check.py::copy_ms"}
# the grouped matmul over the slots (``SLOTS``) runs on CUDA in bf16 only (``choose_experts_path``)
POSITIVE = re.compile(r"(\bcuda\b|is_cuda|on_device|\.real\b|\bself\.pinned\b|torch\.cuda|== SLOTS\b)")


def _text(node) -> str:
    return ast.unparse(node)


def polarity(test) -> int:
    """+1: the test is true on CUDA; -1: true off CUDA; 0: says nothing of CUDA."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return -polarity(test.operand)
    if isinstance(test, ast.BoolOp):
        for value in test.values:
            p = polarity(value)
            if p:
                return p
        return 0
    text = _text(test)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right = test.ops[0], _text(test.comparators[0])
        if right == "'cuda'":
            return 1 if isinstance(op, ast.Eq) else -1 if isinstance(op, ast.NotEq) else 0
        if right == "'cpu'" and "device" in _text(test.left):
            return -1 if isinstance(op, ast.Eq) else 1 if isinstance(op, ast.NotEq) else 0
        if right == "None" and re.search(r"\bstreams\b", _text(test.left)):
            return 1 if isinstance(op, ast.IsNot) else -1 if isinstance(op, ast.Is) else 0
        if "get_device_capability" in text:
            return 1
        return 0
    return 1 if POSITIVE.search(text) else 0


def _lines(statements) -> set[int]:
    out = set()
    for stmt in statements:
        out.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return out


def guarded_lines(path: Path, rel: str) -> dict[int, str]:
    """line -> the qualname of the function (or class, or module) holding it, for every CUDA-guarded line."""
    tree = ast.parse(path.read_text())
    guarded: dict[int, str] = {}

    def add(lines, where, innermost: bool = False):
        for n in lines:
            if innermost:
                guarded[n] = where  # a method of a CUDA-only class: named by the method
            else:
                guarded.setdefault(n, where)

    def ends(body) -> bool:
        return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise))

    def visit(node, where, whole: bool):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block(getattr(node, field, None) or [], where, whole)

    def block(stmts, where, whole: bool):
        rest_guarded = False  # after `if not CUDA: ... return`, the rest of the block runs on CUDA only
        for child in stmts:
            if rest_guarded:
                add(_lines([child]), where)
            name, inner = where, whole
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}" if where else child.name
                inner = whole or f"{rel}::{name}" in CUDA_ONLY
                if inner:  # the body, not the signature or the docstring
                    body = child.body[1:] if (child.body and isinstance(child.body[0], ast.Expr) and
                                             isinstance(child.body[0].value, ast.Constant)) else child.body
                    add(_lines(body), name, innermost=whole)
            elif isinstance(child, ast.If):
                p = polarity(child.test)
                if p > 0:
                    add(_lines(child.body), where)
                elif p < 0:
                    add(_lines(child.orelse), where)
                    rest_guarded = rest_guarded or (ends(child.body) and not child.orelse)
            elif isinstance(child, ast.ExceptHandler):
                pass
            else:
                text = _text(child).split("\n", 1)[0] if isinstance(child, (ast.For, ast.While, ast.With, ast.Try)) \
                    else _text(child)
                if "torch.cuda." in text or ("two_pass" in text and "'cuda'" in text):
                    add({child.lineno} if isinstance(child, (ast.For, ast.While, ast.With, ast.Try))
                        else _lines([child]), where)
            visit(child, name, inner)

    visit(tree, "", False)
    # drop lines no statement starts on (continuations are counted by coverage at their statement's first line)
    code = _statement_lines(tree)
    return {n: w for n, w in guarded.items() if n in code}


def _statement_lines(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # docstrings
            out.add(node.lineno)
    return out


def read_listed() -> dict[str, str]:
    """``file::qualname`` -> the reason, from ``LISTED`` (lines ``file::qualname: reason``; # comments)."""
    listed = {}
    for line in LISTED.read_text().splitlines():
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if not line:
            continue
        where, _, reason = line.partition(": ")
        if not reason.strip():
            raise ValueError(f"{LISTED.name}: {line!r} gives no reason")
        listed[where.strip()] = reason.strip()
    return listed


def files():
    """(path, name) of every file counted: ``src/specfit``'s (named from there) and the check's scripts (named
    ``tests/gpu/NAME.py``)."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel not in SKIP:
            yield path, rel
    for name in CHECK:
        yield CHECK_DIR / name, f"tests/gpu/{name}"


def measure(tests: list[str], data: Path) -> None:
    env = dict(os.environ, COVERAGE_FILE=str(data))
    cmd = [sys.executable, "-m", "coverage", "run", "--concurrency=thread", f"--source={SRC},{CHECK_DIR}", "-m",
           "pytest", "-q",
           "-p", "no:cacheprovider", "-m", "not slow and not cuda", *tests]
    print("running:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=None, help="an existing coverage data file (default: run the tests)")
    p.add_argument("--goal", type=float, default=95.0, help="least share of guarded lines executed, in percent")
    p.add_argument("tests", nargs="*", default=None, help=f"test files (default: {' '.join(TESTS)})")
    args = p.parse_args(argv)
    import coverage

    data_file = args.data or ROOT / ".coverage.cuda"
    if args.data is None:
        measure(args.tests or TESTS, data_file)
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    executed_by_file = {str(Path(f).resolve()): set(data.lines(f) or ()) for f in data.measured_files()}
    listed = read_listed()
    total = hit = excused = 0
    missing: list[str] = []
    used = set()
    for path, rel in files():
        lines = guarded_lines(path, rel)
        executed = executed_by_file.get(str(path.resolve()), set())
        for n, where in sorted(lines.items()):
            total += 1
            if n in executed:
                hit += 1
                continue
            key = next((k for k in (f"{rel}::{where}", f"{rel}::{where.rsplit('.', 1)[0]}") if k in listed), None)
            if key is not None:
                excused += 1
                used.add(key)
            else:
                missing.append(f"{rel}:{n} in {where or '<module>'}: {path.read_text().splitlines()[n - 1].strip()}")
    share = 100.0 * hit / max(1, total)
    print(f"RESULT cuda coverage: {hit} of {total} CUDA-guarded lines of src/specfit and the check's scripts executed "
          f"by the CPU tests ({share:.1f}%); "
          f"{excused} not executed and listed with a reason in {LISTED.name}; {len(missing)} neither")
    for key in sorted(used):
        print(f"  listed  {key}: {listed[key]}")
    for key in sorted(set(listed) - used):
        print(f"  listed but fully executed now (drop it from the list): {key}")
    for line in missing:
        print(f"  MISSED  {line}")
    if missing or share < args.goal:
        print(f"FAIL: {'unlisted unexecuted CUDA lines' if missing else ''}"
              f"{' and ' if missing and share < args.goal else ''}"
              f"{f'{share:.1f}% < the goal {args.goal:g}%' if share < args.goal else ''}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
