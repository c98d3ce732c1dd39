"""Decode check: load a checkpoint with its experts offloaded and decode a few prompts of random token ids with plain
autoregressive ``generate`` (AR), ``assistant="eagle3"`` and ``assistant="specfit"``; print one table.

    python tests/gpu/decode_check.py --model CKPT --drafter DRAFTER --slots 48 --profile PROFILE.json --json out.json

Synthetic checkpoints have no tokenizer, hence random token ids; the model's eos is switched off (no logits
processor, unlike ``min_new_tokens``) so every run decodes the same number of tokens and greedy acceptance takes its
one-transfer path, as in a user's greedy call. SpecFit's selector takes draft-node routes from the route source
``route_source="auto"`` resolves to on this model (the row is labelled with it: a drafter as wide as the target and
no trained predictor means the target's own gates, ``gate``) and its cycle-time model from ``--profile`` (a
``specfit calibrate`` profile); without one SpecFit warns and uses its default cost model. tok/s is wall clock of
the decode phase, everything it did included.

Each mode starts from empty expert slots, as on a freshly loaded model (nothing resident is inherited from the mode
before it), then runs one warm-up prompt and the timed prompts, then one more prompt with host syncs counted: on
CUDA by ``torch.cuda.set_sync_debug_mode("warn")`` (what the driver calls, stream synchronizes included) plus the
host waits on events and the device that it does not report (counted by ``specfit.evaluation.syncs``), elsewhere by
SpecFit's would-be-sync counter. The settings and each mode's row are printed (and ``--json`` rewritten) as
soon as they are known, so a run cut short still leaves figures.

Columns: tok/s over the decode phase (prefill excluded), host-to-device expert copies per output token, slot-cache hit
rate, bandwidth of the copies (bytes over copy-path time), draft nodes verified per cycle, tokens committed per cycle
(accepted + bonus), mean cycle time, host syncs per cycle of the counted prompt, and how many prompts gave the same
tokens as AR (with random bf16 weights the logits are nearly flat, so a near-tie broken differently by a batched
kernel can change a token; in fp32 greedy output must match). ``--require-pinned`` fails the run (exit 1) if any copy
came from pageable host memory.

``--reference`` is the correctness gate at real shapes (``decode_gate.py``), run first: the prefill and a greedy
decode of the first prompt through the slot cache (from empty slots; grouped matmuls over the slots where the device
runs them: ``--require-grouped`` fails the run otherwise) against an all-resident reference (every expert read
straight from its host row: no slots, no LRU, gathered ``bmm``), the reference's routes replayed in the checked pass
(the router's own disagreements counted apart): every MoE layer's experts output and every step's logits; the first
MoE layer against transformers' own experts forward on the stored weights; then, after each mode's decode, its greedy
output teacher-forced through the reference (a token that is not the reference's argmax fails where the margin is
over ``--token-factor`` x the step's numeric gap). A gap is max |diff| over the reference row's standard deviation;
the run fails (exit 1) if one is over ``--reference-tol`` (0.25: rounding moves an experts output by a few hundredths
of its spread, a wrong expert, slot or routing weight by about all of it) or a token check fails.
``--emulate-rounding`` (CPU studies) computes the checked passes' expert matmuls in a wider dtype, rounded once, as a
GPU's kernels round differently from the reference's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from decode_gate import (TOLERANCE, FACTOR, fresh_slots, other_rounding, reference_gap, reference_line,
                         token_check, token_line)

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
    kw = dict(max_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None)
    if mode != "ar":
        kw["assistant"] = mode
    out = model.generate(prompt, **kw)
    if model.specfit.cuda:  # the runtime's own device synchronize (the CUDA stand-in's double on a CPU)
        model.specfit.engine.streams.synchronize()
    return out[0, prompt.shape[1]:].tolist(), model.specfit.stats.last_generate.copy()


def run(args, emit=None) -> dict:
    """Decode with every mode; ``emit(report)`` is called after loading and after each mode (partial reports)."""
    with contextlib.ExitStack() as rounding:
        return _run(args, emit, rounding)


def _run(args, emit, rounding) -> dict:
    from specfit.stats import Counters

    if args.threads:
        torch.set_num_threads(args.threads)
    model, load_s = load(args)
    model.generation_config.eos_token_id = None  # fixed-length decodes without a logits processor
    rt = model.specfit
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(rt.device) for _ in range(args.prompts)]
    warm = torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(rt.device)
    caught: list[str] = []
    results, outputs = {}, {}
    report = dict(info=_info(args, rt, load_s, caught), results=results)
    if args.grouped:
        rt.grouped_experts = True  # CPU studies: the grouped path forced (the device check chooses it at enable)
    if args.emulate_rounding:
        rounding.enter_context(other_rounding(model))
    if args.reference:
        report["reference"] = reference_gap(model, prompts[0], args.new_tokens)
        report["tokens"] = {}
        print(reference_line(report["reference"], args.reference_tol), flush=True)
    if emit is not None:
        emit(report)
    for mode in args.modes:
        fresh_slots(rt)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            generate(model, mode, warm, min(8, args.new_tokens))  # warm-up: kernels, allocator, cost model lookup
            cold_hits = rt.stats.last_prefill.hits  # 0: the mode started from empty slots
            total = Counters()
            outputs[mode] = []
            for prompt in prompts:
                tokens, c = generate(model, mode, prompt, args.new_tokens)
                outputs[mode].append(tokens)
                total += c
        caught += [f"{mode}: {x.category.__name__}: {x.message}" for x in w if "synchroniz" not in str(x.message)]
        syncs, counted = count_syncs(model, mode, prompts[0], args.new_tokens)
        if args.reference:  # the mode's own output (trees, KV compaction, acceptance) against the reference
            report["tokens"][mode] = token_check(model, prompts[0], outputs[mode][0], args.token_factor)
            print(token_line(NAMES.get(mode, mode), report["tokens"][mode]), flush=True)
        same = sum(a == b for a, b in zip(outputs[mode], outputs.get("ar", outputs[mode])))
        results[mode] = dict(total.as_dict(), same_as_ar=same if "ar" in outputs else None,
                             warmup_prefill_hits=cold_hits, route_source=route_source(model, mode),
                             syncs=syncs, syncs_per_cycle=syncs / max(1, counted.cycles),
                             syncs_per_token=syncs / max(1, counted.new_tokens), sync_counter=sync_counter(rt))
        report["info"] = _info(args, rt, load_s, caught)
        if emit is not None:
            emit(report)
    return report


def sync_counter(rt) -> str:
    if not rt.cuda:
        return "would-be syncs (CPU count)"
    return "cuda sync debug mode + host waits" + (" (the CUDA stand-in's)" if rt.device.type != "cuda" else "")


def count_syncs(model, mode: str, prompt: torch.Tensor, new_tokens: int):
    """(host syncs, the call's counters) of one more decode of ``prompt``: on CUDA the warnings of
    ``set_sync_debug_mode("warn")`` (a stream synchronize among them) plus the host waits it does not report (event
    waits and device synchronizes, counted by SpecFit's counter), else SpecFit's would-be-sync counter."""
    from specfit.evaluation.syncs import WouldBeSyncs
    from specfit.offload.standin_device import cuda_calls

    rt = model.specfit
    if not rt.cuda:
        with WouldBeSyncs() as syncs:
            _, c = generate(model, mode, prompt, new_tokens)
        return syncs.total, c
    cuda = cuda_calls(rt.device)  # torch.cuda, or on the CUDA stand-in its double (its own debug mode)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None)
    if mode != "ar":
        kw["assistant"] = mode
    rt.engine.streams.synchronize()
    with warnings.catch_warnings(record=True) as caught, WouldBeSyncs() as counter:
        warnings.simplefilter("always")
        cuda.set_sync_debug_mode("warn")
        try:
            model.generate(prompt, **kw)
        finally:
            cuda.set_sync_debug_mode("default")
    rt.engine.streams.synchronize()
    reported = sum("synchroniz" in str(x.message) for x in caught)  # a stream synchronize: in both, counted once
    return reported + counter.waits - counter.by_kind["stream synchronize"], model.specfit.stats.last_generate.copy()


def route_source(model, mode: str) -> str | None:
    """The route source SpecFit's selector ran with ("auto" resolved), None for the other modes."""
    if mode != "specfit":
        return None
    from specfit.selection.route_sources import choose_route_source

    return choose_route_source(model, model.specfit.options.route_source)


def _info(args, rt, load_s: float, caught: list[str]) -> dict:
    cost = rt.cost_model
    return dict(model=str(args.model), drafter=str(args.drafter), device=_device_label(rt), regime=rt.link_label,
                dtype=args.dtype, slots=args.slots, experts=rt.num_experts, moe_layers=len(rt.layers),
                cache_mode=args.cache_mode, prompts=args.prompts, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, load_seconds=load_s, pinned_bytes=rt.store.pinned_bytes,
                expert_bytes=rt.store.weight_bytes, cuda=rt.cuda, grouped=bool(rt.grouped_experts),
                cost_model=None if not hasattr(cost, "beta") else dict(  # a path until SpecFit first resolves it
                    beta=cost.beta, intercepts=list(cost.intercepts), source=cost.meta.get("source", args.profile)),
                warnings=sorted(set(caught)))


def _device_label(rt) -> str:
    if rt.cuda:
        from specfit.offload.standin_device import cuda_calls

        return cuda_calls(rt.device).get_device_name(rt.device)
    return "CPU"


NAMES = {"ar": "AR", "eagle3": "EAGLE-3", "specfit": "SpecFit"}


def mode_name(mode: str, result: dict) -> str:
    source = result.get("route_source")
    return NAMES.get(mode, mode) + (f" ({source} routes)" if source else "")


def header_lines(report: dict) -> list[str]:
    i = report["info"]
    lines = [f"{i['device']}, {i['regime']}; {i['moe_layers']} MoE layers x {i['experts']} experts, {i['slots']} "
             f"slots ({i['cache_mode']}), {i['dtype']}; {i['prompts']} prompts x {i['new_tokens']} new tokens "
             f"(random ids, {i['prompt_len']}-token prompts); loaded in {i['load_seconds']:.1f} s, "
             f"{i['pinned_bytes']:,} of {i['expert_bytes']:,} expert bytes pinned"]
    if i["cost_model"] is not None:
        c = i["cost_model"]
        lines.append(f"cost model: beta {c['beta'] * 1e3:.4f} ms/expert, intercepts {c['intercepts'][0] * 1e3:.2f}.."
                     f"{c['intercepts'][-1] * 1e3:.2f} ms ({c['source']})")
    lines.append("| mode | tok/s | copies / token | hit rate | copy GB/s | nodes / cycle | tokens / cycle | cycle ms "
                 "| syncs / cycle | = AR |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    return lines


def row_line(report: dict, mode: str) -> str:
    i, r = report["info"], report["results"][mode]
    same = "-" if r["same_as_ar"] is None or mode == "ar" else f"{r['same_as_ar']}/{i['prompts']}"
    return (f"| {mode_name(mode, r)} | {r['tokens_per_second']:.2f} | {r['copies_per_token']:.1f} | "
            f"{r['hit_rate']:.2f} | {r['copy_bandwidth'] / 1e9:.1f} | {r['nodes_per_cycle']:.2f} | "
            f"{r['tokens_per_cycle']:.2f} | {r['seconds_per_cycle'] * 1e3:.1f} | {r['syncs_per_cycle']:.1f} | {same} |")


def print_table(report: dict) -> None:
    print("\n".join(header_lines(report) + [row_line(report, mode) for mode in report["results"]]))
    for line in report["info"]["warnings"]:
        print(f"warning: {line}")


class Progress:
    """Prints the header once loaded, then each mode's row as soon as it is done; rewrites ``--json`` each time."""

    def __init__(self, json_path: str | None):
        self.json_path, self.printed = json_path, 0

    def __call__(self, report: dict) -> None:
        if self.printed == 0:
            print("\n".join(header_lines(report)), flush=True)
        rows = list(report["results"])
        for mode in rows[max(0, self.printed - 1):]:
            print(row_line(report, mode), flush=True)
        self.printed = len(rows) + 1
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.json_path).write_text(json.dumps(report, indent=2) + "\n")


def pageable_failure(report: dict) -> str | None:
    """Why the copies were not all from pinned memory (None if they were)."""
    i = report["info"]
    if not i["cuda"]:
        return "not a CUDA run (nor the CUDA stand-in): host memory is pinned only for CUDA copies"
    pageable = {m: r["pageable_copies"] for m, r in report["results"].items() if r["pageable_copies"]}
    if i["pinned_bytes"] < i["expert_bytes"] or pageable:
        return (f"{i['pinned_bytes']:,} of {i['expert_bytes']:,} expert bytes pinned; copies from pageable memory: "
                f"{pageable or 0} (synchronous: they overlap nothing)")
    return None


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
    p.add_argument("--json", default=None, help="write the table and settings here (rewritten after each mode)")
    p.add_argument("--require-pinned", action="store_true",
                   help="exit 1 if the experts are not all pinned or any copy came from pageable memory (CUDA)")
    p.add_argument("--reference", action="store_true",
                   help="first check the slot cache's logits against an all-resident reference; exit 1 on a gap")
    p.add_argument("--reference-tol", type=float, default=TOLERANCE, help="largest gap --reference accepts")
    p.add_argument("--token-factor", type=float, default=FACTOR,
                   help="--reference: a token that is not the reference's argmax fails where the reference's top-1 "
                        "over top-2 margin is over this many times the step's numeric gap")
    p.add_argument("--emulate-rounding", action="store_true",
                   help="CPU studies: the checked passes' expert matmuls in a wider dtype, rounded once (a GPU's "
                        "different accumulation order)")
    p.add_argument("--require-grouped", action="store_true",
                   help="exit 1 unless the experts ran as grouped matmuls over the slots (CUDA, bf16)")
    p.add_argument("--grouped", action="store_true", help="force the grouped experts path (CPU studies)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {MODES}")
    for name in ("reference_tol", "token_factor"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    report = run(args, emit=Progress(args.json))
    if report["info"]["cost_model"] is not None:  # known once SpecFit has resolved it
        print(header_lines(report)[1])
    for line in report["info"]["warnings"]:
        print(f"warning: {line}")
    failure = pageable_failure(report)
    if args.require_pinned and failure:
        print(f"FAIL (--require-pinned): {failure}")
        return 1
    ref = report.get("reference")
    if ref is not None and ref["max_gap"] > args.reference_tol:
        print(f"FAIL (--reference): the slot cache's logits or experts outputs are {ref['max_gap']:.4f} standard "
              f"deviations from the all-resident reference's (tolerance {args.reference_tol:g}) with the same routes: "
              f"decoding through the offload is wrong")
        return 1
    wrong = {m: t["failures"] for m, t in report.get("tokens", {}).items() if t["failures"]}
    if wrong:
        print(f"FAIL (--reference): {', '.join(NAMES.get(m, m) for m in wrong)} decoded tokens the reference does "
              f"not, where its margin is over {args.token_factor:g}x the step's numeric gap: "
              + "; ".join(f"{NAMES.get(m, m)} step {f[0]['step']}" for m, f in wrong.items()))
        return 1
    if args.require_grouped and not (ref or {}).get("grouped", report["info"]["grouped"]):
        print("FAIL (--require-grouped): the experts ran gathered, not as grouped matmuls over the slots (see the "
              "warning SpecFit printed at enable)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
