"""``specfit calibrate`` refuses slots above the model's experts and a negative host ratio before anything loads, in
the flag's own words (issue 44, item 14): in a fresh interpreter, the refusal's first line names the flag, the value
and what is right, and neither torch nor transformers was imported (so no model was loaded)."""

import json
import os
import subprocess
import sys

from test_cli import OPTION_RUN

REFUSALS = [
    (["calibrate", "--slots", "65"], "--slots must be in 1..64 (the model's experts per MoE layer), got 65"),
    (["calibrate", "--host-ratio", "-1"], "--host-ratio must be a finite number >= 0 (0: no host-lane rounds), got "
                                          "-1.0"),
    (["calibrate", "--host-ratio", "nan"], "--host-ratio must be a finite number >= 0"),
]


def test_calibrate_refuses_too_many_slots_and_a_negative_host_ratio_before_loading(tmp_path):
    argv = json.dumps([args for args, _ in REFUSALS])
    out = subprocess.run([sys.executable, "-c", OPTION_RUN, argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["heavy"] == [], f"checking the options imported {found['heavy']}"
    for (args, message), (code, err) in zip(REFUSALS, found["results"]):
        assert code == 2 and err.startswith("specfit calibrate: error: "), (args, err)
        assert message in " ".join(err.splitlines()[0].split()) and "Traceback" not in err, (args, err)
