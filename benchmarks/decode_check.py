"""Decode check: load a checkpoint with its experts offloaded and decode a few prompts of random token ids with plain
autoregressive ``generate`` (AR), ``assistant="eagle3"`` and ``assistant="specfit"``; print one table.

    python benchmarks/decode_check.py --model CKPT --drafter DRAFTER --slots 48 --profile PROFILE.json --json out.json

Synthetic checkpoints have no tokenizer, hence random token ids; eos is suppressed (``min_new_tokens``) so every run
decodes the same number of tokens. SpecFit's selector takes draft-node routes from the route oracle (the default
route source; its extra forward is a measurement device, excluded from the timed decode) and its cycle-time model from
``--profile`` (a ``specfit calibrate`` profile); without one SpecFit warns and uses its default cost model.

Columns: tok/s over the decode phase (prefill excluded), host-to-device expert copies per output token, slot-cache hit
rate, draft nodes verified per cycle, tokens committed per cycle (accepted + bonus), mean cycle time, and how many
prompts gave the same tokens as AR (with random bf16 weights the logits are nearly flat, so a near-tie broken
differently by a batched kernel can change a token; in fp32 greedy output must match).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

MODES = ("ar", "eagle3", "specfit")


def load(args):
    import specfit

    kw = dict(cache_slots=args.slots, dtype=getattr(torch, args.dtype), device=args.device, drafter=args.drafter,
              cache_mode=args.cache_mode)
    if args.profile:
        kw["cost_model"] = args.profile
    if args.link_ms:
        kw["link"] = args.link_ms / 1e3
    t0 = time.perf_counter()
    model = specfit.from_pretrained(args.model, **kw)
    return model, time.perf_counter() - t0


def generate(model, mode: str, prompt: torch.Tensor, new_tokens: int):
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
              top_k=None)
    if mode != "ar":
        kw["assistant"] = mode
    out = model.generate(prompt, **kw)
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, prompt.shape[1]:].tolist(), model.specfit.stats.last_generate.copy()


def run(args) -> dict:
    from specfit.stats import Counters

    if args.threads:
        torch.set_num_threads(args.threads)
    model, load_s = load(args)
    rt = model.specfit
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(rt.device) for _ in range(args.prompts)]
    warm = torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(rt.device)
    caught: list[str] = []
    results, outputs = {}, {}
    for mode in args.modes:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            generate(model, mode, warm, min(8, args.new_tokens))  # warm-up: kernels, allocator, cost model lookup
            total = Counters()
            outputs[mode] = []
            for prompt in prompts:
                tokens, c = generate(model, mode, prompt, args.new_tokens)
                outputs[mode].append(tokens)
                total += c
        caught += [f"{mode}: {x.category.__name__}: {x.message}" for x in w]
        same = sum(a == b for a, b in zip(outputs[mode], outputs.get("ar", outputs[mode])))
        results[mode] = dict(total.as_dict(), same_as_ar=same if "ar" in outputs else None)
    cost = rt.cost_model
    info = dict(model=str(args.model), drafter=str(args.drafter), device=_device_label(rt), regime=rt.link_label,
                dtype=args.dtype, slots=args.slots, experts=rt.num_experts, moe_layers=len(rt.layers),
                cache_mode=args.cache_mode, prompts=args.prompts, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, load_seconds=load_s, pinned_bytes=rt.store.pinned_bytes,
                expert_bytes=rt.store.weight_bytes,
                cost_model=None if cost is None else dict(beta=cost.beta, intercepts=list(cost.intercepts),
                                                          source=cost.meta.get("source", args.profile)),
                warnings=sorted(set(caught)))
    return dict(info=info, results=results)


def _device_label(rt) -> str:
    if rt.device.type == "cuda":
        return torch.cuda.get_device_name(rt.device)
    return "CPU"


def print_table(report: dict) -> None:
    i = report["info"]
    print(f"{i['device']}, {i['regime']}; {i['moe_layers']} MoE layers x {i['experts']} experts, {i['slots']} slots "
          f"({i['cache_mode']}), {i['dtype']}; {i['prompts']} prompts x {i['new_tokens']} new tokens "
          f"(random ids, {i['prompt_len']}-token prompts); loaded in {i['load_seconds']:.1f} s, "
          f"{i['pinned_bytes']:,} of {i['expert_bytes']:,} expert bytes pinned")
    if i["cost_model"] is not None:
        c = i["cost_model"]
        print(f"cost model: beta {c['beta'] * 1e3:.4f} ms/expert, intercepts {c['intercepts'][0] * 1e3:.2f}.."
              f"{c['intercepts'][-1] * 1e3:.2f} ms ({c['source']})")
    print("| mode | tok/s | copies / token | hit rate | nodes / cycle | tokens / cycle | cycle ms | = AR |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    names = {"ar": "AR", "eagle3": "EAGLE-3", "specfit": "SpecFit (oracle routes)"}
    for mode, r in report["results"].items():
        same = "-" if r["same_as_ar"] is None or mode == "ar" else f"{r['same_as_ar']}/{i['prompts']}"
        print(f"| {names.get(mode, mode)} | {r['tokens_per_second']:.2f} | {r['copies_per_token']:.1f} | "
              f"{r['hit_rate']:.2f} | {r['nodes_per_cycle']:.2f} | {r['tokens_per_cycle']:.2f} | "
              f"{r['seconds_per_cycle'] * 1e3:.1f} | {same} |")
    for line in i["warnings"]:
        print(f"warning: {line}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (hub layout)")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter folder")
    p.add_argument("--slots", type=int, required=True, help="expert slots per MoE layer on the device")
    p.add_argument("--profile", default=None, help="cost profile JSON from `specfit calibrate` (for SpecFit)")
    p.add_argument("--cache-mode", choices=("cached", "cleared"), default="cached")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    p.add_argument("--link-ms", type=float, default=None, help="emulated host link, ms per expert copy (CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the table and settings here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {MODES}")
    report = run(args)
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
