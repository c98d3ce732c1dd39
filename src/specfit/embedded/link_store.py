"""The structural default link's measurement, kept per machine in the user cache beside the cost profiles
(``default-link.json``), so every run on one machine uses the same seconds per copy and tok/s of two runs compare.

The link is scaled to one token's compute (``embedded.default_link_seconds``), which a CPU's load moved by 3.5x in one
afternoon (0.156-0.54 ms per copy) when it was measured again at every start, timing whole forwards. Now each part of
a forward is timed at its fastest (``embedded.fastest_forward_seconds``), which a busy core does not move, and the
figure is measured once per machine, thread count and model weights, then again only by ``specfit calibrate`` (which
fits the profile under it, and replaces the kept figure with its own) or ``default_link_seconds(refresh=True)``.
Entries of other machines, thread counts or weights in the same file are kept as they are. Pure Python: JSON in,
JSON out.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

FILE_NAME = "default-link.json"


def path() -> Path:
    from ..selection.profile_files import cache_root

    return cache_root() / FILE_NAME


def key(threads: int, weights: Path) -> str:
    """One entry per machine (the name profiles are filed under on a CPU), thread count and weights file (its size:
    a retrained model computes at another speed)."""
    machine = platform.processor() or platform.machine()
    size = weights.stat().st_size if weights.is_file() else 0
    return f"{machine} | threads={threads} | weights={size}"


def read(entry: str) -> tuple[float, float] | None:
    """(seconds per copy, one token's compute seconds) stored for ``entry``, None when none is (or the file is not
    SpecFit's: it is measured again and rewritten)."""
    stored = read_entry(entry)
    try:
        return float(stored["seconds_per_copy"]), float(stored["token_compute_seconds"])
    except (KeyError, TypeError, ValueError):
        return None


def read_entry(entry: str) -> dict | None:
    """The record kept for ``entry`` (its figures and when they were measured), None when there is none."""
    try:
        stored = json.loads(path().read_text())[entry]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return stored if isinstance(stored, dict) else None


def write(entry: str, seconds_per_copy: float, compute: float) -> None:
    """Keep a measurement for the next runs; a cache that cannot be written is said once (this run keeps its value)."""
    file = path()
    try:
        stored = json.loads(file.read_text()) if file.is_file() else {}
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError):
        stored = {}
    stored[entry] = dict(seconds_per_copy=seconds_per_copy, token_compute_seconds=compute,
                         measured=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=file.parent, prefix=".default-link-", suffix=".tmp")  # one per writer
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(stored, indent=1) + "\n")
        os.replace(scratch, file)
    except OSError as err:
        warnings.warn(f"the default link's measurement could not be kept in {file} ({err.strerror or err}); the next "
                      f"run will measure it again and may differ (set SPECFIT_CACHE to a folder you can write)",
                      stacklevel=3)


def recheck_line(before: tuple[float, float] | None, after: tuple[float, float]) -> str:
    """What ``specfit calibrate`` says after measuring the default link again: the new figure, the kept one it
    replaces, and where it is kept.

    >>> print(recheck_line((2.5e-4, 0.034), (2.3e-4, 0.031)).split(" kept in ")[0])
    default link measured again: 0.230 ms per copy (one token's compute 31.00 ms; it was 0.250 ms, -8%),
    """
    was = "" if before is None else f"; it was {before[0] * 1e3:.3f} ms, {after[0] / before[0] - 1:+.0%}"
    return (f"default link measured again: {after[0] * 1e3:.3f} ms per copy (one token's compute "
            f"{after[1] * 1e3:.2f} ms{was}), kept in {path()} for this machine's next runs")
