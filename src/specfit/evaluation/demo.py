"""``specfit demo``: the embedded model with offloaded experts on the CPU, decoded by AR, EAGLE-3 and SpecFit.

Prints the generated text once (all three produce the same tokens: decoding is lossless), a table that fits a
terminal (wall-clock tok/s, against AR, against EAGLE-3, tokens committed per cycle, expert copies per token; every
column of ``specfit.compare`` with ``--wide``), with a legend, and a verdict per workload read from that table's
tok/s: SpecFit against AR and against EAGLE-3, each with the prompt-to-prompt spread of this run. The
measurement is ``specfit.compare`` (the methods interleaved prompt by prompt, whole generate() calls timed). SpecFit
runs with the defaults a user gets (deployable routes from the drafter's trained route predictor). The host link is
emulated (every expert copy costs a set time), so the figures show the offload regime on a CPU; they are not GPU
speed.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings

from .. import cli_checks
from .verdict import percent

METHODS = ("ar", "eagle3", "specfit")
YOURS = "yours"  # the workload of --prompt TEXT
WORKLOADS = {"gsm8k": "GSM8K", "cnn": "CNN/DailyMail", YOURS: "your prompts"}
LABELS = {"ar": "AR", "eagle3": "EAGLE-3", "specfit": "SpecFit"}

# used only when neither the local data folder nor the hub can provide GSM8K / CNN prompts (as many as --num-prompts
# asks by default, so the verdict's spread comes from the same number of prompts either way)
FALLBACK = {
    "gsm8k": [f"Question: {q}\nAnswer:" for q in (
        "Tom has 3 boxes with 12 apples in each box. He gives away 10 apples. How many apples does he have left?",
        "A train travels 60 km in one hour. How far does it travel in 3 hours and 30 minutes?",
        "Sara buys 4 notebooks at 3 dollars each and a pen for 2 dollars. She pays with a 20 dollar bill. How much "
        "change does she get?",
        "A class has 28 students. Half of them play football and a quarter of them play chess. How many students "
        "play neither, if nobody plays both?")],
    "cnn": [f"Article: {a}\nSummary:" for a in (
        "The city council voted on Tuesday to extend the opening hours of the public library, after a year in which "
        "the number of visitors doubled. The library will now stay open until nine in the evening on weekdays.",
        "A small fishing boat with four crew members was rescued off the coast on Sunday after its engine failed in "
        "rough weather. The coast guard said all four were in good health and the boat was towed back to harbour.",
        "The national museum will reopen its west wing next month after a two-year renovation that replaced the "
        "roof and added new rooms for the collection of ancient coins, the museum's director said on Friday.",
        "Heavy rain caused flooding in several towns in the north of the country on Wednesday, closing roads and "
        "schools. Officials said the water was expected to go down by the weekend and no injuries were reported.")],
}


def add_arguments(p) -> None:
    p.add_argument("--num-prompts", type=int, default=4,
                   help="prompts per workload (GSM8K and CNN/DailyMail); the verdict's spread is over them")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="decode your own prompt instead of the workloads (repeat for several)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")
    from ..embedded import DEMO_SLOTS

    p.add_argument("--slots", type=int, default=DEMO_SLOTS,
                   help=f"expert slots per layer of 64 ({DEMO_SLOTS}: where copies dominate, as in the paper's 24 of "
                        f"128)")
    p.add_argument("--link-ms", type=float, default=None,
                   help="emulated ms per expert copy (default: the structural default link, a token's full expert "
                        "demand at 1.4x its compute as on the paper's A100: measured on this machine's first run, "
                        "then kept in the user cache; `specfit calibrate` measures it again)")
    p.add_argument("--host-ratio", type=float, default=None, metavar="RATIO",
                   help="emulated host lane: the host reads experts RATIO x as fast as the link copies them (default "
                        "2.5, a PCIe 4.0 host: specfit.embedded.default_host); 0: no host lane, every expert that "
                        "misses the slot cache is copied")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    p.add_argument("--fp8", action="store_true", help="the FP8 variant of the embedded model (experts as FP8)")
    p.add_argument("--wide", action="store_true",
                   help="every column of specfit.compare: the default table's (tok/s, vs AR, vs EAGLE-3, tok/cyc, "
                        "copies/tok) and nodes per cycle, forecasts, MiB, waits, hit rate, host lane")


def check_arguments(args) -> None:
    """Every option, before anything loads (no torch imported): a refusal names the value and the valid range."""
    num_experts = cli_checks.experts_per_layer(_config())
    if not 1 <= args.slots <= num_experts:
        raise ValueError(f"--slots must be in 1..{num_experts} (the embedded model's experts per layer), got "
                         f"{args.slots}")
    cli_checks.at_least(args, 1, "num_prompts", "max_new_tokens", "threads")
    cli_checks.milliseconds(args, "link_ms")
    host_ratio = getattr(args, "host_ratio", None)
    if host_ratio is not None and not (math.isfinite(host_ratio) and host_ratio >= 0):
        raise ValueError(f"--host-ratio must be a finite number >= 0 (the host's expert bandwidth as a multiple of "
                         f"the link's; 0: no host lane), got {host_ratio}")
    if host_ratio and args.link_ms == 0:
        raise ValueError("--host-ratio scales the host lane to the link, and --link-ms 0 makes copies free: give "
                         "--host-ratio 0 (no host lane) with a free link")
    if args.prompt is not None and not all(text.strip() for text in args.prompt):
        raise ValueError("--prompt needs a non-empty TEXT")
    args.link_given = args.link_ms is not None  # main replaces link_ms with the link's ms, given or not


def _config() -> dict:
    from ..embedded.paths import TARGET_DIR

    return json.loads((TARGET_DIR / "config.json").read_text())


def workload_prompts(args) -> tuple[dict[str, list[str]], str | None]:
    """The prompts of each workload, and the one note to print when the data could not be read (None if it was)."""
    from . import datasets

    if args.prompt is not None:
        return {YOURS: list(args.prompt)}, None
    out, missing = {}, None
    for workload in ("gsm8k", "cnn"):
        try:
            out[workload] = datasets.prompts(workload, args.num_prompts, max_chars=1200)
        except datasets.DataUnavailable:
            out[workload] = FALLBACK[workload][:args.num_prompts]
            missing = (f"note: the GSM8K and CNN/DailyMail test prompts could be read from neither place SpecFit "
                       f"reads data from: a local data folder ($SPECFIT_DATA_DIR, else shared/data in or above the "
                       f"working directory, as the README's ../shared/data), else the Hugging Face hub through "
                       f"`datasets`. The demo uses its {len(FALLBACK[workload])} built-in prompts per workload "
                       f"instead. {datasets.WHERE_TO_GET}")
    return out, missing


def main(args) -> int:
    import torch

    from . import comparison
    from .harness import load_instances

    started = time.time()
    config = _config()
    experts = cli_checks.experts_per_layer(config)
    texts, missing = workload_prompts(args)
    torch.set_num_threads(args.threads)  # this command owns its process: the count that suits the model (--threads)
    link, how, host = settings(args)
    print(f"SpecFit demo: the embedded Qwen3-MoE{' (FP8 variant)' if args.fp8 else ''} ({experts} "
          f"experts, top-{config['num_experts_per_tok']}, {config['num_hidden_layers']} layers) with its EAGLE-3 "
          f"drafter, experts in host memory, {args.slots} slots per layer, CPU with an emulated host link of "
          f"{args.link_ms:.3f} ms per expert copy ({how}; emulated: not GPU speed), {args.threads} CPU "
          f"thread{'s' if args.threads != 1 else ''} (--threads).")
    print(host_line(host))
    print(same_as_elsewhere(args))
    print("The embedded model is a small model trained by this project only to show the method: its text is not "
          "meant to be good. What matters is that all three methods write the same tokens, and how fast.")
    print(f"Where SpecFit pays: when expert copies are dear - few slots per layer (here {args.slots} of "
          f"{experts}) and a slow host link (here {args.link_ms:.3f} ms per copy) - it verifies only the draft nodes "
          f"worth the experts they bring in; with every expert resident or a free link it has nothing to save. "
          f"How many experts per token it copied here against EAGLE-3, each workload's verdict says.\n")
    if missing:
        print(missing + "\n")
    total = sum(len(prompts) for prompts in texts.values())
    print(f"Decoding {total} prompt{'s' if total != 1 else ''} x {len(METHODS)} methods, {args.max_new_tokens} new "
          f"tokens each, the methods taking turns prompt by prompt (a line per prompt below; on a busy CPU a prompt "
          f"can take a minute; Ctrl-C stops and keeps the prompts done).", flush=True)
    tables, verdicts, stopped = [], [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        print(f"loading the embedded model once per method ({', '.join(LABELS[m] for m in METHODS)}) ...", flush=True)
        instances, tokenizer = load_instances(list(METHODS), args.slots, link, fp8=args.fp8, host=host)
        for workload, prompts in texts.items():
            name = WORKLOADS[workload]
            per_prompt = {m: [] for m in METHODS}

            def on_prompt(i):  # each method has its own model: its last call is this prompt's
                for m in METHODS:
                    per_prompt[m].append(instances[m].specfit.stats.last_generate.end_to_end_tokens_per_second)
                print(f"  [{name}] prompt {i + 1} of {len(prompts)}: "
                      + ", ".join(f"{LABELS[m]} {per_prompt[m][-1]:.1f}" for m in METHODS)
                      + f" tok/s ({time.time() - started:.0f} s so far)", flush=True)

            print(f"[{name}] warming up each method on its first prompt (untimed) ...", flush=True)
            try:
                result = comparison.run(instances, tokenizer, prompts, METHODS, max_new_tokens=args.max_new_tokens,
                                        on_prompt=on_prompt)
            except comparison.Interrupted as stop:
                result, stopped = stop.partial, f"[{name}] {stop}"
            if result is not None:
                _show_text(name, prompts, result, tokenizer)
                rows = result.rows()
                verdicts.append(f"  {name}: {table_verdict(rows, per_prompt)}; {copies_said(rows)}")
                title = (f"[{name}] {args.slots} slots of {experts}, CPU, emulated host link"
                         f"{' and host lane' if host else ''} (not GPU speed), {result.prompts}"
                         f"{f' of {len(prompts)}' if result.interrupted else ''} "
                         f"prompt{'s' if len(prompts) != 1 else ''}{' (interrupted)' if result.interrupted else ''}")
                tables.append(result.format(title) if getattr(args, "wide", False) else narrow_table(rows, title))
            if stopped:
                break
    _report(args, tables, verdicts, caught, started)
    if stopped:
        raise KeyboardInterrupt(f"{stopped}; the tables above hold the prompts every method finished")
    return 0


def settings(args):
    """(link, how it was set, host lane) of this run: ``specfit.embedded.demo_settings(--slots)`` unless
    ``--link-ms`` or ``--host-ratio`` change them; ``args.link_ms`` is set to the link's ms per bf16 expert for the
    header."""
    from .. import embedded
    from .harness import link_seconds

    if args.link_ms is None and not embedded.default_link_known():
        print("measuring the default emulated link once for this machine (each part of a forward at its fastest; "
              "kept for the next runs) ...", flush=True)
    if args.link_ms is None and args.host_ratio is None:
        chosen = embedded.demo_settings(args.slots)
        link, host, how = chosen["link"], chosen["host"], embedded.default_link_note()
    else:
        link, how = link_seconds(args.link_ms)
        host = host_lane(args, link)
    args.link_ms = embedded.link_seconds_per_expert(link) * 1e3  # per bf16 expert (the default link is per byte)
    return link, how, host


def same_as_elsewhere(args) -> str:
    """Whether this run's configuration is the one the README's snippet and table and the quickstart notebook run
    (``specfit.embedded.demo_settings()``), and where it differs."""
    from .. import embedded

    changed = [f"--slots {args.slots}"] if args.slots != embedded.DEMO_SLOTS else []
    changed += ["--link-ms"] if getattr(args, "link_given", False) else []
    if getattr(args, "host_ratio", None) not in (None, embedded.HOST_TO_LINK):
        changed.append(f"--host-ratio {args.host_ratio:g}")
    changed += ["--fp8"] if args.fp8 else []
    if not changed:
        return (f"Configuration: specfit.embedded.demo_settings() ({embedded.DEMO_SLOTS} slots, the default link and "
                f"host lane), as the README's snippet and results table and examples/quickstart.ipynb run it.")
    return (f"Configuration: NOT the README's and the notebook's (specfit.embedded.demo_settings()): this run "
            f"changes {', '.join(changed)}.")


def copies_said(rows: list[dict]) -> str:
    """What the table says about expert copies per token: SpecFit's against EAGLE-3's (and AR's).

    >>> copies_said([dict(method="ar", copies_per_token=9.0), dict(method="eagle3", copies_per_token=12.0),
    ...              dict(method="specfit", copies_per_token=13.5)])
    'SpecFit copied 13.50 experts per token, more than EAGLE-3 (12.00; AR 9.00)'
    """
    copies = {r["method"]: r["copies_per_token"] for r in rows}
    ours, theirs = copies.get("specfit"), copies.get("eagle3")
    if ours is None or theirs is None:
        return "copies per token: see the table"
    how = "fewer than" if ours < theirs else "more than" if ours > theirs else "as many as"
    ar = f"; AR {copies['ar']:.2f}" if "ar" in copies else ""
    return f"SpecFit copied {ours:.2f} experts per token, {how} EAGLE-3 ({theirs:.2f}{ar})"


def _show_text(name: str, prompts: list[str], result, tokenizer) -> None:
    text, out = prompts[0], result.outputs["ar"][0]
    print(f"\n--- {name}: prompt 1 of {len(prompts)} ---\n{_clip(text)}\n--- generated (identical for AR, "
          f"EAGLE-3 and SpecFit) ---\n{tokenizer.decode(out, skip_special_tokens=True).strip()}\n")


def _report(args, tables: list[str], verdicts: list[str], caught, started: float) -> None:
    """The tables, their legend, the profile notes and the verdict of each workload measured."""
    from . import comparison

    for table in tables:
        print(table + "\n")
    print("\n".join(comparison.LEGEND if getattr(args, "wide", False) else NARROW_LEGEND))
    print("AR: plain generate(); EAGLE-3: its tree, 7 nodes verified; SpecFit: the subtree that maximises predicted "
          "tokens per second (default routes: the trained route predictor)\n")
    for message in notes(caught):
        print(f"note: {message}")
    print("Verdict of this run (the table's whole-call tok/s; spread: the standard deviation over prompts of "
          "SpecFit's per-prompt ratio to that method, so a difference inside it is not a clear one):")
    print("\n".join(verdicts) if verdicts else "  (no workload finished)")
    print(f"({time.time() - started:.0f} s in all. Your own prompt: specfit demo --prompt TEXT; in Python: "
          f"specfit.compare(model, tokenizer, prompts) on your own model; `specfit bench` runs the full table.)")


NARROW_LEGEND = (
    "tok/s: new tokens per second, wall clock of the whole generate() calls (what a stopwatch reads); vs AR, "
    "vs EAGLE-3: that tok/s over theirs",
    "tok/cyc: tokens committed per cycle (accepted draft tokens + 1 bonus token; AR: 1); copies/tok: host-to-device "
    "expert copies per new token",
    "more columns (nodes per cycle, forecasts, MiB, waits, hit rate, host lane): specfit demo --wide")


def narrow_table(rows: list[dict], title: str = "") -> str:
    """The demo's table in under 80 columns: tok/s, against AR and EAGLE-3, tokens per cycle, copies per token.

    >>> rows = [dict(method="ar", label="AR", tok_s=10.0, tokens_per_cycle=1.0, copies_per_token=9.0),
    ...         dict(method="eagle3", label="EAGLE-3", tok_s=12.0, tokens_per_cycle=3.1, copies_per_token=12.0),
    ...         dict(method="specfit", label="SpecFit", tok_s=13.0, tokens_per_cycle=2.4, copies_per_token=8.0)]
    >>> print(narrow_table(rows))
    method                   tok/s     vs AR  vs EAGLE-3  tok/cyc  copies/tok
    -------------------------------------------------------------------------
    AR                        10.0     x1.00       x0.83     1.00        9.00
    EAGLE-3                   12.0     x1.20       x1.00     3.10       12.00
    SpecFit                   13.0     x1.30       x1.08     2.40        8.00
    """
    tok = {r["method"]: r["tok_s"] for r in rows}
    ratio = lambda r, m: "-" if not tok.get(m) else f"x{r['tok_s'] / tok[m]:.2f}"  # noqa: E731
    head = f"{'method':<22}{'tok/s':>8}{'vs AR':>10}{'vs EAGLE-3':>12}{'tok/cyc':>9}{'copies/tok':>12}"
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['label'][:21]:<22}{r['tok_s']:>8.1f}{ratio(r, 'ar'):>10}{ratio(r, 'eagle3'):>12}"
                     f"{r['tokens_per_cycle']:>9.2f}{r['copies_per_token']:>12.2f}")
    return "\n".join(lines)


def table_verdict(rows: list[dict], per_prompt: dict[str, list[float]], ours: str = "specfit") -> str:
    """SpecFit against AR and against EAGLE-3, read from the table's tok/s (``rows``), each with the spread over
    prompts of SpecFit's per-prompt ratio to that method (``per_prompt``: method -> whole-call tok/s per prompt), and
    what that says: faster than both, slower than one, or not clearly different.

    >>> rows = [dict(method="ar", tok_s=10.0), dict(method="eagle3", tok_s=12.0), dict(method="specfit", tok_s=11.0)]
    >>> table_verdict(rows, {"ar": [10, 10], "eagle3": [12, 12], "specfit": [11, 11.2]})
    'SpecFit +10% against AR (spread 1%), -8% against EAGLE-3 (spread 1%), 2 prompts: slower than EAGLE-3 here'
    """
    tok = {r["method"]: r["tok_s"] for r in rows}
    n = len(per_prompt[ours])
    parts, slower, unclear = [], [], []
    for other in (m for m in ("ar", "eagle3") if m in tok and m != ours):
        label = LABELS[other]
        gain = tok[ours] / tok[other] - 1 if tok[other] else 0.0
        spread = statistics.stdev(a / b for a, b in zip(per_prompt[ours], per_prompt[other])) if n > 1 else None
        parts.append(f"{percent(gain)} against {label}" + ("" if spread is None else f" (spread {spread:.0%})"))
        if spread is not None and abs(gain) <= spread:
            unclear.append(label)
        elif gain < 0:
            slower.append(label)
    if slower:
        said = f"slower than {' and '.join(slower)} here"
    elif unclear:
        said = f"not clearly different from {' and '.join(unclear)} here (inside the spread)"
    else:
        said = "faster than both here"
    count = f"{n} prompt{'s' if n != 1 else ''}" + (" (no spread to judge by: use more prompts)" if n == 1 else "")
    return f"{LABELS[ours]} {', '.join(parts)}, {count}: {said}"


def notes(caught) -> list[str]:
    """The cost-profile warnings among ``caught`` (every method model's, every call's), each once, in order."""
    return list(dict.fromkeys(str(w.message) for w in caught if "profile" in str(w.message)))


def host_lane(args, link):
    """The emulated host lane of a demo or bench run: ``--host-ratio`` x the link's bandwidth (default: the
    structural 2.5x), or None (``--host-ratio 0``, or a free link: every cold expert is copied)."""
    from .. import embedded

    ratio = embedded.HOST_TO_LINK if getattr(args, "host_ratio", None) is None else args.host_ratio
    if ratio <= 0 or link is None or not link.copy_time(embedded.bf16_expert_bytes()) > 0:
        return None
    return embedded.default_host(ratio, link)


def host_line(host) -> str:
    """What the host lane is, for the run's header."""
    from .. import embedded

    if host is None:
        return "No host lane (--host-ratio 0): every expert that misses the slot cache is copied over the link.\n"
    ms = host.expert_time(embedded.bf16_expert_bytes(), 1) * 1e3
    return (f"Host lane: {host.label}, {ms:.3f} ms per host expert at one token (emulated: the CPU computes it, the "
            f"lane's time is set); every method computes cold experts where predicted cheaper (cold='auto').\n")


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + " [...]"
