"""Where the embedded model's files are, inside the installed package (read-only at run time)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_DIR = HERE / "target"
DRAFTER_DIR = HERE / "drafter"
