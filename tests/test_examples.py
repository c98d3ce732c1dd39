"""Every file in examples/ runs in the tests at small settings, through its own code path. The scripts for the
embedded model run as they are; the real-model script runs on a saved copy of the embedded checkpoint whose
tokenizer has a chat template (standing in for the hub model), so its chat template -> generate path is the one a
user with the GPU runs. The notebook runs in tests/test_notebook.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specfit import embedded

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RUN_HERE = ["quickstart.py", "custom_assistant.py", "qwen3_30b_a3b.py"]
RUN_ELSEWHERE = {"quickstart.ipynb": "tests/test_notebook.py"}
needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")
# a Qwen3-style template (the thinking switch included), short enough to read
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")


def test_every_example_is_run_by_a_test():
    assert sorted(p.name for p in EXAMPLES.iterdir()) == sorted(RUN_HERE + list(RUN_ELSEWHERE))


def run(script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@needs_embedded
@pytest.mark.parametrize("script", ["quickstart.py", "custom_assistant.py"])
def test_example_runs(script):
    assert "tokens/cycle" in run(script)


def chat_checkpoint(folder: Path) -> Path:
    """The embedded target saved as a hub checkpoint is: weights, config and a tokenizer with a chat template."""
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(embedded.TARGET_DIR / name, folder / name)
    config = json.loads((embedded.TARGET_DIR / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@needs_embedded
def test_the_real_model_example_runs_through_the_chat_template(tmp_path):
    """transformers 5 returns a BatchEncoding from apply_chat_template(return_tensors="pt"); the example used it as
    the ids and generate() failed with an empty AttributeError."""
    model = chat_checkpoint(tmp_path / "qwen3-moe-chat")
    stdout = run("qwen3_30b_a3b.py", "--model", str(model), "--drafter", str(embedded.DRAFTER_DIR), "--slots", "12",
                 "--max-new-tokens", "6")
    lines = stdout.splitlines()
    assert [line.split()[0] for line in lines if "tok/s" in line] == ["AR", "eagle3", "specfit"]
    assert "copies/token" in stdout and "slots" in lines[0]  # the model's summary printed first
