"""The cycle-time model: ``time(n, demand) = intercepts[n] + beta * demand``.

``n`` is the number of draft nodes a cycle verifies (the root token not counted) and ``demand`` the expert demand,
``sum over layers of |union of the experts the verified tokens route to|``. ``intercepts[n]`` holds everything that
does not scale with experts (attention, dense layers, launch overhead); ``beta`` is the time per expert of demand
(mostly host-to-device copies of the experts the slot cache misses). Both are fitted once per device, model, slot
count and cache mode by non-negative least squares on calibration probes, and frozen in a JSON *profile*.

No torch here; the probes that produce the records are defined in ``specfit.evaluation.calibrate``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from ..offload.config import CACHE_MODES

__all__ = ["CostModel", "Record", "ProfileError", "profile_dir", "profile_path", "FORMAT", "VERSION"]

FORMAT = "specfit-cost-model"
VERSION = 1
_RESERVED = ("format", "version", "units", "intercepts", "beta")


class ProfileError(ValueError):
    """A profile file is unreadable, malformed, or was made for another device, model, slot count or cache mode."""


class Record(NamedTuple):
    """One timed calibration cycle: ``n_nodes`` draft nodes verified, ``demand`` experts asked for, ``seconds``."""

    n_nodes: int
    demand: float
    seconds: float


@dataclass(frozen=True)
class CostModel:
    """Predicted cycle time ``intercepts[n_nodes] + beta * demand``, in seconds.

    Attributes:
        intercepts: fixed time of a cycle verifying ``n`` draft nodes, for ``n = 0 .. len(intercepts) - 1``.
        beta: seconds per expert of demand.
        meta: provenance, stored next to the numbers in the profile (device, model_id, slots, cache_mode, fit
            quality, date, ...); JSON-serialisable values.

    >>> m = CostModel(intercepts=(0.10, 0.11, 0.12), beta=0.2e-3)
    >>> round(m.predict(2, demand=500), 6)      # 0.12 + 500 * 0.0002
    0.22
    """

    intercepts: tuple[float, ...]
    beta: float
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        intercepts = tuple(_number(a, f"intercepts[{i}]") for i, a in enumerate(self.intercepts))
        if not intercepts:
            raise ValueError("field 'intercepts' must hold at least one value (n = 0)")
        object.__setattr__(self, "intercepts", intercepts)
        object.__setattr__(self, "beta", _number(self.beta, "beta"))
        if not isinstance(self.meta, dict):
            raise ValueError(f"field 'meta' must be a dict, got {type(self.meta).__name__}")
        clash = [k for k in self.meta if k in _RESERVED]
        if clash:
            raise ValueError(f"meta may not use the reserved profile field(s) {clash}")

    @property
    def max_nodes(self) -> int:
        """The largest node count this model predicts for."""
        return len(self.intercepts) - 1

    def predict(self, n_nodes: int, demand: float) -> float:
        """Predicted seconds for a cycle verifying ``n_nodes`` draft nodes with ``demand`` experts of demand."""
        if not 0 <= n_nodes <= self.max_nodes:
            raise ValueError(f"n_nodes={n_nodes} is outside the fitted range 0..{self.max_nodes}")
        return self.intercepts[n_nodes] + self.beta * demand

    @classmethod
    def fit(cls, records: Iterable, max_nodes: int | None = None, **meta) -> "CostModel":
        """Fit intercepts and beta to timed cycles by non-negative least squares (``scipy.optimize.nnls``).

        Args:
            records: ``(n_nodes, demand, seconds)`` tuples or ``Record``s.
            max_nodes: the last intercept to return; defaults to the largest ``n_nodes`` seen.
            **meta: provenance stored in ``meta`` (device, model_id, slots, cache_mode, ...). It may override the
                fit-quality keys the fit writes (``r2``, ``rms_residual_s``, ``max_abs_residual_s``, ``n_records``,
                ``observed_nodes``, ``date``), e.g. a fixed ``date`` for a reproducible file.

        The features are a one-hot of the node count and the demand. A node count with no record has no data for
        its intercept: it is filled by linear interpolation between the nearest observed counts, or beyond the
        observed range by extending the line through the two nearest observed counts (clamped at 0; flat if only
        one count was observed). ``meta["observed_nodes"]`` lists the counts that were measured.

        >>> recs = [(n, d, 0.1 + 0.01 * n + 2e-4 * d) for n in range(3) for d in (100, 300, 600)]
        >>> m = CostModel.fit(recs, date="2025-01-01")
        >>> [round(a, 6) for a in m.intercepts], round(m.beta, 9), m.meta["n_records"]
        ([0.1, 0.11, 0.12], 0.0002, 9)
        """
        from scipy.optimize import nnls

        rows = np.array([tuple(Record(*r)) for r in records], dtype=float).reshape(-1, 3)
        n_nodes, demand, seconds = rows.T
        if not np.all(np.isfinite(rows)) or np.any(rows < 0) or np.any(n_nodes != np.round(n_nodes)):
            raise ValueError("records must be (n_nodes >= 0 integer, demand >= 0, seconds >= 0), all finite")
        observed = sorted({int(n) for n in n_nodes})
        if len(rows) < len(observed) + 2:
            raise ValueError(
                f"{len(rows)} records are too few to fit {len(observed)} intercepts and beta; "
                f"give at least {len(observed) + 2}"
            )
        if all(np.ptp(demand[n_nodes == n]) == 0 for n in observed):
            raise ValueError("demand never varies at a fixed node count, so beta cannot be told from the intercepts")
        top = observed[-1] if max_nodes is None else int(max_nodes)
        if top < observed[-1]:
            raise ValueError(f"max_nodes={top} is below the largest node count in the records ({observed[-1]})")

        features = np.zeros((len(rows), len(observed) + 1))
        features[np.arange(len(rows)), np.searchsorted(observed, n_nodes)] = 1.0
        features[:, -1] = demand
        scale = np.linalg.norm(features, axis=0)  # demand is ~1e3 times the one-hot columns; equalise for NNLS
        coef, _ = nnls(features / scale, seconds)
        coef = coef / scale
        residual = seconds - features @ coef
        spread = float(np.sum((seconds - seconds.mean()) ** 2))

        quality = {
            "r2": 1.0 - float(residual @ residual) / spread if spread > 0 else None,
            "rms_residual_s": float(np.sqrt(np.mean(residual**2))),
            "max_abs_residual_s": float(np.max(np.abs(residual))),
            "n_records": len(rows),
            "observed_nodes": observed,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        intercepts = _fill(observed, coef[:-1].tolist(), top)
        return cls(tuple(intercepts), float(coef[-1]), {**quality, **meta})

    @classmethod
    def default(cls, max_nodes: int = 7) -> "CostModel":
        """A rough placeholder for when no profile exists; the caller warns loudly when it uses it.

        ``beta`` is the paper's A100 PCIe 40GB figure with the slot cache, 0.211 ms per expert. The intercepts are
        flat at 0.133 s, which is what the paper's own numbers imply for autoregressive decoding on that machine:
        1 / 4.67 tok/s - 384 experts (48 layers x top-8) * 0.211 ms = 0.214 - 0.081 = 0.133 s. Real intercepts grow
        with the node count and differ by device and model: calibrate (``specfit calibrate``).
        """
        return cls((0.133,) * (max_nodes + 1), 0.211e-3, {"source": "default"})

    def to_json(self) -> dict:
        """The profile as a JSON object: format tag, version, units, intercepts, beta, then the meta fields."""
        return {"format": FORMAT, "version": VERSION, "units": "seconds",
                "intercepts": list(self.intercepts), "beta": self.beta, **self.meta}

    def save(self, path) -> Path:
        """Write the profile to ``path`` (parent folders created; written to a temporary file, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path, expect: dict | None = None) -> "CostModel":
        """Read a profile; ``expect`` names meta fields that must match, e.g. ``{"slots": 48, "cache_mode": "cached"}``.

        Raises:
            ProfileError: naming the file and the field, for unreadable JSON, a missing or malformed field, or a
                mismatch with ``expect``.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ProfileError(f"{path}: cannot read profile ({e})") from e
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: a profile is a JSON object, got {type(data).__name__}")
        for key in _RESERVED:
            if key not in data:
                raise ProfileError(f"{path}: missing field {key!r}")
        for key, want in (("format", FORMAT), ("version", VERSION), ("units", "seconds")):
            if data[key] != want or type(data[key]) is not type(want):
                raise ProfileError(f"{path}: field {key!r} is {data[key]!r}, expected {want!r}")
        intercepts = data["intercepts"]
        if not isinstance(intercepts, list) or not intercepts:
            raise ProfileError(f"{path}: field 'intercepts' must be a non-empty list of numbers, got {intercepts!r}")
        try:
            values = [_number(a, f"intercepts[{i}]") for i, a in enumerate(intercepts)]
            beta = _number(data["beta"], "beta")
        except ValueError as e:
            raise ProfileError(f"{path}: {e}") from None
        meta = {k: v for k, v in data.items() if k not in _RESERVED}
        for key, want in (expect or {}).items():
            if key not in meta:
                raise ProfileError(f"{path}: field {key!r} is missing, expected {want!r}")
            if meta[key] != want:
                raise ProfileError(f"{path}: field {key!r} is {meta[key]!r}, expected {want!r}")
        return cls(tuple(values), beta, meta)


def cache_root() -> Path:
    """SpecFit's user cache: ``$SPECFIT_CACHE``, else ``$XDG_CACHE_HOME/specfit``, else ``~/.cache/specfit``."""
    if os.environ.get("SPECFIT_CACHE"):
        return Path(os.environ["SPECFIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specfit"


def profile_dir() -> Path:
    """Where profiles live: ``cache_root() / "profiles"``."""
    return cache_root() / "profiles"


def profile_path(device_name: str, model_id: str, slots: int, cache_mode: str) -> Path:
    """The profile file for one device + model + slot count + cache mode.

    >>> profile_path("NVIDIA A100-PCIE-40GB", "Qwen/Qwen3-30B-A3B", 48, "cached").name
    'NVIDIA-A100-PCIE-40GB__Qwen--Qwen3-30B-A3B__slots48__cached.json'
    """
    if cache_mode not in CACHE_MODES:
        raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {cache_mode!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ValueError(f"slots must be an int >= 0, got {slots!r}")
    name = f"{_safe(device_name)}__{_safe(model_id.replace('/', '--'))}__slots{slots}__{cache_mode}.json"
    return profile_dir() / name


def _safe(text: str) -> str:
    # Keep file names portable: letters, digits, '.', '_', '-' only; runs of anything else become one '-'.
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")
    return cleaned or "unknown"


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"field {name!r} must be a non-negative number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"field {name!r} must be a non-negative number, got {value!r}")
    return value


def _fill(observed: list[int], values: list[float], top: int) -> list[float]:
    """Intercepts for n = 0..top from the observed counts: interpolate inside, extend the end lines outside."""
    xs, ys = np.array(observed, float), np.array(values, float)
    grid = np.arange(top + 1, dtype=float)
    out = np.interp(grid, xs, ys)
    if len(xs) >= 2:
        lo, hi = grid < xs[0], grid > xs[-1]
        out[lo] = ys[0] + (grid[lo] - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
        out[hi] = ys[-1] + (grid[hi] - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return np.maximum(out, 0.0).tolist()
