"""Issue 35: greedy decoding in bf16 against plain transformers' bf16 ``generate()``, on held-out prompts.

For AR (the enabled model, no assistant), EAGLE-3 and SpecFit at each slot count, on the embedded model loaded in
bf16: whether the first token is identical, whether the whole text is, and at each text's first divergence plain's
logit gap between its token and the assistant's, in noise units; the largest logit deviation at the positions
compared; and the near-tie rate (the share of plain's positions whose top-1/top-2 gap is within k units, i.e. where
rounding could flip a token at all). The noise unit is measured on plain transformers alone: plain's own greedy
tokens fed back as small trees against its one-token logits (``specfit.evaluation.near_ties``, which explains the
criterion). Held out: GSM8K test questions and CNN/DailyMail test articles from index 100 on.

    python benchmarks/bf16_near_ties.py --slots 6 24 --gsm8k 8 --cnn 8 --tokens 64   # the figures (~40 min, CPU)
    python benchmarks/bf16_near_ties.py --smoke                                      # 1 + 1 prompts, 24 tokens

CPU, no link by default (a link changes timing, not values; ``--link-ratio 1`` for the default emulated one).
Writes ``results.json`` and prints one row per slot count and method.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from specfit.evaluation.results_file import write_results
from forecast_goals import held_out  # the same held-out prompts (this folder)

METHODS = (None, "eagle3", "specfit")
GREEDY = dict(do_sample=False, return_dict_in_generate=True, output_logits=True)


def plain_references(tokenizer, prompts: list[str], tokens: int) -> tuple[list[dict], list[float]]:
    """Plain transformers' bf16 greedy tokens and logits per prompt, and the shape noise of every position."""
    from transformers import AutoModelForCausalLM

    from specfit.embedded.paths import TARGET_DIR
    from specfit.evaluation import near_ties

    plain = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.bfloat16)
    refs, noise = [], []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = plain.generate(ids, max_new_tokens=tokens, **GREEDY)
        logits = near_ties.step_logits(out)
        refs.append({"ids": ids, "tokens": near_ties.new_tokens(out, ids.shape[1]), "logits": logits})
        noise += near_ties.shape_noise(plain, out.sequences, ids.shape[1], logits)
    return refs, noise


def cell(slots: int, link, refs: list[dict], tokens: int, unit: float, k: float) -> list[dict]:
    from specfit import embedded
    from specfit.evaluation import near_ties

    model, _ = embedded.load(slots, dtype=torch.bfloat16, link=link)
    verdicts = {m: [] for m in METHODS}
    for ref in refs:  # methods take turns prompt by prompt
        for method in METHODS:
            out = model.generate(ref["ids"], max_new_tokens=tokens, assistant=method, **GREEDY)
            got = near_ties.new_tokens(out, ref["ids"].shape[1])
            verdicts[method].append(near_ties.judge(ref["tokens"], ref["logits"], got, near_ties.step_logits(out),
                                                    unit, k))
    rows = []
    for method, vs in verdicts.items():
        diverged = [v for v in vs if v.divergence is not None]
        compared = sum(v.compared for v in vs)
        rows.append({
            "slots": slots, "method": method or "ar", "prompts": len(vs),
            "first_token_equal": sum(v.first_token_equal for v in vs), "identical": len(vs) - len(diverged),
            "divergences": len(diverged), "tokens_compared": compared,
            "divergences_per_1000_tokens": 1000 * len(diverged) / max(compared, 1),
            "divergence_gaps_units": [round(v.gap_units, 3) for v in diverged],
            "divergence_gaps_logits": [round(v.gap, 4) for v in diverged],
            "divergence_positions": [v.divergence for v in diverged],
            "max_deviation_units": max(v.deviation_units for v in vs),
            "near_ties": sum(v.near_tie for v in diverged), "ok": sum(v.ok for v in vs),
            "verdicts": [v.as_dict() for v in vs]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[6, 24])
    p.add_argument("--gsm8k", type=int, default=8)
    p.add_argument("--cnn", type=int, default=8)
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--k", type=float, default=None, help="near-tie threshold in noise units (default: near_ties.K)")
    p.add_argument("--link-ratio", type=float, default=0.0, help="x the structural default link; 0: no link")
    p.add_argument("--smoke", action="store_true", help="1 GSM8K + 1 CNN prompt, 24 tokens, 6 slots")
    p.add_argument("--out", default="benchmarks/results/bf16_near_ties")
    args = p.parse_args()
    if args.smoke:
        args.slots, args.gsm8k, args.cnn, args.tokens = [6], 1, 1, 24
    torch.set_num_threads(1)
    from specfit import embedded
    from specfit.evaluation import near_ties

    k = near_ties.K if args.k is None else args.k
    link = embedded.default_link(args.link_ratio) if args.link_ratio > 0 else None
    tokenizer = embedded.load(1, drafter=False)[1]
    prompts = held_out("gsm8k", args.gsm8k, args.offset) + held_out("cnn", args.cnn, args.offset)
    t0 = time.perf_counter()
    refs, noise = plain_references(tokenizer, prompts, args.tokens)
    plain_logits = torch.cat([r["logits"] for r in refs])
    unit = near_ties.noise_unit(noise, plain_logits, torch.bfloat16)
    q = torch.tensor(noise).quantile(torch.tensor([0.5, 0.9, 0.99])).tolist()
    thresholds = {"median noise": q[0], "p99 noise": q[2], "1 unit": unit, "2 units": 2 * unit,
                  f"{k:g} units": k * unit}
    result = {"dtype": "bfloat16", "prompts": len(prompts), "tokens": args.tokens, "k": k,
              "link": None if link is None else link.label, "noise_unit": unit, "noise_max": max(noise),
              "noise_quantiles": {"p50": q[0], "p90": q[1], "p99": q[2]}, "noise_positions": len(noise),
              "near_tie_rate": {name: near_ties.near_tie_rate(plain_logits, t) for name, t in thresholds.items()},
              "rows": []}
    print(f"bf16, {len(prompts)} held-out prompts x {args.tokens} tokens; shape noise over {len(noise)} positions "
          f"(logits): median {q[0]:.4f}, p90 {q[1]:.4f}, p99 {q[2]:.4f}, max {max(noise):.4f}; noise unit "
          f"{unit:.4f}", flush=True)
    print("plain positions whose top-1/top-2 gap is within " + ", ".join(
        f"{name} ({t:.3f}): {result['near_tie_rate'][name]:.1%}" for name, t in thresholds.items()), flush=True)
    print("slots method   first-token identical divergences /1000tok gaps (logits)      max-dev(units) ok")
    for slots in args.slots:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bf16 embedded model has no calibrated profile: timing only
            rows = cell(slots, link, refs, args.tokens, unit, k)
        for r in rows:
            print(f"{slots:5d} {r['method']:8s} {r['first_token_equal']:3d}/{r['prompts']:<7d} "
                  f"{r['identical']:3d}/{r['prompts']:<5d} {r['divergences']:11d} "
                  f"{r['divergences_per_1000_tokens']:7.1f} {str(r['divergence_gaps_logits']):24s} "
                  f"{r['max_deviation_units']:10.2f} {r['ok']:3d}/{r['prompts']}", flush=True)
        result["rows"] += rows
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['seconds']:.0f} s; wrote {write_results(args.out, result)}")


if __name__ == "__main__":
    main()
