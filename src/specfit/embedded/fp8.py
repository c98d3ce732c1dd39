"""``specfit make-fp8 OUT``: the embedded model's block-wise FP8 variant, made from the shipped bf16 weights.

The layout is the hub's (Qwen's ``-FP8`` releases): every linear projection (attention q/k/v/o and each expert's
gate/up/down) becomes e4m3 with a float32 ``weight_scale_inv`` per block, in ``config.json``'s
``quantization_config = {"quant_method": "fp8", "weight_block_size": [8, 16], ...}``; the router, the norms and the
(tied) embeddings stay bf16. The block is 8 x 16 rather than the real model's 128 x 128 because the embedded
model's projections are that small (moe_intermediate 16, hidden 80, 2 KV heads of 20): it is the largest block that
tiles all of them, as transformers requires. The folder loads with plain transformers (on a CPU it dequantizes) and
with ``specfit.from_pretrained`` (experts stay FP8 in the arenas).

It is not shipped in the package: it follows from the shipped weights by this deterministic command, in about a
second, and is built into the user cache on first use (``folder()``), never inside the installed package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

BLOCK = (8, 16)
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic",
                "fmt": "e4m3"}
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_fp8(out: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Write the FP8 variant of the checkpoint folder ``source`` (default: the embedded target) into ``out``."""
    from safetensors.torch import load_file, save_file

    from .paths import TARGET_DIR
    from ..offload.formats import quantize

    source, out = Path(source or TARGET_DIR), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in load_file(source / "model.safetensors").items():
        if key.endswith("proj.weight") and value.dim() == 2:
            q, scale = quantize(value, BLOCK)
            tensors[key], tensors[key[: -len("weight")] + "weight_scale_inv"] = q, scale
        else:
            tensors[key] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    (out / "README.md").write_text(
        f"FP8 variant of the SpecFit embedded target ({source.name}), made by `specfit make-fp8 {out}`: every "
        f"projection e4m3 with a float32 weight_scale_inv per {BLOCK[0]}x{BLOCK[1]} block (router, norms and "
        f"embeddings bf16).\n")
    return out


def folder() -> Path:
    """The FP8 variant in the user cache, built on first use (named by a digest of the shipped weights, so a new
    embedded model gets a new variant)."""
    from .paths import TARGET_DIR
    from ..selection.profile_files import cache_root

    digest = hashlib.sha256()
    with open(TARGET_DIR / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    path = cache_root() / "embedded" / f"target-fp8-{digest.hexdigest()[:12]}"
    if not (path / "model.safetensors").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".building-"))
        make_fp8(tmp)
        try:
            tmp.rename(path)  # atomic: a reader never sees a half-written folder
        except OSError:  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def add_arguments(p) -> None:
    p.add_argument("out", help="folder to write the FP8 checkpoint to")
    p.add_argument("--source", default=None, help="bf16 checkpoint folder (default: the embedded target)")


def check_arguments(args) -> None:
    """OUT must be a folder or not exist yet; ``--source`` a bf16 checkpoint folder (config.json, model.safetensors)."""
    from ..cli_checks import moe_folder, writable

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"OUT {args.out!r} is a file; it names the folder to write the FP8 checkpoint to")
    writable(args.out, "OUT")
    if args.source is not None:
        source = moe_folder(args.source, "--source")
        if not (source / "model.safetensors").is_file():
            raise ValueError(f"--source {args.source!r} holds no model.safetensors (one file of bf16 weights, as the "
                             f"embedded target's)")


def main(args) -> int:
    out = make_fp8(args.out, args.source)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of safetensors, block {BLOCK[0]}x{BLOCK[1]}); load it with "
          f"specfit.from_pretrained({str(out)!r}, cache_slots=12) or transformers' AutoModelForCausalLM")
    return 0
