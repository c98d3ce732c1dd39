"""transformers' own Qwen3-MoE model tests on SpecFit-enabled models: which tests fail only when enabled, and why.

transformers ships no tests in its wheel: check out (or copy) its ``tests/`` folder at the installed version, with
``tests/models/qwen3_moe/test_modeling_qwen3_moe.py`` and what it imports (``NEEDED``), and ``pip install
parameterized``. Never copy them into this repository. Its sdist is not enough: the sdists of 5.24.0 and 5.25.0
(``pip download --no-deps --no-binary :all: transformers==5.25.0``) carry only the 22 top-level ``tests/*.py`` mixin
files (``test_modeling_common.py``, ``test_configuration_common.py``, ``test_pipeline_mixin.py``, ...), none of
``models/``, ``generation/``, ``exporters/`` or ``utils/``: take the folder from a git checkout of the release's tag
(``git clone --depth 1 --branch v5.25.0 https://github.com/huggingface/transformers``).

The file runs twice in subprocesses: plain, and with this module as a pytest plugin that enables SpecFit on every
model the tests build (``model_class(config)``, ``_from_config``, ``from_pretrained``) with ``--slots`` expert slots
per layer (the tests' configs have 8 experts, top-2: 3 slots make experts evict on every forward). It prints every
test that fails only when enabled, with the first line of its reason, and every model class ``enable`` refused.

    python benchmarks/hf_model_tests.py --tests ~/transformers/tests             # the whole file, ~10 min on 2 cores
    python benchmarks/hf_model_tests.py --tests ~/transformers/tests -k "save or state_dict"     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TEST_FILE = "models/qwen3_moe/test_modeling_qwen3_moe.py"
NEEDED = (TEST_FILE, "causal_lm_tester.py", "test_modeling_common.py", "test_configuration_common.py",
          "test_pipeline_mixin.py", "generation/test_utils.py", "exporters/test_export.py",
          "utils/test_configuration_utils.py", "utils/tiny_model_summary.json")
ENV_SLOTS = "SPECFIT_HF_TESTS_SLOTS"  # set in the enabled run: the plugin enables models with this many slots
ENV_LOG = "SPECFIT_HF_TESTS_LOG"  # the plugin appends one JSON line per model it enabled or enable refused


# --- the pytest plugin (active in the enabled run only) ------------------------------------------------------------
def pytest_configure(config) -> None:
    if os.environ.get(ENV_SLOTS):
        _patch_model_construction(int(os.environ[ENV_SLOTS]), os.environ.get(ENV_LOG))


def _patch_model_construction(slots: int, log_path: str | None) -> None:
    """Every Qwen3-MoE model class builds enabled models: its ``__init__`` (the outermost one only: a causal LM
    builds its base model inside) and ``from_pretrained`` (after the weights are loaded) call ``specfit.enable``."""
    import torch
    from transformers import PreTrainedModel
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    import specfit

    module = modeling_qwen3_moe.__name__
    classes = {c for c in vars(modeling_qwen3_moe).values()
               if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == module}
    state = threading.local()

    def record(model, outcome: str, detail: str = "") -> None:
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps({"class": type(model).__name__, "outcome": outcome, "detail": detail}) + "\n")

    def enable(model) -> None:
        if any(p.is_meta for p in model.parameters()):
            return  # built without weights (from_pretrained): enabled once they are loaded
        try:
            specfit.enable(model, cache_slots=slots)
        except (ValueError, TypeError) as err:  # enable's refusals: recorded, the model stays plain
            record(model, "refused", str(err).splitlines()[0])
            return
        record(model, "enabled")

    def wrap_init(cls):
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            depth = getattr(state, "depth", 0)
            state.depth = depth + 1
            try:
                init(self, *args, **kwargs)
            finally:
                state.depth = depth
            if depth == 0 and type(self) is cls and not getattr(state, "loading", False):
                enable(self)

        cls.__init__ = __init__

    for cls in classes:
        wrap_init(cls)

    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def loaded(cls, *args, **kwargs):
        state.loading = True
        try:
            model = from_pretrained(cls, *args, **kwargs)
        finally:
            state.loading = False
        if type(model) in classes and getattr(model, "specfit", None) is None:
            enable(model)
        return model

    PreTrainedModel.from_pretrained = classmethod(loaded)
    torch.set_num_threads(1)


# --- the runner ----------------------------------------------------------------------------------------------------
def run(tests: Path, junit: Path, extra: list[str], slots: int | None, log: Path | None, timeout: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop(ENV_SLOTS, None)
    plugin = []
    if slots is not None:
        env[ENV_SLOTS], env[ENV_LOG] = str(slots), str(log)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
        plugin = ["-p", Path(__file__).stem]
    cmd = [sys.executable, "-m", "pytest", str(tests / TEST_FILE), "-q", "-p", "no:cacheprovider", "-W", "ignore",
           f"--timeout={timeout}", f"--junitxml={junit}", *plugin, *extra]
    subprocess.run(cmd, cwd=tests.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test name -> (outcome, reason) from pytest's junit XML: the reason's first line, and the ``(reason: ...)``
    torch.compile gives for a function it may not trace."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = (child.get("message") or child.text or "").strip()
                reason = text.splitlines()[0][:300] if text else ""
                given = text.find("(reason: ")
                if given >= 0:
                    reason += " " + text[given:].splitlines()[0]
                break
        result[case.get("name")] = (outcome, reason)
    return result


def prepare(tests: Path) -> None:
    """Every file the test file needs is there (``NEEDED``); ``test_pipeline_mixin`` reads
    ``<tests>/../src/transformers``: point it at the installed package."""
    import transformers

    missing = [name for name in NEEDED if not (tests / name).is_file()]
    if missing:
        raise SystemExit(f"--tests {tests}: {', '.join(missing)} missing; it takes transformers' tests/ folder from a "
                         f"git checkout of the installed release (transformers' sdist carries only the top-level "
                         f"mixin files: see this script's docstring)")
    src = tests.parent / "src" / "transformers"
    if not src.exists():
        src.parent.mkdir(exist_ok=True)
        src.symlink_to(Path(transformers.__file__).parent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, required=True, help="transformers' tests/ folder (see the module docstring)")
    p.add_argument("--slots", type=int, default=3, help="expert slots per MoE layer (the tests' models have 8)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression: run only the matching tests (a smoke run)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per test")
    p.add_argument("--out", type=Path, help="write both runs' outcomes here as JSON")
    args = p.parse_args(argv)
    tests = args.tests.resolve()
    prepare(tests)
    extra = ["-k", args.keyword] if args.keyword else []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log = tmp / "enabled.jsonl"
        log.touch()
        run(tests, tmp / "plain.xml", extra, None, None, args.timeout)
        run(tests, tmp / "enabled.xml", extra, args.slots, log, args.timeout)
        plain, enabled = outcomes(tmp / "plain.xml"), outcomes(tmp / "enabled.xml")
        events = [json.loads(line) for line in log.read_text().splitlines()]
    bad = ("failed", "error")
    only = sorted(t for t, (o, _) in enabled.items() if o in bad and plain.get(t, ("passed",))[0] not in bad)
    fixed = sorted(t for t, (o, _) in plain.items() if o in bad and enabled.get(t, ("passed",))[0] not in bad)
    count = Counter(o for o, _ in enabled.values())
    print(f"{len(enabled)} tests; plain: {sum(o in bad for o, _ in plain.values())} failed, enabled "
          f"({args.slots} slots): {count['failed'] + count['error']} failed, {count['passed']} passed, "
          f"{count['skipped']} skipped")
    enabled_models = Counter(e["class"] for e in events if e["outcome"] == "enabled")
    print("models enabled:", ", ".join(f"{c} x{n}" for c, n in sorted(enabled_models.items())) or "none")
    for (cls, detail), n in sorted(Counter((e["class"], e["detail"]) for e in events
                                           if e["outcome"] == "refused").items()):
        print(f"enable refused {cls} x{n}: {detail}")
    print(f"\nfail only when enabled: {len(only)}")
    for t in only:
        print(f"  {t}: {enabled[t][1]}")
    if fixed:
        print(f"\nfail only when plain: {len(fixed)}")
        for t in fixed:
            print(f"  {t}: {plain[t][1]}")
    if args.out:
        args.out.write_text(json.dumps({"plain": plain, "enabled": enabled, "events": events}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
