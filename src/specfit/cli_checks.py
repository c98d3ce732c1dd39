"""Checks of command-line options, shared by the commands: each refusal names the flag as typed, the value given and
what would be right, in the flag's own units. Pure Python (no torch, no transformers), so every option of every
command is checked in a fraction of a second, before anything heavy is imported or loaded (``specfit.cli`` calls
each command's ``check_arguments`` between parsing and ``main``)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from .selection.profile_files import TOKENIZER_FILES

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # owner/name (or a legacy bare name), as the hub spells ids


def flag(name: str) -> str:
    """The flag of an argparse destination: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + name.replace("_", "-")


def at_least(args, low: int | float, *names: str, why: str | None = None) -> None:
    """Each option in ``names`` (argparse destinations; None: not given) is at least ``low`` (``why``: the reason,
    said in the refusal)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"{flag(name)} must be >= {low}{f' ({why})' if why else ''}, got {value}")


def milliseconds(args, name: str) -> None:
    """An emulated link's milliseconds per expert copy: a finite number >= 0 (0: a free link), or not given."""
    value = getattr(args, name)
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag(name)} must be a finite number of milliseconds per expert copy, >= 0 (0: a free "
                         f"link), got {value}")


def fraction(args, name: str) -> None:
    value = getattr(args, name)
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{flag(name)} is a share, from 0 to 1, got {value}")


def folder(value: str, what: str, *, must_hold: str | None = None) -> Path:
    """An existing folder (holding ``must_hold``, when given); the refusal says which option named it."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"{what} {value!r} is not a folder" + (" (no such path)" if not path.exists() else ""))
    if must_hold and not (path / must_hold).is_file():
        raise ValueError(f"{what} {value!r} holds no {must_hold}: not a checkpoint folder")
    return path


def checkpoint_config(value: str, what: str = "--model") -> dict:
    """The ``config.json`` of a checkpoint folder or hub model id, read before any weight: a folder must hold it; a
    hub id (``owner/name``) is asked of the hub through ``huggingface_hub`` (its cache, or the network unless
    ``HF_HUB_OFFLINE``); anything else is refused, naming the value."""
    path = Path(value).expanduser()
    if path.exists():
        return json.loads((folder(value, what, must_hold="config.json") / "config.json").read_text())
    if not HUB_ID.match(value):
        raise ValueError(f"{what} {value!r} is neither a local checkpoint folder (no such path) nor a hub model id "
                         f"(owner/name, e.g. Qwen/Qwen3-30B-A3B)")
    try:
        from huggingface_hub import HfApi, constants, hf_hub_download

        if not constants.HF_HUB_OFFLINE:  # one request first, so an unreachable hub is said at once, not after retries
            HfApi().model_info(value, timeout=10)
        return json.loads(Path(hf_hub_download(value, "config.json")).read_text())
    except Exception as err:  # offline and not cached, unknown repo, no network: say what and what to do
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what} {value!r}: no local folder of that name, and the hub could not give its "
                         f"config.json ({type(err).__name__}: {first}); give a checkpoint folder, or a hub id the hub "
                         f"(or its cache, with HF_HUB_OFFLINE=1) has") from None


def experts_per_layer(config: dict) -> int | None:
    """Routed experts per MoE layer from a config dict (or its text config), None when it names none."""
    for text in (config, config.get("text_config") or {}):
        for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
            n = text.get(name)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return n
    return None


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def cuda_device(args, name: str = "device") -> None:
    """``--device cuda`` with a CPU build of torch is refused from the installed version, without importing torch
    (a CUDA build without a GPU is found when the model loads)."""
    from importlib.metadata import PackageNotFoundError, version

    if not str(getattr(args, name) or "").startswith("cuda"):
        return
    try:
        installed = version("torch")
    except PackageNotFoundError:
        return
    if installed.endswith("+cpu"):
        raise ValueError(f"{flag(name)} {getattr(args, name)}: the installed torch {installed} is a CPU build; use "
                         f"{flag(name)} cpu, or install a CUDA build of torch")
