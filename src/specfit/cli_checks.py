"""Checks of command-line options, shared by the commands: each refusal names the flag as typed, the value given and
what would be right, in the flag's own units. Pure Python (no torch, no transformers), so every option of every
command is checked in a fraction of a second, before anything heavy is imported or loaded (``specfit.cli`` calls
each command's ``check_arguments`` between parsing and ``main``)."""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

from .offload.config_file import (  # noqa: F401  (experts_per_layer, read_config: the commands' checks use them)
    EXPERT_FIELDS, MOE_EXAMPLES, architecture, experts_per_layer, read_config, zero_experts)
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


def checkpoint_config(value: str, what: str = "--model", *, moe: bool = True) -> dict:
    """The ``config.json`` of a checkpoint folder or hub model id, read before any weight: a folder must hold it (as
    JSON: ``read_config``); a hub id (``owner/name``) is asked of the hub through ``huggingface_hub`` (its cache, or
    the network unless ``HF_HUB_OFFLINE``); anything else is refused, naming the value. ``moe``: a model without
    routed experts is refused here too (``moe_config``), as every command that takes a model offloads its experts."""
    path = Path(value).expanduser()
    if path.exists():
        config = read_config(folder(value, what, must_hold="config.json") / "config.json", what, value)
    else:
        config = _hub_file(value, what, "config.json", "a local checkpoint folder (no such path) nor a hub model id "
                                                       "(owner/name, e.g. Qwen/Qwen3-30B-A3B)")
    if moe:
        moe_config(config, value, what)
    return config


def _hub_file(value: str, what: str, name: str, neither: str) -> dict:
    """The JSON file ``name`` of the hub repo ``value`` (its cache, or the network unless ``HF_HUB_OFFLINE``), asked
    before anything else is downloaded; ``neither`` says what ``value`` is not, when it is not even a hub id."""
    if not HUB_ID.match(value):
        raise ValueError(f"{what} {value!r} is neither {neither}")
    try:
        from huggingface_hub import HfApi, constants, hf_hub_download

        if not constants.HF_HUB_OFFLINE:  # one request first, so an unreachable hub is said at once, not after retries
            HfApi().model_info(value, timeout=10)
        downloaded = Path(hf_hub_download(value, name))
    except Exception as err:  # offline and not cached, unknown repo, no network: say what and what to do
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what} {value!r}: no local folder of that name, and the hub could not give its "
                         f"{name} ({type(err).__name__}: {first}); give a checkpoint folder, or a hub id the hub "
                         f"(or its cache, with HF_HUB_OFFLINE=1) has") from None
    return read_config(downloaded, what, value)


DRAFTER_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def drafter_source(value: str, what: str = "--drafter") -> None:
    """An EAGLE-3 drafter checkpoint, found before the target loads: a local folder holding ``config.json`` and its
    weights (one of ``DRAFTER_WEIGHTS``), or a hub id whose ``config.json`` the hub (or its cache) gives. What
    ``drafting/checkpoint_files.locate`` would later fail on is refused now, naming the value."""
    path = Path(value).expanduser()
    if path.exists():
        found = folder(value, what, must_hold="config.json")
        if not any((found / name).is_file() for name in DRAFTER_WEIGHTS):
            raise ValueError(f"{what} {value!r} holds no drafter weights ({', '.join(DRAFTER_WEIGHTS)})")
        return
    _hub_file(value, what, "config.json", "a local EAGLE-3 checkpoint folder (no such path) nor a hub id "
                                          "(owner/name)")


def writable(value: str, what: str, *, kind: str = "folder") -> Path:
    """An output path, checked before any work: ``kind`` 'folder' (made when missing) or 'file' (its folder made when
    missing). The nearest folder that exists on the way is tried with a scratch file, written and removed at once,
    so a path nothing can be written to (read-only, /proc, a file in the way) is refused now, not after the job."""
    path = Path(value).expanduser()
    if path.is_dir() and kind == "file":
        raise ValueError(f"{what} {value!r} is a folder; it names the file to write")
    if path.exists() and not path.is_dir() and kind == "folder":
        raise ValueError(f"{what} {value!r} is a file; it names a folder to write into")
    if path.is_file() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {value!r} exists and cannot be overwritten (no write permission)")
    probe = path.absolute() if path.is_dir() else path.absolute().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{what} {value!r} cannot be written: {str(probe)!r} on the way is a file, not a folder")
    try:
        fd, scratch = tempfile.mkstemp(dir=probe, prefix=".specfit-write-check-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as err:
        raise ValueError(f"{what} {value!r} cannot be written: a file in {str(probe)!r} cannot be created "
                         f"({err.strerror or type(err).__name__}); give a path in a folder you can write") from None
    return path


def moe_config(config: dict, value: str, what: str) -> int:
    """The routed experts per layer of a checkpoint's config; a model without them (none named, or 0) is refused as
    the Python API refuses it (``specfit.seam.layers.moe_layers``: "... has no MoE layers"), before any weight
    loads."""
    experts = experts_per_layer(config)
    if experts is None:
        zero = zero_experts(config)
        said = (f"its config.json names {zero}, no routed expert" if zero else
                f"its config.json names no routed experts: {', '.join(EXPERT_FIELDS[:3])}")
        raise ValueError(f"{what} {value!r}: {architecture(config)} has no MoE layers ({said}); SpecFit offloads the "
                         f"experts of models such as {MOE_EXAMPLES}")
    return experts


def moe_folder(value: str, what: str) -> Path:
    """A checkpoint folder holding config.json whose model has MoE layers (``moe_config``)."""
    path = folder(value, what, must_hold="config.json")
    moe_config(read_config(path / "config.json", what, value), value, what)
    return path


def output(args, name: str, kind: str = "folder", what: str | None = None, none: tuple = ("none",)) -> None:
    """An output option (an argparse destination; ``what``: how the refusal names it, default its flag; a positional
    ``OUT`` says so), checked writable before any work (``writable``) unless it is not given or one of ``none``
    (e.g. ``--plot none``): a command with an output path calls this in ``check_arguments``."""
    value = getattr(args, name)
    if value is not None and value not in none:
        writable(value, what or flag(name), kind=kind)


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


def empty_output(value: str, what: str) -> Path:
    """An output folder that does not exist yet or is empty, and can be written (``writable``): a command that writes
    a whole folder never overwrites or mixes into one that holds files."""
    path = Path(value).expanduser()
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            shown = ", ".join(repr(e) for e in entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3
                                                                else "")
            raise ValueError(f"{what} {value!r} exists and is not empty (it holds {shown}); give a new folder or an "
                             f"empty one: nothing in it is overwritten")
    return writable(value, what)
