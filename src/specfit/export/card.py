"""The model card (``README.md``) of an exported folder, as the Hub lists ``custom_generate`` repos: the tag
``custom_generate`` in its metadata and a "Base model" section (transformers' convention for such repos), then how
to load it, with and without SpecFit, and the settings it carries."""

from __future__ import annotations

import json
from pathlib import Path

from .settings import SETTINGS_FILE


def card(settings: dict, model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    base = settings["base_model"]
    meta = ["---", "library_name: transformers"] + ([f"base_model: {base}"] if base else []) + \
        ["tags:", "- custom_generate", "- specfit", "---", ""]
    name = "SpecFit's embedded Qwen3-MoE, trained from scratch by SpecFit's own code" if settings["embedded"] else \
        f"[{base}](https://huggingface.co/{base})" if base else f"the checkpoint `{settings['source']}`"
    assistant = settings["assistant"]
    decoding = "plain decoding" if assistant == "none" else f"the {assistant!r} assistant and the drafter in drafter/"
    shown = json.dumps({k: settings[k] for k in ("cache_slots", "cache_mode", "cache_policy", "cold", "link_ms",
                                                   "assistant", "decoding")})
    return "\n".join(meta + [
        f"# {architecture} with SpecFit decoding",
        "",
        f"This folder was written by `specfit export`. Loaded with `trust_remote_code=True`, its `generate()` is "
        f"SpecFit's: the routed experts move to host memory with {settings['cache_slots']} expert slots per MoE "
        f"layer on the model's device, and decoding uses {decoding}. Greedy output equals plain `generate()`'s, "
        f"token for token in float32.",
        "",
        "## Base model",
        "",
        f"{name} ({architecture}), unchanged: the weights here are its own.",
        "",
        "## Usage",
        "",
        "Needs `pip install specfit` (named in `custom_generate/requirements.txt`).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "model = AutoModelForCausalLM.from_pretrained(REPO, trust_remote_code=True)",
        "tokenizer = AutoTokenizer.from_pretrained(REPO)",
        'ids = tokenizer("Question: What is 7 times 8?\\nAnswer:", return_tensors="pt").input_ids',
        "out = model.generate(ids, max_new_tokens=32)  # SpecFit is enabled at this first call",
        "print(model.specfit.stats)",
        "```",
        "",
        "Without `trust_remote_code=True` the model is the plain one. `transformers serve REPO --trust-remote-code` "
        "serves it with SpecFit (not with `--continuous-batching`, which bypasses `generate()`).",
        "",
        "## SpecFit settings",
        "",
        f"In `{SETTINGS_FILE}`: `{shown}`. A call's own `assistant=` wins (`assistant=None`: plain decoding).",
        "",
    ])
