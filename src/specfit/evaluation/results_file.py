"""The benchmarks' results file: ``OUT/results.json``, its folder made, JSON with one-space indent and a final
newline, values JSON cannot hold written as text (a dtype, a path). One place, so every benchmark writes the same
way and says where."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out, result: dict, name: str = "results.json") -> Path:
    """Write ``result`` to ``out / name`` (``out`` made when missing); returns the file's path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path
