"""The `specfit serve` command as users type it: its options refused before torch is imported (naming the value and
what would be right), --threads' default said in --help, and the command itself serving the embedded model with an
emulated link of --link-ms ms per copy (read back from the totals) until Ctrl-C stops it cleanly."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from specfit.serving.command import default_threads  # noqa: E402


def refuse(*argv: str) -> tuple[int, str, bool]:
    """(exit code, stderr, torch imported) of `specfit serve ARGV` in a fresh interpreter."""
    code = ("import sys\nfrom specfit.cli import main\nrc = main(sys.argv[1:])\n"
            "print('torch' in sys.modules)\nsys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", code, "serve", *argv], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr, done.stdout.strip().endswith("True")


@pytest.mark.parametrize("argv,words", [
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
    (["--slots", "0"], "--slots must be >= 1, got 0"),
    (["--slots", "65"], "--slots must be in 1..64"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--link-ms", "-1"], "link-ms"),
])
def test_options_are_refused_before_torch_is_imported(argv, words):
    rc, err, torch_imported = refuse(*argv)
    assert rc == 2 and words in err and "Traceback" not in err
    assert not torch_imported


def test_a_dense_model_folder_is_refused_before_torch_is_imported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                                                      "hidden_size": 64, "num_hidden_layers": 2}))
    for extra in ([], ["--slots", "4"]):  # with --slots too: a dense model has nothing to offload
        rc, err, torch_imported = refuse("--model", str(tmp_path), "--assistant", "none", *extra)
        assert rc == 2 and "Qwen3ForCausalLM has no MoE layers" in err and "MixtralForCausalLM" in err
        assert not torch_imported


def test_a_drafter_folder_without_weights_is_refused_before_torch_is_imported(tmp_path):
    """As `specfit calibrate --drafter` refuses it: a folder with a config.json and no weights is no drafter, said
    before the model loads (it was said only after the embedded model had loaded)."""
    (tmp_path / "config.json").write_text("{}")
    rc, err, torch_imported = refuse("--drafter", str(tmp_path))
    assert rc == 2 and "holds no drafter weights" in err and "Traceback" not in err
    assert not torch_imported


def test_threads_default_to_one_for_the_embedded_model_and_every_core_otherwise():
    assert default_threads(True, 16) == 1 and default_threads(False, 16) == 16 and default_threads(False, 0) == 1
    helped = subprocess.run([sys.executable, "-m", "specfit.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=60).stdout
    said = " ".join(helped.split())
    assert "1 for the embedded model" in said and "every core the machine gives this process" in said
    assert "accelerator" in said


def test_build_app_refuses_bad_arguments_before_it_builds_anything():
    from specfit.serving import build_app

    for kwargs, words in (({"max_batch": 0}, "max_batch must be an integer >= 1"),
                          ({"max_batch": True}, "max_batch must be an integer >= 1"),
                          ({"max_queue": 0}, "max_queue must be an integer >= 1"),
                          ({"assistant": "medusa"}, "assistant 'medusa' is not one of"),
                          ({}, "serve needs the model's tokenizer")):
        with pytest.raises(ValueError, match=words):
            build_app(None, None, **kwargs)
    with pytest.raises(ValueError, match="needs a model enabled by SpecFit"):
        build_app(object(), object())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_with_its_link_and_stops_on_ctrl_c(tmp_path):
    port = free_port()
    env = dict(os.environ, SPECFIT_CACHE=str(tmp_path))  # nothing of the user's cache read or written
    process = subprocess.Popen([sys.executable, "-m", "specfit.cli", "serve", "--host", "127.0.0.1", "--port",
                                str(port), "--link-ms", "2", "--slots", "4", "--max-batch", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                answer = httpx.post(f"{url}/completions", timeout=60,
                                    json={"model": "specfit", "prompt": "Question: What is 2+2?\nAnswer:",
                                          "max_tokens": 3, "temperature": 0})
                break
            except httpx.ConnectError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.2)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        totals = httpx.get(f"{url}/specfit/stats", timeout=10).json()
        assert totals["link"] == "emulated link, 2 ms per expert copy"
        assert totals["copies"] > 0 and totals["ms_per_copy"] == pytest.approx(2.0)  # each copy took its 2 ms
        assert totals["queue"]["max_batch"] == 2 and totals["threads"] == 1  # the embedded model's default
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err and "stopped" in out and "torch CPU threads: 1" in out


def test_the_load_benchmark_runs_and_checks_its_answers(tmp_path):
    """``python benchmarks/run.py serve`` at the smallest settings (the server in a child interpreter, as it runs one per
    transformers release): every answer checked against plain generate(), the figures labelled as an emulated
    link on the CPU."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    out = tmp_path / "load.json"
    env = dict(os.environ, SPECFIT_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script), "serve", "--rounds", "0", "--clients", "2", "--requests", "1",
                           "--max-tokens", "2", "--max-batch", "2", "--assistant", "none", "--link-ms", "0.05",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert "EMULATED host link (0.05 ms per copy)" in report["machine"] and "not GPU speed" in report["machine"]
    (release, runs), = report["load"].items()
    run = runs["max_batch=2 assistant=none"]
    assert (run["responses"], run["distinct_ids"], run["wrong"]) == (2, 2, 0) and run["aggregate_tok_s"] > 0
    assert run["tokens_per_server_cpu_second"] > 0 and len(run["per_turn_tok_s"]) == 1
