"""Training code for the embedded default: the target and its drafter, each as a command (``target.py``,
``drafter.py``), its training loop (``target_loop.py``, ``drafter_loop.py``) and the saved folder's measures and
model card (``target_report.py``, ``drafter_report.py``); and the route predictor (``router.py``)."""

from pathlib import Path


def default_work_dir(command: str) -> Path:
    """Checkpoints and caches of a training command: in the user cache, never inside the package."""
    from ..selection.profile_files import cache_root

    return cache_root() / "work" / command


def load_checkpoint(path: Path, config: dict, extensions: dict | None = None) -> dict:
    """A training checkpoint written with the same ``config``; another config is refused, since the schedule and
    the batches depend on every field. ``extensions``: fields (name -> default) that only shape steps after the
    checkpoint's: a checkpoint written without them, or with other values, may continue under these ones."""
    import torch

    saved = torch.load(path, weights_only=False)
    extensions = extensions or {}
    fixed = {k: v for k, v in config.items() if k not in extensions}
    written = {k: v for k, v in saved["config"].items() if k not in extensions}
    if written != fixed:
        raise ValueError(f"{path} was written with {saved['config']}, not {config}")
    saved["config"] = config
    return saved
