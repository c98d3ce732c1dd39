"""The notebook path: ``examples/quickstart.ipynb`` is stored without outputs and executes (nbclient), with and
without pandas and matplotlib, fast; the README's "Use" shows the way."""

import os
import re
import sys
from pathlib import Path

import pytest

from specfit import embedded

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
needs_embedded = pytest.mark.skipif(not embedded.available(), reason="the embedded model is not installed")


def test_the_notebook_is_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert any("parameters" in c.metadata.get("tags", []) for c in code)


def run_notebook(tmp_path, monkeypatch, *, block=()):
    """Execute the notebook with small sizes (a cell after its parameters); ``block``: modules made unimportable.
    The kernel is this interpreter's (ipykernel's spec starts ``python`` from PATH)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell("MAX_NEW_TOKENS = 8\nPROMPTS = PROMPTS[:1]"))
    if block:
        nb.cells.insert(0, nbformat.v4.new_code_cell(
            "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in block)))
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own inline backend
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def outputs(cell) -> str:
    parts = []
    for out in cell.outputs:
        parts.append(out.get("text", ""))
        for kind, value in out.get("data", {}).items():
            parts.append(f"[{kind}]" + (value if kind.startswith("text") else ""))
    return "\n".join(parts)


def cell_with(nb, text):
    return next(c for c in nb.cells if c.cell_type == "code" and text in c.source)


@needs_embedded
def test_the_notebook_runs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the notebook's plots need matplotlib (pip install -e \".[dev]\" has it)")
    nb = run_notebook(tmp_path, monkeypatch)
    assert "<table" in outputs(next(c for c in nb.cells if c.source.strip() == "model.specfit.stats"))
    assert re.search(r"eagle3 +Counters\(new_tokens=8, tok/s=", outputs(cell_with(nb, "for assistant in")))
    assert "[image/png]" in outputs(cell_with(nb, "trace.plot("))
    compared = outputs(cell_with(nb, "specfit.compare("))
    assert "[text/html]" in compared and "speedup" in compared and "[image/png]" in compared


@needs_embedded
def test_the_notebook_runs_without_pandas_and_matplotlib(tmp_path, monkeypatch):
    nb = run_notebook(tmp_path, monkeypatch, block=("pandas", "matplotlib", "matplotlib.pyplot"))
    assert 'pip install "specfit[plot]"' in outputs(cell_with(nb, "trace.plot("))
    compared = outputs(cell_with(nb, "specfit.compare("))
    assert "'method': 'ar'" in compared and "[image/png]" not in compared


def test_readme_use_shows_the_notebook_path():
    readme = (ROOT / "README.md").read_text()
    use = readme[readme.index("## Use"):readme.index("## Layout")]
    for needle in ("examples/quickstart.ipynb", "specfit.embedded.load", "specfit.compare(", "torch.set_num_threads(1)",
                   "model.specfit.stats", "start_trace()"):
        assert needle in use, needle
