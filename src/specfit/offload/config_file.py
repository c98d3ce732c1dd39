"""A checkpoint's ``config.json``, read before any weight: the file as JSON (refused by its path when it is not), and
how many routed experts per layer it names (none, or 0: a model without MoE layers). Pure Python, no torch: the
commands' option checks (``cli_checks``) and ``from_pretrained``'s checks before the load (``enable_checks``) share
it."""

from __future__ import annotations

import json
from pathlib import Path

EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # routed experts per layer
MOE_EXAMPLES = "Qwen3MoeForCausalLM, MixtralForCausalLM or GptOssForCausalLM"


def read_config(path: Path, what: str, value: str) -> dict:
    """The JSON object in ``path``, refused by its path when it is not one (``what`` and ``value``: the option or
    call that named the checkpoint, and how)."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"{what} {value!r}: {path} is not a readable JSON file ({detail}); fetch the checkpoint "
                         f"again, or mend that file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} {value!r}: {path} holds a JSON {type(config).__name__}, not the object of a model "
                         f"config")
    return config


def _counts(config: dict):
    """(field, value) of every integer expert count the config (or its text config) names."""
    for text in (config, config.get("text_config") or {}):
        for name in EXPERT_FIELDS:
            n = text.get(name)
            if isinstance(n, int) and not isinstance(n, bool):
                yield name, n


def experts_per_layer(config: dict) -> int | None:
    """Routed experts per MoE layer from a config dict (or its text config), None when it names none (or 0)."""
    return next((n for _, n in _counts(config) if n > 0), None)


def zero_experts(config: dict) -> str | None:
    """``"field: n"`` when the config names no routed expert in a field that counts them (0 or fewer), else None."""
    return next((f"{name}: {n}" for name, n in _counts(config) if n <= 0), None)


def architecture(config: dict) -> str:
    """The model's class as its config names it."""
    return (config.get("architectures") or [config.get("model_type") or "the model"])[0]
