"""Training code for the embedded default: the target (``target.py``), its drafter (``drafter.py``) and the route
predictor (``router.py``)."""

from pathlib import Path


def default_work_dir(command: str) -> Path:
    """Checkpoints and caches of a training command: in the user cache, never inside the package."""
    from ..cost_model import cache_root

    return cache_root() / "work" / command
