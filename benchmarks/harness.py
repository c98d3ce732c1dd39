"""The timing rules, written once: every suite that times decoding (``run.py speed``, ``batch``, ``lane``, ``fp8``,
``calibration``, the clock of ``cache``) measures its cells here.

Per cell (workload, batch size, slots, host lane, link ratio, cache policy, CPU threads): fresh instances of each
method (each its own model, so slot caches, acceptance models and guards never mix), one untimed short warm-up call
each, then ``--groups`` left-padded batches of held-out prompts (GSM8K and CNN/DailyMail test items from
``--offset`` on; MT-Bench and HumanEval prompts the drafter never saw; or yours, ``--prompts FILE``), whole
generate() calls taking turns with the method order rotating batch by batch; greedy rows checked identical across
methods (an AssertionError names the cell and the methods). Reported per cell: aggregate tok/s (every row's new
tokens through its first end token, counted from the method's own output, over the calls' wall clock: prefill and
everything included), cold experts (copies + host experts) per committed token, SpecFit's ways (the guard's, per
cycle) and its time forecast over the clock. CPU with an emulated link and host lane: not GPU speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specfit.evaluation.harness import GENERATE, METHODS, ORACLE
from specfit.stats import Counters

BF16 = "-bf16"  # METHOD-bf16 in an --fp8 run: that method on the bf16 model, beside the FP8 ones
# method -> (column label, short label of the cold-experts columns)
LABELS = {"ar": ("plain", "AR"), "eagle3": ("EAGLE-3", "E3"), "specfit": ("SpecFit", "SF"),
          "eagle3-vanilla": ("E3 van", "E3v"), "specfit-paper": ("SF pap", "SFp"), "specfit-oracle": ("SF orc", "SFo"),
          "specfit-gate": ("SF gate", "SFg"), "specfit-predictor": ("SF pred", "SFd"),
          "specfit-prefetch": ("SF pref", "SFf"), "specfit-paper-cost": ("SF pcst", "SFpc"),
          "specfit-rule": ("SF rule", "SFr"), "prompt-lookup": ("lookup", "PL"), "ar-copy": ("AR copy", "ARc"),
          "eagle3-copy": ("E3 copy", "E3c"), "specfit-copy": ("SF copy", "SFc"), "ar-host": ("AR host", "ARh"),
          ORACLE: ("oracle", "OR")}
SAMPLING = {"do_sample": True, "temperature": 0.8}  # --sample-seed: seeded sampling, the same seed for every method


@dataclass(frozen=True)
class Cell:
    workload: str
    batch: int
    slots: int
    lane: str  # "host": cold experts on the host lane where it pays (cold="auto"); "copy": every one copied
    link: float = 1.0  # the emulated link, x the structural default (0: none); --model: x --link-ms
    policy: str | None = None  # the slot cache's policy (None: the default)
    threads: int = 1


def label(method: str) -> tuple[str, str]:
    if method.endswith(BF16):
        long, short = LABELS[method.removesuffix(BF16)]
        return f"{short} bf16", f"{short}b"
    return LABELS[method]


def cells(args) -> list[Cell]:
    """The grid of a run, in the order it runs: lanes, then workloads, slots, batch sizes (innermost)."""
    workloads = [Path(args.prompts).name] if args.prompts else args.workloads
    grid = [Cell(w, b, s, lane if link else "copy", link, policy, threads)  # no link: no lane (scaled to the link)
            for threads in args.threads for link in args.links for policy in args.policies or [None]
            for lane in args.lanes for w in workloads for s in args.slots for b in args.batches]
    return list(dict.fromkeys(grid))


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file (one a line) or a .jsonl file (a "prompt" field a line); blank lines skipped."""
    import json

    lines = [s for s in Path(path).read_text(encoding="utf-8").splitlines() if s.strip()]
    if path.endswith(".jsonl"):
        rows = [json.loads(s) for s in lines]
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not isinstance(r.get("prompt"), str)),
                   None)
        if bad is not None:
            raise SystemExit(f"--prompts {path}: line {bad + 1} has no \"prompt\" string field")
        lines = [r["prompt"] for r in rows]
    if not lines:
        raise SystemExit(f"--prompts {path}: no prompts in it (a text file, one prompt a line, or a .jsonl file with "
                         f"a \"prompt\" field a line)")
    return lines if path.endswith(".jsonl") else [s.replace("\\n", "\n") for s in lines]  # \n in a line: a newline


def held_out(workload: str, n: int, offset: int) -> list[str]:
    from specfit.evaluation import datasets

    start = offset if workload in ("gsm8k", "cnn") else 0  # MT-Bench and HumanEval: never seen by the drafter
    return datasets.prompts(workload, start + n, max_chars=1500)[start:]


def texts(args, cell: Cell) -> list[str]:
    """The cell's prompts: ``--groups`` batches of held-out prompts, or those of ``--prompts FILE`` (all of them
    unless ``--groups`` is given)."""
    if args.prompts:
        return read_prompts(args.prompts)[:None if args.groups is None else cell.batch * args.groups]
    return held_out(cell.workload, cell.batch * args.groups, args.offset)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def link_and_lane(args, cell: Cell):
    """(LinkConfig or None, HostConfig or None) of a cell: the embedded model's structural defaults, emulated; a
    model of yours: on CUDA the real copies and host lane (nothing emulated), on a CPU ``--link-ms`` emulated."""
    from specfit import embedded
    from specfit.offload.link import LinkConfig

    if args.model is None:
        link = embedded.default_link(cell.link)
        return link, embedded.default_host(embedded.HOST_TO_LINK, link) if cell.lane == "host" and link else None
    if device() == "cuda" or not args.link_ms or not cell.link:
        return None, None
    return LinkConfig(seconds_per_expert=args.link_ms * cell.link / 1e3), None


def instance(args, cell: Cell, name: str):
    """(model, tokenizer) of one method in a cell: a fresh instance, its decoding options set."""
    import specfit
    from specfit import embedded

    method = METHODS[name.removesuffix(BF16)]
    link, host = link_and_lane(args, cell)
    kw = dict(cache_mode="cleared" if method.cleared else "cached", link=link, host=host,
              cold=method.cold or ("copy" if args.model and cell.lane == "copy" else None))
    if cell.policy is not None:
        kw["cache_policy"] = cell.policy
    if args.model is None:
        model, tokenizer = embedded.load(cell.slots, fp8=args.fp8 and not name.endswith(BF16), **kw)
    else:
        from transformers import AutoTokenizer

        dtype = getattr(torch, args.dtype) if args.dtype else None
        model = specfit.from_pretrained(args.model, cache_slots=cell.slots, drafter=args.drafter, dtype=dtype, **kw)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    if method.options:
        specfit.configure(model, **dict(method.options))
    return model, tokenizer


def fp8_reference(models: dict):
    """Plain transformers' own load of the FP8 folder the FP8 methods run (fp32, dequantizing on a CPU), or None."""
    from transformers import AutoModelForCausalLM

    folder = next((m.name_or_path for name, m in models.items() if not name.endswith(BF16)), None)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def run_cell(args, cell: Cell) -> dict:
    """One cell, by the rules above; the figures as a dict (``line`` prints it)."""
    from specfit.decoding.batch_rows import new_tokens
    from specfit.evaluation.batches import left_padded, pad_id

    torch.set_num_threads(cell.threads)
    methods = tuple(args.methods)
    if ORACLE in methods:
        import specfit.decoding.oracle  # noqa: F401  (registers the oracle's assistant)
    models, tokenizer = {}, None
    for name in methods:
        models[name], tokenizer = instance(args, cell, name)
    first = models[methods[0]]
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(first.device) for t in texts(args, cell)]
    calls = left_padded(prompts, cell.batch, pad_id(first))
    sampling = dict(SAMPLING) if args.sample_seed is not None else {"do_sample": False}
    for method, model in models.items():  # untimed: one short call each (one-time costs stay out)
        model.generate(calls[0][0], attention_mask=calls[0][1], max_new_tokens=args.warmup_tokens,
                       assistant=METHODS[method.removesuffix(BF16)].assistant, **GENERATE.get(method, {}), **sampling)
    acceptance = {m: [] for m in methods if m.startswith("specfit") and args.acceptance}
    for m, log in acceptance.items():  # calibration: every drafted child SpecFit labels, from here on
        models[m].specfit.acceptance_log = log
    reference = fp8_reference(models) if args.fp8 and args.sample_seed is None else None
    seconds = {m: 0.0 for m in methods}
    counters = {m: Counters() for m in methods}
    tokens_out = {m: 0 for m in methods}  # every row's new tokens through its first end token: padding never counts
    for g, (ids, mask) in enumerate(calls):
        outputs = {}
        for k in range(len(methods)):
            method = methods[(g + k) % len(methods)]  # the order rotates batch by batch
            if args.sample_seed is not None:
                torch.manual_seed(args.sample_seed + g)
            started = time.perf_counter()
            out = models[method].generate(ids, attention_mask=mask, max_new_tokens=args.tokens,
                                          assistant=METHODS[method.removesuffix(BF16)].assistant,
                                          **GENERATE.get(method, {}), **sampling)
            seconds[method] += time.perf_counter() - started
            counters[method] += models[method].specfit.stats.last_generate
            outputs[method] = out
            tokens_out[method] += new_tokens(out, ids.shape[1], models[method].generation_config)
        if args.sample_seed is None:
            check_lossless(cell, g, outputs, reference, ids, mask, args.tokens)
    return figures(args, cell, len(calls), seconds, counters, tokens_out, acceptance)


def check_lossless(cell: Cell, g: int, outputs: dict, reference, ids, mask, tokens: int) -> None:
    """Greedy rows identical across the methods of one model (the bf16 ones apart in an FP8 run), and with
    ``reference`` (transformers' own model) where given: else an AssertionError naming the cell."""
    groups = {}
    for m, out in outputs.items():
        groups.setdefault(m.endswith(BF16), {})[m] = out
    if reference is not None:
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False)
        groups[False]["transformers"] = want
    for group in groups.values():
        base = next(iter(group))
        bad = [m for m, out in group.items() if not torch.equal(out, group[base])]
        if bad:
            raise AssertionError(f"{name_of(cell)}, batch call {g}: greedy rows of {', '.join(bad)} differ from "
                                 f"{base}'s (lossless broken)")


def name_of(cell: Cell) -> str:
    extra = "".join(f", {k} {v}" for k, v in asdict(cell).items()
                    if k in ("link", "policy", "threads") and v not in (1.0, None, 1))
    return f"{cell.workload}, batch {cell.batch}, {cell.slots} slots, lane {cell.lane}{extra}"


def figures(args, cell: Cell, groups: int, seconds: dict, counters: dict, tokens_out: dict, acceptance: dict) -> dict:
    methods = list(seconds)
    tok_s = {m: tokens_out[m] / seconds[m] for m in methods}
    cold = {m: (counters[m].misses + counters[m].host_experts) / max(tokens_out[m], 1) for m in methods}
    sf = counters.get("specfit", Counters())  # the SpecFit columns: the method a user gets, where the run has it
    others = [tok_s[m] for m in methods if not m.startswith("specfit") and m != ORACLE]
    ratio = (lambda a, b: a / b if a is not None and b else None)
    drafting = [m for m in methods if METHODS[m.removesuffix(BF16)].assistant is not None]
    r = {"workload": cell.workload, "batch": cell.batch, "slots": cell.slots, "lane": cell.lane, "groups": groups,
         "tokens": args.tokens, "sampling": args.sample_seed is not None, "tok_s": tok_s, "cold_per_token": cold,
         "specfit_vs_plain": ratio(tok_s.get("specfit"), tok_s.get("ar")),
         "specfit_vs_best": ratio(tok_s.get("specfit"), max(others, default=None)),
         "cold_vs_eagle3": ratio(cold.get("specfit"), cold.get("eagle3")),
         "ways": sf.ways, "plain_row_cycles": sf.plain_row_cycles, "forecast_over_real": sf.forecast_over_real,
         "nodes_per_row_cycle": {m: counters[m].nodes_verified / max(counters[m].batch_row_cycles or
                                                                    counters[m].cycles, 1) for m in drafting}}
    # what a run beyond the lead's batch grid adds (absent there, so its results.json stays as it was)
    extra = {"link": cell.link if cell.link != 1.0 else None, "policy": cell.policy,
             "threads": cell.threads if cell.threads != 1 else None, "fp8": args.fp8 or None,
             "model": args.model, "prompts_file": args.prompts,
             "tok_s_excl_measurement": {m: tokens_out[m] / max(seconds[m] - c.measurement_seconds, 1e-9)
                                        for m, c in counters.items() if c.measurement_seconds > 0} or None,
             "acceptance": {m: calibration(log) for m, log in acceptance.items()} or None,
             "expected_over_committed": {m: counters[m].expected_over_committed for m in acceptance} or None}
    return r | {k: v for k, v in extra.items() if v is not None}


def calibration(log) -> dict:
    """Per-node calibration of the acceptance a SpecFit method predicted (``reliability.summary``)."""
    from specfit.evaluation.reliability import summary

    s = summary(log)
    s.pop("by_depth_rank", None)
    return s


UNSET = {"link": 1.0, "policy": "default", "threads": 1}  # a column's value where the cell's figures leave it out


def optional_columns(args) -> list[tuple[str, str, int]]:
    """(title, key, width) of the cell columns a run shows beyond the lead's batch grid."""
    cols = [("link", "link", 6)] if list(args.links) != [1.0] else []
    cols += [("policy", "policy", 10)] if args.policies else []
    return cols + ([("thr", "threads", 4)] if list(args.threads) != [1] else [])


def head(args) -> str:
    names = [label(m) for m in args.methods]
    cold = "".join(f"{('cold:' if i == 0 else '') + short:>8}" for i, (_, short) in enumerate(names))
    extra = "".join(f"{t:>{w}}" for t, _, w in optional_columns(args))
    return (f"{'workload':<10}{'B':>3}{'slots':>6} {'lane':<5}{extra}" + "".join(f"{n:>8}" for n, _ in names)
            + f"{'/plain':>8}{'/best':>8}{cold}{'fc/clk':>7}  SpecFit's ways")


def line(args, r: dict) -> str:
    t, c = r["tok_s"], r["cold_per_token"]
    show = (lambda x, width=8: f"{'-' if x is None else f'{x:.2f}':>{width}}")
    extra = "".join(f"{r.get(key, UNSET[key])!s:>{w}}" for _, key, w in optional_columns(args))
    return (f"{r['workload'][:10]:<10}{r['batch']:>3}{r['slots']:>6} {r['lane']:<5}{extra}"
            + "".join(f"{t[m]:>8.2f}" for m in args.methods) + show(r["specfit_vs_plain"]) + show(r["specfit_vs_best"])
            + "".join(f"{c[m]:>8.1f}" for m in args.methods) + show(r["forecast_over_real"], 7) + f"  {r['ways']}")


def setting(args) -> str:
    """The first line of a run: what it ran on (emulated figures say so)."""
    if args.model is None:
        link = ("emulated default link" if list(args.links) == [1.0] else
                "emulated link at 'link' x the structural default (0: none)")
        fp8 = "; FP8 experts (a -bf16 method: the bf16 model)" if args.fp8 else ""
        return f"CPU, embedded model, {link} (and host lane where 'host'){fp8}: not GPU speed"
    if device() == "cuda":
        return f"{torch.cuda.get_device_name()}, {args.model}: real copies and host lane"
    link = f"emulated link, {args.link_ms:g} ms per expert copy" if args.link_ms else "no emulated link"
    return f"CPU, {args.model}, {link}: not GPU speed"


def run_grid(args) -> list[dict]:
    """Every cell of the run in turn, each printed as it finishes; the list of their figures."""
    print(setting(args), flush=True)
    print(head(args), flush=True)
    results = []
    for cell in args.cells:
        results.append(run_cell(args, cell))
        print(line(args, results[-1]), flush=True)
        if args.acceptance:
            for m, s in results[-1]["acceptance"].items():
                if not s["labels"]:  # the paper's reward labels nothing: no calibrated estimates to judge
                    print(f"  {m}: no labelled children (its acceptance is not the calibrated model's)", flush=True)
                    continue
                print(f"  {m}: per-node ECE calibrated {s['ece_calibrated']:.3f}, raw draft probabilities "
                      f"{s['ece_raw']:.3f}, floor {s['ece_floor']:.3f} ({s['labels']} labels); expected / committed "
                      f"{results[-1]['expected_over_committed'][m]:.2f}", flush=True)
    return results
