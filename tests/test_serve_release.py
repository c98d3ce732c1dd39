"""``specfit serve`` reaches into transformers' serving stack, which 5.25 rewrote: the package pins the release the
seam was tested on, and on any other release the import names that release and how to install it."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_pin_is_the_release_the_serving_seam_names():
    from specfit.serving.seam import TESTED_TRANSFORMERS

    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"transformers>=([0-9.]+),<([0-9.]+)"', pyproject)
    assert pin, "pyproject.toml no longer pins transformers to a minor release"
    major, minor = TESTED_TRANSFORMERS.split(".")
    assert pin.groups() == (TESTED_TRANSFORMERS, f"{major}.{int(minor) + 1}")


def test_serve_on_a_release_without_the_stack_says_which_release_to_install():
    # the installed release with the names 5.25 removed: the seam's import must fail with the remedy, not a bare name
    code = ("import transformers.cli.serving.utils as u\n"
            "del u.DirectStreamer\n"
            "import specfit.serving.seam\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    import transformers

    assert f"installed transformers {transformers.__version__} does not have it" in run.stderr
    assert "pip install 'transformers==5.24.*'" in run.stderr
    assert "DirectStreamer" in run.stderr
