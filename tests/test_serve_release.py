"""``specfit serve`` runs on the serving stacks of transformers 5.24 and 5.25 (each through its own seam): the package
allows exactly those releases, each selects its seam, and any other release (or one missing a name its seam needs)
is told, at import, its version and the pip command."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import transformers  # noqa: E402

from specfit.serving import releases  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_pyproject_range_is_the_releases_with_a_seam():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"transformers>=([0-9.]+),<([0-9.]+)"', pyproject)
    assert pin and pin.groups() == ("5.24", "5.26")
    assert sorted(releases.SUPPORTED) == ["5.24", "5.25"]
    assert releases.PIP == "pip install 'transformers>=5.24,<5.26'"
    for minor, module in releases.SUPPORTED.items():
        assert (ROOT / "src" / "specfit" / "serving" / f"{module}.py").is_file(), minor


def test_each_supported_release_selects_its_seam():
    from specfit.serving import seam

    assert seam.SEAM.__name__ == f"specfit.serving.{releases.SUPPORTED[releases.minor(transformers.__version__)]}"
    installed = releases.minor(transformers.__version__)
    assert seam.select(f"{installed}.3") is seam.SEAM  # a patch release of the installed minor
    assert releases.minor("5.25.0") == "5.25" and releases.minor("5.24.1.dev0") == "5.24"
    assert seam.SEAM.__name__.endswith({"5.24": "seam_524", "5.25": "seam_525"}[installed])


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_an_unsupported_release_is_told_its_version_and_the_pip_command():
    done = run("import transformers\ntransformers.__version__ = '5.26.0'\nimport specfit.serving.seam\n")
    assert done.returncode != 0
    assert "installed transformers 5.26.0 does not have it" in done.stderr
    assert "pip install 'transformers>=5.24,<5.26'" in done.stderr


def test_a_release_missing_a_name_its_seam_needs_says_which():
    # the installed release with a name its seam imports taken away: the remedy, not a bare ImportError
    name = {"5.24": "DirectStreamer", "5.25": "Detokenizer"}[releases.minor(transformers.__version__)]
    done = run(f"import transformers.cli.serving.utils as u\ndel u.{name}\nimport specfit.serving.seam\n")
    assert done.returncode != 0
    assert f"installed transformers {transformers.__version__} does not have it" in done.stderr
    assert "pip install 'transformers>=5.24,<5.26'" in done.stderr and name in done.stderr


def test_both_seams_import_on_either_release():
    # the layout test imports every module: a seam's release-only names are imported when it is chosen
    from specfit.serving import seam_524, seam_525

    assert callable(seam_524.build_app) and callable(seam_525.build_app)
