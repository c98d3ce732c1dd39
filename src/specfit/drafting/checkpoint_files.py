"""Finding and reading a drafter checkpoint's files: the folder, its weights (one file, a sharded safetensors index
or ``pytorch_model.bin``) and its ``config.json``; a hub repo id is downloaded when it is not a local path.

What the keys and config fields mean is ``formats``' business; this module only turns paths into a folder, a dict of
JSON and a dict of tensors, and names the file (and what to do) when one cannot be read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"


def locate(path_or_dir) -> tuple[Path, Path]:
    """-> (folder with config.json, weights file); a missing local path shaped like ``owner/name`` is a hub repo."""
    path = Path(path_or_dir)
    if not path.exists():
        path = _download(str(path_or_dir))
    folder = path if path.is_dir() else path.parent
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {folder}")
    if path.is_file() and path.name != CONFIG_NAME:
        return folder, path
    for name in (SAFETENSORS_NAME, SAFETENSORS_INDEX_NAME, BIN_NAME):
        if (folder / name).is_file():
            return folder, folder / name
    raise FileNotFoundError(f"no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {BIN_NAME} in {folder}")


def _download(text: str) -> Path:
    """A hub repo id -> its local snapshot; FileNotFoundError naming the path when there is neither."""
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"no drafter checkpoint at {text}: no such file or folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except HFValidationError:
        raise FileNotFoundError(
            f"no drafter checkpoint at {text}: no such folder (and not a valid hub repo id)"
        ) from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"no drafter checkpoint at {text}: no such folder, and no hub access to download the repo {text!r} "
            "(offline or unreachable, and not in the local hub cache); check the path, or download the repo first"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"no drafter checkpoint at {text}: no such folder, and no hub repo {text!r} (missing, private or gated)"
        ) from None


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is corrupt: fetch the checkpoint again") from e


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors or PyTorch weights file -> tensors; ValueError naming the file when it cannot be read."""
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        try:
            return load_file(str(path), device="cpu")
        except SafetensorError as e:
            raise ValueError(
                f"{path}: not a readable safetensors file ({e}); it is truncated or corrupt (an interrupted download "
                "or a git-lfs pointer?): fetch it again"
            ) from e
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else "empty file"
        raise ValueError(
            f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {first}); it is truncated or corrupt: "
            "fetch it again"
        ) from e


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A weights file, or every shard a safetensors index names -> one dict of tensors (on the CPU)."""
    if path.name.endswith(".index.json"):
        index = read_json(path)
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path}: no 'weight_map' object (a safetensors index maps tensor names to shard files)")
        state = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(_read_file(path.parent / shard))
        return state
    return _read_file(path)
