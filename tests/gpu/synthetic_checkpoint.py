"""Write a synthetic Qwen3-MoE checkpoint in the hub layout, with random weights, for offload benchmarks.

The layout is the one ``Qwen/Qwen3-30B-A3B`` ships: per-expert keys
``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight``, shards ``model-0000i-of-0000n.safetensors`` of about
``--shard-size`` bytes, ``model.safetensors.index.json``, the hub's ``config.json`` fields and
``generation_config.json``. Tensors are generated one at a time and streamed into the shard files (the safetensors
header is written first, from the known shapes), so the model is never materialised.

Weights are ``normal * 0.02`` (norm weights 1), seeded per tensor name, so layer ``L`` of a 12-layer checkpoint
equals layer ``L`` of the 48-layer one. The token embedding alone is ``normal * 1.0``. At 0.02 the attention output,
nearly the same context average at every position, would dominate the hidden state: every token would route to the
same experts and greedy decoding would repeat one token. With a unit embedding a token's own embedding dominates, so
routes change from token to token (close to uniform: random weights give real costs, meaningless text).

``--fp8-block N`` writes the block-wise FP8 layout of Qwen's ``-FP8`` releases instead (``Qwen/Qwen3-30B-A3B-FP8``:
N = 128): every 2-D projection (attention q/k/v/o, each expert's gate/up/down) as e4m3 with a float32
``weight_scale_inv`` per N x N block beside it, the router, norms, embedding and head in the checkpoint dtype, and
``quantization_config`` in ``config.json``; the same random weights, quantized.

    python tests/gpu/synthetic_checkpoint.py OUT --preset qwen3-30b-a3b --layers 12 --drafter-out OUT-drafter
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# name -> hub config.json fields (the Qwen3-MoE fields that matter; the rest are the hub's values)
PRESETS = {
    # the real Qwen3-30B-A3B: 48 x 128 experts, top-8; one expert 3 * 768 * 2048 bf16 = 9,437,184 bytes
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=40960,
                          bos_token_id=151643, eos_token_id=151645, draft_vocab_size=32000),
    # ~2.6 GB: the real routing (128 experts, top-8) at a CPU-friendly width; one expert 2.25 MiB
    "medium": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64, num_experts=128, num_experts_per_tok=8,
                   moe_intermediate_size=384, intermediate_size=3072, max_position_embeddings=4096,
                   bos_token_id=1, eos_token_id=2, draft_vocab_size=8000),
    # ~28 MB: the real routing at a width where an experts output's rounding reaches the residual stream, so another
    # accumulation order flips near-tied routes as at real shapes (the decode gate's tests)
    "small": dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32,
                  intermediate_size=512, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                  draft_vocab_size=256),
    # ~7 MB: the real routing at toy width, for tests and the fast offload benchmark
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32,
                 intermediate_size=128, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                 draft_vocab_size=256),
}
_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"), "float32": (torch.float32, "F32")}
_BLOCK = 1 << 24  # elements generated per randn call: bounds the fp32 scratch at 64 MiB per worker
STD, EMBED_STD = 0.02, 1.0
WEIGHTS = f"normal*{STD}, embedding normal*{EMBED_STD}, norms 1"  # recorded by the benchmarks that reuse a checkpoint


def hub_config(preset: str, layers: int | None = None, dtype: str = "bfloat16", fp8_block: int | None = None) -> dict:
    """The ``config.json`` dict of a preset, as the hub writes it (legacy ``rope_theta``, ``torch_dtype``; with
    ``fp8_block``, the ``quantization_config`` of a block-wise FP8 release)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = {k: v for k, v in PRESETS[preset].items() if k != "draft_vocab_size"}
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        p["num_hidden_layers"] = layers
    import transformers

    if fp8_block is not None:
        p["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [fp8_block, fp8_block],
                                    "activation_scheme": "dynamic", "fmt": "e4m3"}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "attention_dropout": 0.0, "decoder_sparse_step": 1, "hidden_act": "silu", "initializer_range": 0.02,
            "max_window_layers": p["num_hidden_layers"], "mlp_only_layers": [], "norm_topk_prob": True,
            "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": dtype, "transformers_version": transformers.__version__, "use_cache": True,
            "use_sliding_window": False, **p}


def generation_config(config: dict) -> dict:
    """The hub's ``generation_config.json`` for Qwen3 (sampling defaults; benchmarks pass ``do_sample=False``)."""
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    return {"bos_token_id": bos, "eos_token_id": [eos, bos], "pad_token_id": bos, "do_sample": True,
            "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every checkpoint key with its shape, in module order (hub key names, per-expert expert weights)."""
    H, V, E, I = config["hidden_size"], config["vocab_size"], config["num_experts"], config["moe_intermediate_size"]
    hd, nh, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, H))]
    for L in range(config["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out += [(p + "input_layernorm.weight", (H,)),
                (p + "self_attn.q_proj.weight", (nh * hd, H)),
                (p + "self_attn.k_proj.weight", (nkv * hd, H)),
                (p + "self_attn.v_proj.weight", (nkv * hd, H)),
                (p + "self_attn.o_proj.weight", (H, nh * hd)),
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,)),
                (p + "post_attention_layernorm.weight", (H,)),
                (p + "mlp.gate.weight", (E, H))]
        for e in range(E):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (I, H)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (I, H)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (H, I))]
    out.append(("model.norm.weight", (H,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (V, H)))
    return out


def parse_size(text: str | int) -> int:
    """``"4GB"`` -> 4e9, ``"500MiB"`` -> 500 * 2**20, ``"100KB"`` -> 1e5, ``1234`` -> 1234 (transformers' units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"size {text!r}: expected e.g. 4GB, 500MB, 100KB, 1GiB or a byte count")
    unit = (m[2] or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** (1 + "KMGT".index(unit[0]))
    return int(float(m[1]) * scale)


def stored_tensors(name: str, shape: tuple[int, ...], fp8_block: int | None) -> list[tuple[str, tuple, str | None]]:
    """The checkpoint keys one model tensor is stored as, with shapes and safetensors dtypes (None: the checkpoint's
    dtype): itself, or with ``fp8_block`` each 2-D projection as its e4m3 weight and float32 ``weight_scale_inv``.

    >>> stored_tensors("model.layers.0.mlp.experts.3.down_proj.weight", (2048, 768), 128)[1]
    ('model.layers.0.mlp.experts.3.down_proj.weight_scale_inv', (16, 6), 'F32')
    """
    if fp8_block is None or not name.endswith("proj.weight") or len(shape) != 2:
        return [(name, shape, None)]
    if shape[0] % fp8_block or shape[1] % fp8_block:
        raise ValueError(f"--fp8-block {fp8_block} does not tile {name} {list(shape)}")
    return [(name, shape, "F8_E4M3"),
            (name[: -len("weight")] + "weight_scale_inv", (shape[0] // fp8_block, shape[1] // fp8_block), "F32")]


_TAG_BYTES = {"F8_E4M3": 1, "F32": 4}


def plan_shards(shapes, itemsize: int, shard_bytes: int, fp8_block: int | None = None
                ) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy, in key order: a tensor starts a new shard when it would push the current one past ``shard_bytes``
    (as ``save_pretrained`` does); a tensor larger than a shard gets a shard of its own. A tensor's bytes are those it
    is stored as (``stored_tensors``)."""
    shards, current, size = [], [], 0
    for name, shape in shapes:
        nbytes = sum(_numel(s) * _TAG_BYTES.get(tag, itemsize) for _, s, tag in stored_tensors(name, shape, fp8_block))
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    if current:
        shards.append(current)
    return shards


def make_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Norm weights are ones, the token embedding ``normal * 1``, every other tensor ``normal * 0.02``; seeded by
    (seed, name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    std = EMBED_STD if name.endswith("embed_tokens.weight") else STD
    g = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    out = torch.empty(_numel(shape), dtype=dtype)
    for start in range(0, out.numel(), _BLOCK):
        block = torch.randn(min(_BLOCK, out.numel() - start), generator=g)
        out[start:start + block.numel()] = block.mul_(std)
    return out.view(shape)


def make_stored(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype, fp8_block: int | None):
    """The tensors ``stored_tensors`` names for one model tensor, in its order: ``make_tensor``'s, quantized
    block-wise where it is an FP8 projection."""
    t = make_tensor(name, shape, seed, dtype)
    if len(stored_tensors(name, shape, fp8_block)) == 1:
        return [t]
    from specfit.offload.formats import quantize

    return list(quantize(t, (fp8_block, fp8_block)))


def write_shard(path: Path, tensors, seed: int, dtype: str, pool: ThreadPoolExecutor, window: int,
                fp8_block: int | None = None) -> int:
    """Write one safetensors file: header from the shapes, then each tensor's bytes as it is generated."""
    torch_dtype, tag = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header, offset = {}, 0
    for name, shape in tensors:
        for key, kshape, ktag in stored_tensors(name, shape, fp8_block):
            nbytes = _numel(kshape) * _TAG_BYTES.get(ktag, itemsize)
            header[key] = {"dtype": ktag or tag, "shape": list(kshape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        pending = []
        for name, shape in tensors:  # generate ahead on the pool, write in order
            pending.append(pool.submit(make_stored, name, shape, seed, torch_dtype, fp8_block))
            if len(pending) >= window:
                for t in pending.pop(0).result():
                    _write_tensor(f, t)
        for fut in pending:
            for t in fut.result():
                _write_tensor(f, t)
    os.replace(tmp, path)
    return 8 + len(raw) + offset


def write_checkpoint(out, preset: str = "qwen3-30b-a3b", layers: int | None = None, shard_size="4GB",
                     seed: int = 0, dtype: str = "bfloat16", workers: int | None = None,
                     fp8_block: int | None = None) -> dict:
    """Write the checkpoint into folder ``out`` (block-wise FP8 projections with ``fp8_block``); returns a summary
    (bytes, shards, seconds, config)."""
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = hub_config(preset, layers, dtype, fp8_block)
    itemsize = torch.empty((), dtype=_DTYPES[dtype][0]).element_size()
    shards = plan_shards(tensor_shapes(config), itemsize, parse_size(shard_size), fp8_block)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in out.glob("model*.safetensors*"):  # a previous run with another shard count
        stale.unlink()
    workers = workers or min(8, os.cpu_count() or 1)
    total_bytes = file_bytes = 0
    weight_map = {}
    with ThreadPoolExecutor(workers) as pool:
        for name, tensors in zip(names, shards):
            file_bytes += write_shard(out / name, tensors, seed, dtype, pool, window=2 * workers, fp8_block=fp8_block)
            for model_key, model_shape in tensors:
                for key, shape, tag in stored_tensors(model_key, model_shape, fp8_block):
                    weight_map[key] = name
                    total_bytes += _numel(shape) * _TAG_BYTES.get(tag, itemsize)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2) + "\n")
    return dict(path=str(out), preset=preset, layers=config["num_hidden_layers"], shards=len(shards),
                tensor_bytes=total_bytes, file_bytes=file_bytes, seconds=time.perf_counter() - t0, config=config)


def write_drafter(out, config: dict, draft_vocab_size: int | None = None, seed: int = 0,
                  dtype: str = "bfloat16") -> dict:
    """A random EAGLE-3 drafter shaped for ``config`` (SpecForge layout via ``save_drafter``): hidden = target hidden,
    the target's heads, aux layers ``Eagle3Config.default_aux_layer_ids``; weights ``normal * 0.02``, norms 1."""
    from transformers import Qwen3MoeConfig

    from specfit.drafting.drafter import Eagle3Config, Eagle3Drafter
    from specfit.drafting.formats import save_drafter

    t0 = time.perf_counter()
    target = Qwen3MoeConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype",
                                                                             "transformers_version")})
    vocab = draft_vocab_size or min(config["vocab_size"], 32000)
    c = Eagle3Config.from_target(target, draft_vocab_size=vocab)
    if not all(0 <= i < target.num_hidden_layers for i in c.aux_layer_ids):
        raise ValueError(f"the default aux layers {c.aux_layer_ids} do not fit a {target.num_hidden_layers}-layer "
                         f"target; write a drafter for targets of 4 layers or more")
    with torch.device("meta"):
        drafter = Eagle3Drafter(c)
    state = {}
    for name, t in drafter.state_dict().items():
        if name in ("d2t", "t2d"):  # identity vocab maps: draft id d is target id d
            state[name] = torch.zeros(vocab, dtype=torch.long) if name == "d2t" else torch.arange(c.vocab_size) < vocab
        else:
            state[name] = make_tensor(name, tuple(t.shape), seed + 1, _DTYPES[dtype][0])
    drafter.load_state_dict(state, assign=True)
    save_drafter(drafter, out)
    nbytes = sum(p.stat().st_size for p in Path(out).iterdir())
    return dict(path=str(out), file_bytes=nbytes, seconds=time.perf_counter() - t0, aux_layer_ids=c.aux_layer_ids,
                draft_vocab_size=vocab)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_tensor(f, t: torch.Tensor) -> None:
    f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="checkpoint folder to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="override the layer count (the real shapes per layer)")
    p.add_argument("--shard-size", default="4GB", help="max shard size, e.g. 4GB (the hub's), 500MB, 100KB")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="generator threads (default: min(8, cores))")
    p.add_argument("--drafter-out", default=None, help="also write a random EAGLE-3 drafter into this folder")
    p.add_argument("--draft-vocab", type=int, default=None, help="drafter vocabulary (default: the preset's)")
    p.add_argument("--fp8-block", type=int, default=None,
                   help="write block-wise FP8 projections with N x N float32 scales (Qwen3-30B-A3B-FP8: 128)")
    args = p.parse_args(argv)
    if args.fp8_block is not None and args.fp8_block < 1:
        raise SystemExit(f"--fp8-block must be a positive int, got {args.fp8_block}")
    s = write_checkpoint(args.out, args.preset, args.layers, args.shard_size, args.seed, args.dtype, args.workers,
                         args.fp8_block)
    c = s["config"]
    print(f"wrote {args.out}: preset {args.preset}, {s['layers']} layers x {c['num_experts']} experts "
          f"(top-{c['num_experts_per_tok']}){f', FP8 {args.fp8_block}x{args.fp8_block} blocks' if args.fp8_block else ''}, "
          f"{s['shards']} shard(s), {s['file_bytes']:,} bytes "
          f"({s['file_bytes'] / 1e9:.2f} GB) in {s['seconds']:.1f} s ({s['file_bytes'] / 1e9 / s['seconds']:.2f} GB/s)")
    if args.drafter_out:
        d = write_drafter(args.drafter_out, c, args.draft_vocab or PRESETS[args.preset]["draft_vocab_size"],
                          args.seed, args.dtype)
        print(f"wrote drafter {args.drafter_out}: aux layers {list(d['aux_layer_ids'])}, draft vocab "
              f"{d['draft_vocab_size']}, {d['file_bytes']:,} bytes in {d['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
