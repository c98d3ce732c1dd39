"""FP8 experts against bf16 experts at Qwen3-30B-A3B's shapes (hidden 2048, moe_intermediate 768, 128x128 blocks),
one row each:

- bandwidth: host -> device copies of whole expert rows from a pinned arena (``ExpertStore``, pinned in place) into
  device slots, bf16 rows (9 MiB) against block-wise FP8 rows (4.5 MiB + 288 float32 scales): ms per expert and GB/s.
- decode: one MoE layer's experts forward at decode (1 token, top-8) from resident slots, bf16 against FP8 (the FP8
  rows dequantized on the device as SpecFit computes them, then the same batched math), ms per layer.

    python tests/gpu/fp8_check.py            # CUDA when available; --device cpu for a smoke run
One JSON object per row on stdout. A standalone study: ``gpu_check.py`` does not run it (its optional ``fp8`` stage
decodes an FP8 checkpoint at the real shapes instead).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

H, I, BLOCK, TOP_K = 2048, 768, (128, 128), 8


def stores(experts: int, pin: bool, hidden: int = H, intermediate: int = I, block: tuple[int, int] = BLOCK):
    """One layer of ``experts`` random experts (``normal * 0.02``) twice: bf16 as stored, and the same weights
    quantized block-wise to FP8 (e4m3 + float32 scales), each in an ``ExpertStore`` (pinned in place if ``pin``)."""
    from specfit.seam import layers as hf_layers
    from specfit.offload.formats import BlockFP8Format, quantize
    from specfit.offload.store import ExpertStore

    layout = hf_layers.ExpertLayout(hidden, intermediate)
    bf16 = ExpertStore(1, experts, hidden, intermediate, torch.bfloat16, pin=pin)
    fp8 = ExpertStore(1, experts, hidden, intermediate, torch.bfloat16, pin=pin,
                      format=BlockFP8Format(layout, block, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    for e in range(experts):  # expert by expert: no float32 copy of the whole arena
        bf16.arenas[0][e].copy_(torch.randn(bf16.arenas[0].shape[1], generator=g) * 0.02)
        gate_up, down = bf16.expert(0, e)
        for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
            q, s = quantize(w, block)
            fp8.write_part(0, e, name, q)
            fp8.write_part(0, e, name + "_scale_inv", s)
    return bf16, fp8


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=16, help="experts per arena (each copy moves them all)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    bf16, fp8 = stores(args.experts, pin=device.type == "cuda")
    for name, store in (("bf16", bf16), ("fp8", fp8)):
        slots = torch.empty(args.experts, store.expert_numel, dtype=store.dtype, device=device)
        arena = store.arenas[0]
        seconds = timed(lambda: slots.copy_(arena, non_blocking=True), device, args.repeats) / args.experts
        print(json.dumps(dict(row="fp8 bandwidth", experts=name, device=str(device), pinned=store.is_pinned,
                              expert_bytes=store.expert_bytes, ms_per_expert=seconds * 1e3,
                              gb_per_s=store.expert_bytes / seconds / 1e9)))
        x = torch.randn(TOP_K, 1, H, dtype=torch.bfloat16, device=device)  # one token's row for each of 8 experts
        experts = _experts_module()
        rows = slots[torch.arange(TOP_K, device=device) % args.experts]  # [8, row]: 8 resident experts

        def layer():
            from specfit.seam import experts as hf_experts

            return hf_experts.experts_forward_batched(experts, x, *store.compute_parts(rows))

        seconds = timed(layer, device, args.repeats)
        print(json.dumps(dict(row="fp8 decode", experts=name, device=str(device), top_k=TOP_K,
                              ms_per_layer=seconds * 1e3, ms_per_token_48_layers=48 * seconds * 1e3)))


def _experts_module(hidden: int = H, intermediate: int = I):
    """A Qwen3-MoE experts module at these shapes, on the meta device (only its gating function is used)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    with torch.device("meta"):
        return Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=128))


if __name__ == "__main__":
    main()
