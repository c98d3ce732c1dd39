"""Checks of command-line options, shared by the commands: each refusal names the flag as typed, the value given and
what would be right, in the flag's own units. Pure Python (no torch, no transformers), so every option of every
command is checked in a fraction of a second, before anything heavy is imported or loaded (``specfit.cli`` calls
each command's ``check_arguments`` between parsing and ``main``)."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
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


MOE_EXAMPLES = "Qwen3MoeForCausalLM, MixtralForCausalLM or GptOssForCausalLM"


def moe_config(config: dict, value: str, what: str) -> int:
    """The routed experts per layer of a checkpoint's config; a model without them is refused as the Python API
    refuses it (``specfit.seam.layers.moe_layers``: "... has no MoE layers"), before any weight loads."""
    experts = experts_per_layer(config)
    if experts is None:
        name = (config.get("architectures") or [config.get("model_type") or "the model"])[0]
        raise ValueError(f"{what} {value!r}: {name} has no MoE layers (its config.json names no routed experts: "
                         f"num_experts, num_local_experts or n_routed_experts); SpecFit offloads the experts of "
                         f"models such as {MOE_EXAMPLES}")
    return experts


def moe_folder(value: str, what: str) -> Path:
    """A checkpoint folder holding config.json whose model has MoE layers (``moe_config``)."""
    path = folder(value, what, must_hold="config.json")
    moe_config(json.loads((path / "config.json").read_text()), value, what)
    return path


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
