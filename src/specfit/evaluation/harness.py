"""Side-by-side measurement of decoding methods on the embedded model: the shared core of ``specfit demo`` and
``specfit bench``.

A *method* is a row of the paper's table: ``ar`` (no assistant), ``eagle3-vanilla`` (EAGLE-3 with the slot cache
cleared before every forward), ``eagle3`` (EAGLE-3 with the cache) and ``specfit`` (SpecFit with the same cache and
the defaults a user gets: deployable routes). Each method runs on its own model instance, so caches never mix, and
the methods take turns prompt by prompt, so a slow stretch of a noisy machine hits them all alike. Every tok/s is
wall clock of the decode phase (prefill excluded; shown apart). ``specfit-oracle`` is the paper's measurement (exact
routes from an extra target forward): its tok/s includes the oracle's forwards, and the figure without them is shown
beside it, labelled as such.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..stats.counters import Counters

if TYPE_CHECKING:  # annotations only: the module is imported to parse the commands' options, without torch
    import torch

ORACLE = "acceptance-oracle"  # the assistant decoding/oracle.py registers (imported where methods run: it needs torch)


@dataclass(frozen=True)
class Method:
    label: str
    assistant: str | None
    cleared: bool = False  # slot cache emptied before every forward (the paper's "vanilla")
    options: tuple = ()  # decoding options, as (name, value) pairs
    generate: tuple = ()  # generate() keywords of the method, as (name, value) pairs
    cold: str | None = None  # where its cold experts are computed (enable's cold=); None: the default


METHODS = {
    "ar": Method("AR", None),
    "eagle3-vanilla": Method("EAGLE-3 vanilla", "eagle3", cleared=True),
    "eagle3": Method("EAGLE-3 + cache", "eagle3"),
    "specfit": Method("SpecFit + cache", "specfit"),  # the default: deployable routes (a predictor, else the gates)
    # the paper's reward (1 + sum of path probabilities) instead of the calibrated acceptance model's path values
    "specfit-paper": Method("SpecFit, paper reward", "specfit", options=(("acceptance", "paper"),)),
    # exact routes from an extra target forward per drafted level: the paper's measurement device
    "specfit-oracle": Method("SpecFit, exact routes*", "specfit", options=(("route_source", "oracle"),)),
    # variants: each route source on its own, prefetch, and the paper's demand-only cost
    "specfit-gate": Method("SpecFit, gate routes", "specfit", options=(("route_source", "gate"),)),
    "specfit-predictor": Method("SpecFit, predictor", "specfit", options=(("route_source", "predictor"),)),
    "specfit-prefetch": Method("SpecFit, pred.+prefetch", "specfit",
                               options=(("route_source", "predictor"), ("prefetch", True))),
    "specfit-paper-cost": Method("SpecFit, paper cost", "specfit", options=(("cost", "paper"),)),
    # SpecFit's rule every cycle on the profile as calibrated: no online refresh, no guard (issue 38's defaults off)
    "specfit-rule": Method("SpecFit, rule alone", "specfit", options=(("cost_refresh", False), ("guard", False))),
    # transformers' own prompt-lookup decoding on the same offloaded model: what a user tries first, no drafter
    "prompt-lookup": Method("Prompt lookup (10)", None, generate=(("prompt_lookup_num_tokens", 10),)),
    # every cold expert copied, beside a host lane (cold="copy": SpecFit before the host lane), or computed on it
    "ar-copy": Method("AR, copies only", None, cold="copy"),
    "eagle3-copy": Method("EAGLE-3, copies only", "eagle3", cold="copy"),
    "specfit-copy": Method("SpecFit, copies only", "specfit", cold="copy"),
    "ar-host": Method("AR, host only", None, cold="host"),
    # the limit of any subtree rule: verifies the path the target accepts, found by a look-ahead (decoding/oracle)
    ORACLE: Method("Acceptance oracle*", ORACLE),
}
PAPER_METHODS = ("ar", "eagle3-vanilla", "eagle3", "specfit")
LABELS = {name: m.label for name, m in METHODS.items()}
ASSISTANT = {name: m.assistant for name, m in METHODS.items()}
GENERATE = {name: dict(m.generate) for name, m in METHODS.items()}



def link_seconds(link_ms: float | None):
    """(``LinkConfig``, how it was set) of the emulated link for a demo or bench run: ``--link-ms`` when given, else
    the embedded model's structural default (``embedded.default_link``: a token's full expert demand costs 1.4x its
    compute on this machine, as on the paper's A100), measured once per machine and kept (``embedded.link_store``)."""
    from .. import embedded
    from ..offload.link import LinkConfig

    if link_ms is not None:
        return LinkConfig(seconds_per_expert=link_ms / 1e3), "given (--link-ms)"
    return embedded.default_link(), embedded.default_link_note()


@dataclass
class Row:
    method: str
    workload: str
    slots: str  # "24" .. or "none" (cleared before every forward)
    regime: str  # "no link" | "emulated link"
    prompts: int
    new_tokens: int
    tok_s: float  # wall clock of the decode phase, everything the calls did after their prefill
    nodes_per_cycle: float
    tokens_per_cycle: float
    cycle_ms: float
    copies_per_token: float
    hit_rate: float
    prefetch_per_token: float  # prefetch copies per output token (included in copies_per_token)
    prefetch_wasted_per_token: float
    measurement_s: float  # the route oracle's forwards (included in tok_s's time)
    tok_s_excluding_measurement: float  # the paper's figure: tok/s with the oracle's time taken out
    prefill_s: float
    end_to_end_tok_s: float  # prefill included
    expected_over_committed: float = 0.0  # the assistant's expected committed tokens / the tokens committed
    call_tok_s: float = 0.0  # new tokens over the wall clock of the whole generate() calls (what a stopwatch reads)
    forecast_over_real: float | None = None  # the cost model's predicted seconds / decode seconds (None: no forecast)
    mib_per_token: float = 0.0  # MiB copied host-to-device per new token
    copy_wait_share: float = 0.0  # share of decode time the host was blocked by copies (see Counters.copy_wait_share)
    hits_per_token: float = 0.0  # experts found in a slot per new token
    host_per_token: float = 0.0  # experts computed on the host lane per new token
    host_wait_share: float = 0.0  # share of decode time the host waited for the host lane

    @classmethod
    def of(cls, method, workload, slots, regime, prompts, c: Counters, call_seconds: float = 0.0) -> "Row":
        per_token = (lambda x: x / c.new_tokens) if c.new_tokens else (lambda x: 0.0)
        return cls(method, workload, slots, regime, prompts, c.new_tokens, c.tokens_per_second, c.nodes_per_cycle,
                   c.tokens_per_cycle, c.seconds_per_cycle * 1e3, c.copies_per_token, c.hit_rate,
                   per_token(c.prefetch_copies), per_token(c.prefetch_wasted), c.measurement_seconds,
                   c.tokens_per_second_excluding_measurement, c.prefill_seconds, c.end_to_end_tokens_per_second,
                   c.expected_over_committed, c.new_tokens / call_seconds if call_seconds else 0.0,
                   c.forecast_over_real, c.mib_copied_per_token, c.copy_wait_share, c.hits_per_token,
                   c.host_experts_per_token, c.host_wait_share)

    def as_dict(self) -> dict:
        return asdict(self)


def load_instances(methods, slots: int | None, link, prepare=None, fp8: bool = False,
                   host=None) -> tuple[dict, object]:
    """One enabled embedded model per method. ``slots=None``: no cache (every forward cleared). ``link``: a
    ``LinkConfig``, seconds per expert copy, or None. ``host``: an emulated host lane (``HostConfig``) or None; a
    method's ``cold`` (else the default: ``"auto"`` with a lane). ``prepare(model, method)`` runs before the method's
    decoding options are set (``specfit bench`` calibrates a missing cost profile there)."""
    from transformers import AutoConfig

    from .. import embedded
    from ..offload.link import LinkConfig
    from ..patch import configure

    out = {}
    for name in methods:
        method = METHODS[name]
        n = slots if slots is not None else AutoConfig.from_pretrained(embedded.TARGET_DIR).num_experts
        if isinstance(link, (int, float)):
            link = LinkConfig(seconds_per_expert=link) if link else None
        model, tokenizer = embedded.load(n, cache_mode="cleared" if method.cleared or slots is None else "cached",
                                         link=link, host=host, cold=method.cold,
                                         fp8=fp8)  # fp8: the FP8 variant (embedded.fp8)
        if prepare is not None:
            prepare(model, method)
        if method.options:
            configure(model, **dict(method.options))
        out[name] = model
    return out, tokenizer


@dataclass
class Runs:
    """What ``interleave`` measured, per method: summed decode-phase counters (``last_generate`` of each measured
    call), summed wall clock of the measured ``generate()`` calls (whole calls, prefill included), and the new
    tokens of every prompt (measured or not)."""

    counters: dict[str, Counters]
    seconds: dict[str, float]
    calls: dict[str, int]
    outputs: dict[str, list[torch.Tensor]]


def interleave(models: dict, prompt_ids: list[torch.Tensor], max_new_tokens: int, *, assistants: dict | None = None,
               skip: int = 0, warmup_tokens: int = 0, check_lossless: bool = True, on_prompt=None, batch: int = 1,
               runs: Runs | None = None, **generate_kwargs) -> Runs:
    """Every prompt with every method in turn (prompt 0 by each method, then prompt 1, ...), so a slow stretch of a
    noisy machine hits all methods alike. ``models`` maps a method to its model (one model may serve several);
    ``assistants`` maps it to the ``assistant=`` value (default: the harness's methods). ``skip``: prompts at the
    start left out of the figures (unless there are no more). ``warmup_tokens``: first one untimed call per method
    on prompt 0 with that many tokens (one-time costs stay out of the figures). ``check_lossless``: every method must
    produce the first method's tokens (greedy decoding). ``batch``: prompts go in left-padded batches of that many
    (``batches.left_padded``), one ``generate()`` call per batch; ``skip`` and ``on_prompt`` then count batches.
    ``runs``: an empty ``Runs`` to fill, which holds what was measured so far when a call is interrupted (Ctrl-C)."""
    import torch

    from ..decoding import oracle  # noqa: F401  registers the "acceptance-oracle" assistant, a method above
    from .batches import left_padded, pad_id

    assistants = assistants if assistants is not None else {m: ASSISTANT[m] for m in models}
    own = {m: GENERATE.get(m, {}) if isinstance(m, str) else {} for m in models}  # a method's own keywords
    generate_kwargs.setdefault("do_sample", False)
    runs = runs if runs is not None else Runs({}, {}, {}, {})
    for m in models:
        runs.counters[m], runs.seconds[m], runs.calls[m], runs.outputs[m] = Counters(), 0.0, 0, []
    calls = [(ids, {}) for ids in prompt_ids] if batch == 1 else \
        [(ids, {"attention_mask": mask}) for ids, mask in left_padded(prompt_ids, batch, pad_id(next(iter(
            models.values()))))]
    if warmup_tokens and calls:
        for method, model in models.items():
            model.generate(calls[0][0], max_new_tokens=warmup_tokens, assistant=assistants[method],
                           **calls[0][1], **generate_kwargs, **own[method])
    for i, (ids, extra) in enumerate(calls):
        for method, model in models.items():
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens, assistant=assistants[method], **extra,
                                 **generate_kwargs, **own[method])
            seconds = time.perf_counter() - started
            if i >= skip or len(calls) <= skip:
                runs.counters[method] += model.specfit.stats.last_generate
                runs.seconds[method] += seconds
                runs.calls[method] += 1
            runs.outputs[method].append(out[:, ids.shape[1]:] if batch > 1 else out[0, ids.shape[1]:])
        first = next(iter(models))
        reference = runs.outputs[first][-1]
        for method in models if check_lossless else ():
            if not torch.equal(runs.outputs[method][-1], reference):
                raise AssertionError(f"{method} produced different greedy tokens than {first} on prompt {i}: "
                                     f"lossless decoding is broken")
        if on_prompt is not None:
            on_prompt(i)
    return runs


def run_side_by_side(instances: dict, prompt_ids: list[torch.Tensor], max_new_tokens: int, warmup: int = 1,
                     on_prompt=None) -> tuple[dict[str, Counters], dict[str, list[torch.Tensor]]]:
    """Greedy decoding of every prompt with every method in turn; returns the summed decode-phase counters and the
    generated tokens of each method (``warmup``: prompts at the start left out of the counters)."""
    runs = interleave(instances, prompt_ids, max_new_tokens, skip=warmup, on_prompt=on_prompt)
    return runs.counters, runs.outputs


def side_by_side(instances: dict, prompt_ids: list[torch.Tensor], max_new_tokens: int, warmup: int = 1,
                 on_prompt=None, batch: int = 1) -> Runs:
    """As ``run_side_by_side``, returning the ``Runs`` (whole-call wall clock included); ``batch``: prompts per
    generate() call, left-padded."""
    return interleave(instances, prompt_ids, max_new_tokens, skip=warmup, on_prompt=on_prompt, batch=batch)


def token_compute_seconds(model, ids: torch.Tensor, repeats: int = 20) -> float:
    """Median time of one decode forward with every expert resident and no link (the compute of one token)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        times = []
        token = ids[:, -1:]
        for _ in range(repeats + 3):
            t0 = time.perf_counter()
            model(token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)
    times = sorted(times[3:])
    return times[len(times) // 2]


LEGEND = ("call tok/s: new tokens per second of whole generate() calls, wall clock (what a stopwatch around the "
          "calls reads: prefill and everything included)",
          "tok/s: new tokens per second of decoding, wall clock (prefill excluded)",
          "nodes/cyc: draft nodes verified per decoding cycle (EAGLE-3 always verifies 7)",
          "tok/cyc: tokens committed per cycle (accepted draft tokens + 1 bonus token; AR: 1)",
          "cycle ms: wall clock per cycle (AR: per token)",
          "copies/tok: host-to-device expert copies per new token (slot-cache misses + prefetches)",
          "exp/real: tokens the assistant expected its cycles to commit over those committed (EAGLE-3: its path "
          "probabilities; SpecFit: its selector's expected tokens; 1.00 is right on average)",
          "fcst/real: seconds SpecFit's cost model predicted for its cycles over the decode time (1.00: the time "
          "forecast matches the clock; -: the method forecasts no time)",
          "MiB/tok: MiB copied host-to-device per new token; hit rate: experts needed that were already in a slot",
          "copy wait: share of decode time the host was blocked by copies (CPU, emulated link included: the whole "
          "stall; CUDA: the issue time only, the device-side wait is in tok/s)",
          "hits/tok, host/tok, host wait (with a host lane): experts per token found in a slot and computed on the "
          "host lane, and the share of decode time the host waited for the lane (CPU: an emulated lane)")


def format_table(rows: list[Row], title: str) -> str:
    measured = any(r.measurement_s > 0 for r in rows)
    hosted = any(r.host_per_token for r in rows)
    head = (f"{'method':<25}{'call tok/s':>11}{'tok/s':>8}{'nodes/cyc':>11}{'tok/cyc':>9}{'cycle ms':>10}"
            f"{'copies/tok':>12}{'MiB/tok':>9}{'copy wait':>11}{'hit rate':>10}{'exp/real':>10}{'fcst/real':>11}")
    head += f"{'hits/tok':>10}{'host/tok':>10}{'host wait':>11}" if hosted else ""
    head += f"{'tok/s excl. oracle*':>21}" if measured else ""
    lines = [title, head, "-" * len(head)]
    for r in rows:
        line = (f"{LABELS[r.method]:<25}{r.call_tok_s:>11.1f}{r.tok_s:>8.1f}{r.nodes_per_cycle:>11.2f}"
                f"{r.tokens_per_cycle:>9.2f}{r.cycle_ms:>10.1f}{r.copies_per_token:>12.1f}{r.mib_per_token:>9.2f}"
                f"{r.copy_wait_share:>11.1%}{r.hit_rate:>10.1%}{r.expected_over_committed:>10.2f}"
                f"{'-' if r.forecast_over_real is None else f'{r.forecast_over_real:.2f}':>11}")
        if hosted:
            line += f"{r.hits_per_token:>10.1f}{r.host_per_token:>10.1f}{r.host_wait_share:>11.1%}"
        if measured:
            line += f"{r.tok_s_excluding_measurement:>21.1f}" if r.measurement_s > 0 else f"{'':>21}"
        lines.append(line)
    if measured:
        lines.append("* exact routes from an extra target forward per drafted level (the paper's measurement "
                     "device, not deployable); its tok/s includes those forwards, the last column leaves them out")
    return "\n".join(lines)


# The paper's figures (Qwen3-30B-A3B-Instruct-2507, A100 PCIe 40GB, 48 slots of 128, batch 1), for reference only.
PAPER = {
    "cnn": {"ar": 4.67, "eagle3-vanilla": 4.21, "eagle3": 6.80, "specfit": 8.27,
            "nodes": {"eagle3": 7.00, "specfit": 2.88}, "tokens": {"eagle3": 2.54, "specfit": 2.21},
            "cycle_ms": {"eagle3": 371.7, "specfit": 265.8}, "copies": {"eagle3": 73.4, "specfit": 57.2}},
    "gsm8k": {"ar": 4.70, "eagle3-vanilla": 6.26, "eagle3": 10.08, "specfit": 10.79,
              "nodes": {"eagle3": 7.00, "specfit": 5.09}, "tokens": {"eagle3": 4.35, "specfit": 4.01},
              "cycle_ms": {"eagle3": 429.8, "specfit": 370.4}, "copies": {"eagle3": 92.7, "specfit": 82.0}},
    "gain_by_slots": {"48": 21.6, "24": 24.3, "12": 29.2, "none": 31.6},
}


def paper_table() -> str:
    lines = ["The paper's figures, for reference (Qwen3-30B-A3B on an A100 PCIe 40GB, 48 of 128 slots) - not ours:",
             f"{'workload':<9}{'method':<17}{'tok/s':>8}{'nodes/cyc':>11}{'tok/cyc':>9}{'cycle ms':>10}"
             f"{'copies/tok':>12}"]
    for w in ("cnn", "gsm8k"):
        p = PAPER[w]
        for m in PAPER_METHODS:
            extra = (f"{p['nodes'][m]:>11.2f}{p['tokens'][m]:>9.2f}{p['cycle_ms'][m]:>10.1f}{p['copies'][m]:>12.1f}"
                     if m in p["nodes"] else f"{'':>11}{'':>9}{'':>10}{'':>12}")
            lines.append(f"{w:<9}{LABELS[m]:<17}{p[m]:>8.2f}{extra}")
    g = PAPER["gain_by_slots"]
    lines.append("SpecFit over cached EAGLE-3 by slots (48/24/12/none of 128): "
                 + ", ".join(f"{k}: +{v}%" for k, v in g.items()))
    return "\n".join(lines)
