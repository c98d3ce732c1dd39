"""Issue 38's counterfactual instrument: SpecFit's forecast of its own winner and of EAGLE-3's tree on the same pools,
EAGLE-3's tree verified on alternate cycles, against what both really committed and took, by cell
(``specfit.evaluation.counterfactual``).

    python benchmarks/counterfactual.py --cells gsm8k:12 cnn:12 gsm8k:24 cnn:24 gsm8k:64:0 gsm8k:12:1.4:sample \
        --prompts 4 --tokens 48 --out DIR
    python benchmarks/counterfactual.py --cells gsm8k:12 cnn:12 --host-ratio 2.5    # with the default host lane

A cell is ``workload:slots[:link ratio[:sample]]``: the link ratio is the emulated link as a multiple of the
structural default's demand-to-compute ratio, 1.4 (0: no link); ``sample`` decodes with temperature 0.7, top-p 0.8,
top-k 20. Held-out prompts (GSM8K and CNN/DailyMail test items from index 100 on). One model per cell, one untimed
warm-up call, then the prompts; SpecFit's acceptance model and backoff carry over between the calls as they do for a
user. CPU with an emulated link: not GPU speed; the instrument compares terms, not methods' speed (each turn pays
SpecFit's drafting). Writes ``counterfactual.json`` (every cycle) and prints one report per cell.
Smoke: ``--cells gsm8k:12 --prompts 1 --tokens 12``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)


def parse_cell(text: str) -> dict:
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in ("gsm8k", "cnn"):
        raise SystemExit(f"a cell is workload:slots[:link ratio[:sample]] with workload gsm8k or cnn, got {text!r}")
    ratio = float(parts[2]) if len(parts) > 2 else 1.4
    return dict(workload=parts[0], slots=int(parts[1]), ratio=ratio, sample=len(parts) > 3 and parts[3] == "sample",
                name=text)


def held_out(workload: str, n: int, offset: int) -> list[str]:
    from specfit.evaluation import datasets

    return datasets.prompts(workload, offset + n, max_chars=1500)[offset:]


def run_cell(cell: dict, n: int, tokens: int, offset: int, seed: int, host_ratio: float = 0.0) -> dict:
    from specfit import embedded
    from specfit.evaluation.counterfactual import Counterfactual, join, report, summarize

    link = embedded.default_link(cell["ratio"] / embedded.DEMAND_TO_COMPUTE) if cell["ratio"] > 0 else None
    host = embedded.default_host(host_ratio, link) if host_ratio > 0 and link is not None else None
    model, tokenizer = embedded.load(cell["slots"], link=link, host=host)
    eagle, _ = embedded.load(cell["slots"], link=link, host=host)  # EAGLE-3 itself, same prompts: its own drafting
    prompts = held_out(cell["workload"], n + 1, offset)
    kwargs = dict(SAMPLING) if cell["sample"] else dict(do_sample=False)
    rows: list[dict] = []
    own: list = []
    t0 = time.perf_counter()
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt").input_ids
        log: list = []
        trace = model.specfit.stats.start_trace()
        if cell["sample"]:
            torch.manual_seed(seed + i)
        model.generate(ids, max_new_tokens=tokens if i else 8, assistant=Counterfactual.factory(log), **kwargs)
        eagle_trace = eagle.specfit.stats.start_trace()
        if cell["sample"]:
            torch.manual_seed(seed + i)
        eagle.generate(ids, max_new_tokens=tokens if i else 8, assistant="eagle3", **kwargs)
        if i:  # the first prompt is the untimed warm-up
            rows += join(log, trace)
            own += list(eagle_trace)
    summary = summarize(rows)
    summary["eagle3_itself"] = dict(cycles=len(own), draft_ms=1e3 * sum(r.draft_seconds for r in own) / len(own),
                                    ms_per_cycle=1e3 * sum(r.seconds for r in own) / len(own),
                                    tokens_per_cycle=sum(r.committed for r in own) / len(own),
                                    tok_s=sum(r.committed for r in own) / sum(r.seconds for r in own))
    e = summary["eagle3_itself"]
    print(report(f"{cell['name']} ({n} prompts x {tokens} tokens, {time.perf_counter() - t0:.0f} s; link "
                 f"{'none' if link is None else f'{embedded.link_seconds_per_expert(link) * 1e3:.3f} ms/copy'}"
                 f"{'' if host is None else f'; {host.label}'})",
                 summary) + f"\n  EAGLE-3 itself (its own drafting, same prompts, its own model): drafting "
                            f"{e['draft_ms']:.1f} ms/cycle, {e['ms_per_cycle']:.1f} ms/cycle, tokens/cycle "
                            f"{e['tokens_per_cycle']:.2f}, tok/s {e['tok_s']:.2f}", flush=True)
    for r in rows:
        r.pop("parents", None), r.pop("tokens_pool", None)
    return dict(cell=cell, summary=_plain(summary), rows=_plain(rows))


def _plain(x):
    """JSON-safe: tuple keys as strings."""
    if isinstance(x, dict):
        return {(",".join(map(str, k)) if isinstance(k, tuple) else str(k)): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", nargs="+", default=["gsm8k:12", "cnn:12", "gsm8k:24", "cnn:24", "gsm8k:64:0",
                                                  "gsm8k:12:1.4:sample"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--offset", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-ratio", type=float, default=0.0,
                   help="cold experts on the structural default host lane at RATIO x the link (0: copies only)")
    p.add_argument("--out", default="benchmarks/results/counterfactual")
    args = p.parse_args()
    torch.set_num_threads(1)
    results = [run_cell(parse_cell(c), args.prompts, args.tokens, args.offset, args.seed, args.host_ratio)
               for c in args.cells]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "counterfactual.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
