"""Nothing writes inside the installed package at run time: ``specfit calibrate`` in either mode leaves every
package file byte-identical; the acceptance tables go to the user cache, where enable reads them first."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specfit
from specfit import embedded
from specfit.evaluation import datasets
from specfit.selection import acceptance_cache

PACKAGE = Path(specfit.__file__).parent
needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


def package_hashes() -> dict:
    return {str(p.relative_to(PACKAGE)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(PACKAGE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def calibrate(cache, *args):
    env = dict(os.environ, SPECFIT_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "specfit.cli", "calibrate", *args], capture_output=True, text=True,
                         env=env, timeout=900)
    return out


@needs_embedded
@pytest.mark.skipif(datasets.data_dir() is None,
                    reason="--acceptance-only decodes GSM8K train questions and CNN/DailyMail articles from the local "
                           "data folder ($SPECFIT_DATA_DIR, or shared/data beside the repository), absent here")
def test_calibrate_acceptance_only_leaves_the_package_byte_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    before = package_hashes()
    out = calibrate(tmp_path, "--acceptance-only", "--num-prompts", "1", "--max-new-tokens", "4", "--threads", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    written = acceptance_cache.user_tables_path(embedded.DRAFTER_DIR)
    assert written.is_relative_to(tmp_path) and written.is_file()
    assert json.loads(written.read_text())["meta"]["prompts"] == 1
    assert str(written) in out.stdout
    assert package_hashes() == before


@needs_embedded
def test_calibrate_leaves_the_package_byte_identical(tmp_path, monkeypatch):
    """The cost profile's mode, as short as it runs, on random prompts (no data folder needed; its fit may be
    refused: what matters is where it writes)."""
    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path))
    before = package_hashes()
    out = calibrate(tmp_path, "--prompts", "random", "--num-prompts", "3", "--max-new-tokens", "48", "--probes", "16",
                    "--repeats", "1", "--bootstrap", "20", "--threads", "1", "--slots", "12",
                    "--host-ratio", "0")  # no host-lane rounds: they write where the link rounds do, and take as long
    assert out.returncode in (0, 3), out.stderr[-3000:]
    assert package_hashes() == before


def test_enable_reads_the_user_cache_tables_before_the_drafters_own(tmp_path, monkeypatch):
    from specfit.selection.acceptance_model import FILENAME

    monkeypatch.setenv("SPECFIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    assert acceptance_cache.tables_path(folder) is None
    (folder / FILENAME).write_text("{}")
    assert acceptance_cache.tables_path(folder) == folder / FILENAME  # the shipped default
    user = acceptance_cache.user_tables_path(folder)
    assert user.is_relative_to(tmp_path / "cache")
    user.parent.mkdir(parents=True)
    user.write_text("{}")
    assert acceptance_cache.tables_path(folder) == user  # found first
    (folder / "model.safetensors").write_bytes(b"retrained")  # another drafter: not its tables
    assert acceptance_cache.tables_path(folder) == folder / FILENAME


def test_the_key_names_the_content_not_the_place(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "config.json").write_text('{"hidden_size": 64}')
        (folder / "model.safetensors").write_bytes(b"x" * 5000)
    assert acceptance_cache.drafter_key(a) == acceptance_cache.drafter_key(b)
    (b / "config.json").write_text('{"hidden_size": 32}')
    assert acceptance_cache.drafter_key(a) != acceptance_cache.drafter_key(b)
