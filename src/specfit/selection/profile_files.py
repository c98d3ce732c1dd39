"""Profile files: the JSON a calibration writes and ``CostModel.load`` reads, and where they live.

One file per device and model (``profile_path``) under the user cache (``cache_root``). A profile is a JSON object:
``format``, ``version``, ``units``, the model's numbers (``RESERVED``), then its meta fields (device, model id, fit
quality, date, ...). ``read_profile`` checks the file's frame and returns the model's fields; ``check_meta`` checks
the fit-quality record and what the caller expects. No import of the model (``specfit.selection.cost_model``).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "TOKENIZER_FILES", "VERSION", "VERDICTS", "RESERVED", "ProfileError", "read_profile", "check_meta", "cache_root",
           "profile_dir", "profile_path", "field_number", "first_non_finite"]

FORMAT = "specfit-cost-model"
# files that make a checkpoint folder carry its tokenizer: calibration decodes text prompts only with one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# 3: a coefficient per expert computed (beta) and per expert copied (copy_overhead + link_share x the link's time),
#    one profile per machine and model; 2: monotone intercepts, per-level drafting, a recorded fit quality, demand
#    only (one profile per slot count and link); versions 1 and 2 still load, as demand-only models
VERSION = 3
VERDICTS = ("good", "poor", "unassessed")  # meta["quality"]["verdict"]; "unassessed": a version-1 profile
# (version 3 since issue 36, optional: host_overhead_s and host_share, a host expert's coefficient, for a profile
# fitted on a host lane too)
RESERVED = ("format", "version", "units", "intercepts", "beta", "draft_level_seconds", "copy_overhead_s",
            "link_share", "host_overhead_s", "host_share")


class ProfileError(ValueError):
    """A profile file is unreadable, malformed, or was made for another device, model, slot count or cache mode."""


def read_profile(path) -> dict:
    """The model's fields in the profile at ``path`` (``CostModel(**fields)``), its file frame checked: readable
    JSON, a known ``version``, the fields that version requires, the ``format`` tag and ``units``, list-valued
    ``intercepts`` and ``draft_level_seconds``. A version-1 profile's meta gets ``quality`` "unassessed".

    Raises:
        ProfileError: naming the file and the field.
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
    version = data.get("version")
    if version not in (1, 2, VERSION) or type(version) is not int:
        raise ProfileError(f"{path}: field 'version' is {version!r}, expected 1, 2 or {VERSION} (a newer "
                           f"profile needs a newer specfit)" if "version" in data else
                           f"{path}: missing field 'version'")
    required = RESERVED[:5] if version == 1 else RESERVED[:6]  # a demand-only model has no copy fields
    for key in required:
        if key not in data:
            raise ProfileError(f"{path}: missing field {key!r}")
    for key, want in (("format", FORMAT), ("units", "seconds")):
        if data[key] != want or type(data[key]) is not type(want):
            raise ProfileError(f"{path}: field {key!r} is {data[key]!r}, expected {want!r}")
    if not isinstance(data["intercepts"], list) or not data["intercepts"]:
        raise ProfileError(f"{path}: field 'intercepts' must be a non-empty list of numbers, got "
                           f"{data['intercepts']!r}")
    if not isinstance(data.get("draft_level_seconds", []), list):
        raise ProfileError(f"{path}: field 'draft_level_seconds' must be a list of numbers (one per drafted "
                           f"level; empty when not measured), got {data['draft_level_seconds']!r}")
    meta = {k: v for k, v in data.items() if k not in RESERVED}
    if version == 1:
        meta["quality"] = _unassessed(data["intercepts"])
    return {"intercepts": tuple(data["intercepts"]), "beta": data["beta"], "meta": meta,
            "draft_level_seconds": tuple(data.get("draft_level_seconds", ())),
            "copy_overhead": data.get("copy_overhead_s"), "link_share": data.get("link_share"),
            "host_overhead": data.get("host_overhead_s"), "host_share": data.get("host_share")}


def check_meta(path, meta: dict, expect: dict | None = None) -> None:
    """Check a loaded profile's ``meta``: its ``quality`` record (when present) has a known verdict, and every field
    of ``expect`` is there with the expected value. Raises ``ProfileError`` naming the file and the field."""
    quality = meta.get("quality")
    if quality is not None and (not isinstance(quality, dict) or quality.get("verdict") not in VERDICTS):
        raise ProfileError(f"{path}: field 'quality' must be an object whose 'verdict' is one of {VERDICTS}, "
                           f"got {quality!r}")
    for key, want in (expect or {}).items():
        if key not in meta:
            raise ProfileError(f"{path}: field {key!r} is missing, expected {want!r}")
        if meta[key] != want:
            raise ProfileError(f"{path}: field {key!r} is {meta[key]!r}, expected {want!r}")


def _unassessed(intercepts) -> dict:
    """The quality record of a version-1 profile: not assessed by the calibration gate; says whether it falls."""
    reasons = ["a version-1 profile: made before `specfit calibrate` checked fits (no held-out error, no bootstrap "
               "intervals) and before intercepts were held non-decreasing"]
    values = [a for a in intercepts if isinstance(a, (int, float)) and not isinstance(a, bool)]
    falls = [(i, a, b) for i, (a, b) in enumerate(zip(values, values[1:])) if b < a]
    if falls:
        i, a, b = falls[0]
        reasons.append(f"its intercepts fall with n (a({i + 1}) = {b * 1e3:.2f} ms < a({i}) = {a * 1e3:.2f} ms), "
                       f"traded against beta on collinear probes")
    return {"verdict": "unassessed", "reasons": reasons}


def cache_root() -> Path:
    """SpecFit's user cache: ``$SPECFIT_CACHE``, else the platform's user cache folder (``platformdirs``): on Linux
    ``$XDG_CACHE_HOME/specfit`` or ``~/.cache/specfit``, on macOS ``~/Library/Caches/specfit``, on Windows
    ``%LOCALAPPDATA%\\specfit\\Cache``."""
    if os.environ.get("SPECFIT_CACHE"):
        return Path(os.environ["SPECFIT_CACHE"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("specfit", appauthor=False))


def profile_dir() -> Path:
    """Where profiles live: ``cache_root() / "profiles"``."""
    return cache_root() / "profiles"


def profile_path(device_name: str, model_key: str) -> Path:
    """The profile file for one device and model (``profiles.model_key``: its name and shape). Slot count, cache
    mode and link are not in the name: one profile prices them all.

    >>> profile_path("NVIDIA A100-PCIE-40GB", "Qwen/Qwen3-30B-A3B [48x128e top8 h2048 bfloat16]").name
    'NVIDIA-A100-PCIE-40GB__Qwen--Qwen3-30B-A3B-48x128e-top8-h2048-bfloat16.json'
    """
    if not isinstance(model_key, str) or not model_key:
        raise ValueError(f"model_key must be a non-empty string, got {model_key!r}")
    return profile_dir() / f"{_safe(device_name)}__{_safe(model_key.replace('/', '--'))}.json"


def _safe(text: str) -> str:
    # Keep file names portable: letters, digits, '.', '_', '-' only; runs of anything else become one '-'.
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.")
    return cleaned or "unknown"


def field_number(value, name: str) -> float:
    """``value`` as a float when it is a finite number >= 0, else a ValueError naming the field ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"field {name!r} must be a non-negative number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"field {name!r} must be a non-negative number, got {value!r}")
    return value


def first_non_finite(value, path: str = ""):
    """(dotted path, value) of the first NaN or infinity inside ``value`` (dicts, lists, numbers), else None."""
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        is_number = isinstance(value, (float, np.floating)) and not isinstance(value, bool)
        return (path, float(value)) if is_number and not math.isfinite(value) else None
    for where, item in items:
        found = first_non_finite(item, where)
        if found is not None:
            return found
    return None
