"""The embedded default: a small Qwen3-MoE trained from scratch by SpecFit's own code (``specfit train-target``) and
its EAGLE-3 drafter (``specfit train-drafter``), shipped with the package so the demo, the benchmark and the
regression run on a fresh machine. See the model cards in ``target/README.md`` and ``drafter/README.md``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_DIR = HERE / "target"
DRAFTER_DIR = HERE / "drafter"
MODEL_ID = "specfit/embedded-qwen3-moe"  # the model id cost profiles are filed under

# CPU threads that decode this model fastest: its matrices are so small that more threads only add synchronisation
# (benchmarks/threads.py measures 1, 2 and the default; a notebook on a many-core machine ran up to 7x slower with
# torch's default). `load` advises it once; the CLI commands set it themselves. A library call never changes it.
FASTEST_THREADS = 1


class ThreadsNotice(UserWarning):
    """torch's CPU thread count would slow the embedded model down (issued once per process)."""


_threads_noticed = False


def available() -> bool:
    return (TARGET_DIR / "config.json").is_file() and (DRAFTER_DIR / "config.json").is_file()


def load(cache_slots: int, *, drafter: bool = True, dtype=None, **enable_kwargs):
    """The embedded target with offloaded experts (and its drafter), fp32 on the CPU; returns (model, tokenizer).

    ``cache_slots``: expert slots per layer (of 64); ``enable_kwargs`` go to ``specfit.enable`` (e.g.
    ``link=0.28e-3`` for an emulated host link, ``cache_mode``, decoding options). The model is fastest with one
    CPU thread: call ``torch.set_num_threads(1)`` first (a ``ThreadsNotice`` says so once when torch uses more).
    """
    import torch
    from transformers import AutoTokenizer

    from ..patch import from_pretrained

    if not available():
        raise FileNotFoundError(f"the embedded model is missing from {HERE}; reinstall specfit, or train it with "
                                f"`specfit train-target` and `specfit train-drafter`")
    advise_threads(torch.get_num_threads())
    model = from_pretrained(TARGET_DIR, cache_slots=cache_slots, dtype=dtype or torch.float32, device="cpu",
                            drafter=str(DRAFTER_DIR) if drafter else None, **enable_kwargs)
    model.config._name_or_path = MODEL_ID
    return model, AutoTokenizer.from_pretrained(TARGET_DIR)


def advise_threads(threads: int) -> None:
    """Warn once per process (``ThreadsNotice``) when ``threads`` CPU threads would slow the embedded model."""
    global _threads_noticed
    if threads <= FASTEST_THREADS or _threads_noticed:
        return
    _threads_noticed = True
    warnings.warn(f"torch uses {threads} CPU threads in this process; the embedded model is so small that "
                  f"{FASTEST_THREADS} is fastest (more threads only add synchronisation: with a many-core default "
                  f"decoding ran up to 7x slower). Call torch.set_num_threads({FASTEST_THREADS}) before generating; "
                  f"SpecFit leaves this process-wide setting to you (`specfit demo` and `specfit bench` set it "
                  f"themselves).", ThreadsNotice, stacklevel=3)
