"""The embedded default: a small Qwen3-MoE trained from scratch by SpecFit's own code (``specfit train-target``) and
its EAGLE-3 drafter (``specfit train-drafter``), shipped with the package so the demo, the benchmark and the
regression run on a fresh machine. See the model cards in ``target/README.md`` and ``drafter/README.md``.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_DIR = HERE / "target"
DRAFTER_DIR = HERE / "drafter"
MODEL_ID = "specfit/embedded-qwen3-moe"  # the model id cost profiles are filed under


def available() -> bool:
    return (TARGET_DIR / "config.json").is_file() and (DRAFTER_DIR / "config.json").is_file()


def load(cache_slots: int, *, drafter: bool = True, dtype=None, **enable_kwargs):
    """The embedded target with offloaded experts (and its drafter), fp32 on the CPU; returns (model, tokenizer)."""
    import torch
    from transformers import AutoTokenizer

    from ..patch import from_pretrained

    if not available():
        raise FileNotFoundError(f"the embedded model is missing from {HERE}; reinstall specfit, or train it with "
                                f"`specfit train-target` and `specfit train-drafter`")
    model = from_pretrained(TARGET_DIR, cache_slots=cache_slots, dtype=dtype or torch.float32, device="cpu",
                            drafter=str(DRAFTER_DIR) if drafter else None, **enable_kwargs)
    model.config._name_or_path = MODEL_ID
    return model, AutoTokenizer.from_pretrained(TARGET_DIR)
