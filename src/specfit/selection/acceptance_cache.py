"""Where a drafter's acceptance tables are read from and written to: the user cache first, the drafter's folder as
the read-only default.

``specfit calibrate --acceptance-only`` writes its tables to ``profile_files.cache_root() / "acceptance" /
<drafter key>.json`` (beside the cost profiles), never into the drafter's folder: that folder may be inside the
installed package (the embedded drafter) or a download cache. ``enable(..., drafter=FOLDER)`` reads the user-cache
tables for that drafter first, else the folder's own ``acceptance.json``. The key names the drafter's content, not
its path: its ``config.json`` and, per weights file, its size and first and last MiB (a retrained drafter differs
there; a drafter copied or reinstalled elsewhere keeps its tables).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .acceptance_model import FILENAME
from .profile_files import cache_root

_EDGE = 1 << 20  # bytes read from each end of a weights file


def drafter_key(folder) -> str:
    """16 hex digits naming a drafter folder's content (see the module docstring)."""
    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = weights.stat().st_size
        h.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            h.update(f.read(_EDGE))
            f.seek(max(size - _EDGE, 0))
            h.update(f.read(_EDGE))
    return h.hexdigest()[:16]


def user_tables_path(folder) -> Path:
    """Where calibrate writes (and enable first reads) the tables of the drafter in ``folder``."""
    return cache_root() / "acceptance" / f"{drafter_key(folder)}.json"


def tables_path(folder) -> Path | None:
    """The tables enable loads for the drafter in ``folder``: the user cache's, else the folder's own, else None."""
    for path in (user_tables_path(folder), Path(folder) / FILENAME):
        if path.is_file():
            return path
    return None
