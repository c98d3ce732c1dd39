"""``specfit.compare``: AR, EAGLE-3 and SpecFit (or any registered assistant) side by side on your own prompts.

    table = specfit.compare(model, tokenizer, ["Question: ...\\nAnswer:", ...], max_new_tokens=64)

The methods take turns prompt by prompt (prompt 0 by each method, then prompt 1, ...), so a slow stretch of a busy
machine hits them all alike; each method first makes one short untimed call, so one-time costs stay out of the
figures. ``tok_s`` is wall clock of the whole ``generate()`` calls (what a stopwatch around them reads, prefill
included); the other figures come from ``model.specfit.stats.last_generate`` of each call. Greedy outputs must be
identical across methods (decoding is lossless): a difference stops the comparison.

``specfit demo`` runs this same code on the embedded model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stats.counters import Counters
from .harness import METHODS, Method, interleave

DEFAULT_METHODS = ("ar", "eagle3", "specfit")
WARMUP_TOKENS = 8

# column -> meaning, in table order
COLUMNS = {
    "method": "the method's name (the table's index in a DataFrame)",
    "label": "what the method is",
    "tok_s": "new tokens per second, wall clock of the whole generate() calls (prefill included)",
    "speedup": "tok_s over the first method's (AR with the default methods)",
    "nodes_per_cycle": "draft nodes verified per decoding cycle (AR: 0; EAGLE-3: its 7)",
    "tokens_per_cycle": "tokens committed per cycle: accepted draft tokens + 1 bonus (AR: 1)",
    "copies_per_token": "host-to-device expert copies per new token (slot-cache misses + prefetches)",
    "mib_per_token": "MiB copied host-to-device per new token (every expert copy)",
    "copy_wait_share": "share of decode time the host was blocked by copies (CPU: all the stall, emulated link "
                       "included; CUDA: the issue time only, the device-side wait is in the decode time)",
    "hit_rate": "share of the experts forwards needed that were already in a slot",
    "hits_per_token": "experts already in a slot per new token (computed on the device, nothing copied)",
    "host_per_token": "experts computed on the host lane per new token (cold='host' or 'auto': not in a slot, not "
                      "copied)",
    "host_wait_share": "share of decode time the host waited for the host lane (CPU: an emulated lane, the part of "
                       "its time nothing else hid)",
    "expected_over_committed": "tokens the assistant expected its cycles to commit over those committed (1.0: right "
                               "on average; AR: 1)",
    "forecast_over_real": "seconds the cost model predicted for the cycles over the decode time (1.0: the time "
                          "forecast matches the clock); None where the method forecasts no time (AR, EAGLE-3)",
    "decode_tok_s": "new tokens per second of the decode phase alone (prefill excluded), from the stats",
    "new_tokens": "tokens generated, summed over the prompts",
    "seconds": "wall clock of the whole generate() calls, summed",
    "prompts": "prompts measured",
}

ROUNDING = {"tok_s": 1, "speedup": 2, "nodes_per_cycle": 2, "tokens_per_cycle": 2, "copies_per_token": 2,
            "mib_per_token": 2, "copy_wait_share": 3, "hit_rate": 3, "hits_per_token": 2, "host_per_token": 2,
            "host_wait_share": 3, "expected_over_committed": 2,
            "forecast_over_real": 2, "decode_tok_s": 1, "seconds": 3}


@dataclass
class Comparison:
    """The measured figures: per method, summed decode-phase ``Counters``, summed wall clock of whole calls, and the
    new tokens of every prompt (``outputs``)."""

    methods: dict[str, Method]
    prompts: int
    counters: dict[str, Counters]
    seconds: dict[str, float]
    outputs: dict[str, list[torch.Tensor]]

    def rows(self) -> list[dict]:
        """One dict per method, keys as in ``COLUMNS``."""
        out = []
        for name, method in self.methods.items():
            c, seconds = self.counters[name], self.seconds[name]
            out.append(dict(method=name, label=method.label, tok_s=c.new_tokens / seconds if seconds else 0.0,
                            speedup=0.0, nodes_per_cycle=c.nodes_per_cycle, tokens_per_cycle=c.tokens_per_cycle,
                            copies_per_token=c.copies_per_token, mib_per_token=c.mib_copied_per_token,
                            copy_wait_share=c.copy_wait_share, hit_rate=c.hit_rate,
                            hits_per_token=c.hits_per_token, host_per_token=c.host_experts_per_token,
                            host_wait_share=c.host_wait_share,
                            expected_over_committed=c.expected_over_committed,
                            forecast_over_real=c.forecast_over_real, decode_tok_s=c.tokens_per_second,
                            new_tokens=c.new_tokens, seconds=seconds, prompts=self.prompts))
        base = out[0]["tok_s"] if out else 0.0
        for row in out:
            row["speedup"] = row["tok_s"] / base if base else 0.0
            for name, digits in ROUNDING.items():  # to what a noisy wall clock can tell apart
                row[name] = None if row[name] is None else round(row[name], digits)
        return out

    def table(self, as_frame: bool | None = None):
        """A pandas DataFrame indexed by method when pandas imports (``as_frame=None``), else the rows."""
        rows = self.rows()
        if as_frame is False or (as_frame is None and not _has_pandas()):
            return rows
        import pandas as pd

        return pd.DataFrame(rows, columns=list(COLUMNS)).set_index("method")

    def format(self, title: str = "") -> str:
        """The table as text, with a legend."""
        return format_rows(self.rows(), title)

    def plot(self, title: str | None = None):
        return plot_comparison(self.rows(), title)


def compare(model, tokenizer, prompts, methods=DEFAULT_METHODS, *, max_new_tokens: int = 64, warmup: bool = True,
            plot: bool = False, as_frame: bool | None = None, batch: int = 1, **generate_kwargs):
    """Decode ``prompts`` with each method in turn on an enabled model and return a table of the figures.

    - ``model``: a model with SpecFit enabled (``specfit.enable``, ``specfit.from_pretrained``,
      ``specfit.embedded.load``), used by every method, or a dict ``{method: model}`` with one model per method (so
      slot caches never mix; needed for ``"eagle3-vanilla"`` and the SpecFit variants with their own options).
    - ``prompts``: a string or a list of strings (tokenized with ``tokenizer``) or of ``input_ids`` tensors [1, T].
    - ``methods``: ``"ar"`` (no assistant), ``"eagle3"``, ``"specfit"``, any name given to
      ``specfit.register_assistant``, or with a dict of models a harness variant (``"eagle3-vanilla"``,
      ``"specfit-oracle"``, ...). The first method is the base of ``speedup``.
    - ``max_new_tokens`` and ``**generate_kwargs`` go to every ``generate()`` call (greedy unless ``do_sample=True``;
      greedy outputs are checked to be identical).
    - ``batch``: prompts per ``generate()`` call, left-padded with an attention mask (docs/batch.md); figures are
      then per batch call (tok/s: the batch's new tokens over its calls' wall clock).
    - ``warmup``: one short untimed call per method first. ``plot``: also draw the table (matplotlib).
    - Returns a pandas DataFrame indexed by method when pandas is installed (``as_frame=False``: always the rows,
      a list of dicts); ``specfit.evaluation.comparison.COLUMNS`` says what each column means.

    Everything is checked before the first call; on a slow machine keep ``prompts`` and ``max_new_tokens`` small.
    """
    result = run(model, tokenizer, prompts, methods, max_new_tokens=max_new_tokens, warmup=warmup, batch=batch,
                 needs=("matplotlib",) * plot + ("pandas",) * bool(as_frame), **generate_kwargs)
    table = result.table(as_frame)
    if plot:
        result.plot()
    return table


def run(model, tokenizer, prompts, methods=DEFAULT_METHODS, *, max_new_tokens: int = 64, warmup: bool = True,
        needs: tuple = (), on_prompt=None, batch: int = 1, **generate_kwargs) -> Comparison:
    """``compare``'s measurement, returned whole (figures and generated tokens): what ``specfit demo`` prints."""
    methods = _methods(methods)
    models = _models(model, methods)
    prompt_ids = _prompt_ids(prompts, tokenizer)
    _check(models, methods, max_new_tokens, needs, generate_kwargs)
    sampling = bool(generate_kwargs.get("do_sample", False))
    runs = interleave(models, prompt_ids, max_new_tokens, assistants={m: methods[m].assistant for m in methods},
                      warmup_tokens=min(WARMUP_TOKENS, max_new_tokens) if warmup else 0,
                      check_lossless=not sampling, on_prompt=on_prompt, batch=batch, **generate_kwargs)
    return Comparison(methods, len(prompt_ids), runs.counters, runs.seconds, runs.outputs)


def format_rows(rows: list[dict], title: str = "") -> str:
    """Rows of ``compare`` as a text table."""
    base = (rows[0]["label"] if len(rows[0]["label"]) <= 10 else rows[0]["method"]) if rows else ""
    hosted = any(r.get("host_per_token") for r in rows)  # the host lane's columns, where one computed experts
    head = (f"{'method':<22}{'tok/s':>8}{'vs ' + base:>14}{'nodes/cyc':>11}{'tok/cyc':>9}{'exp/real':>10}"
            f"{'fcst/real':>11}{'copies/tok':>12}{'MiB/tok':>9}{'copy wait':>11}{'hit rate':>10}")
    head += f"{'hits/tok':>10}{'host/tok':>10}{'host wait':>11}" if hosted else ""
    lines = ([title] if title else []) + [head, "-" * len(head)]
    for r in rows:
        forecast = "-" if r["forecast_over_real"] is None else f"{r['forecast_over_real']:.2f}"
        line = (f"{r['label']:<22}{r['tok_s']:>8.1f}{'x%.2f' % r['speedup']:>14}{r['nodes_per_cycle']:>11.2f}"
                f"{r['tokens_per_cycle']:>9.2f}{r['expected_over_committed']:>10.2f}{forecast:>11}"
                f"{r['copies_per_token']:>12.2f}{r['mib_per_token']:>9.2f}{r['copy_wait_share']:>11.1%}"
                f"{r['hit_rate']:>10.0%}")
        if hosted:
            line += f"{r['hits_per_token']:>10.2f}{r['host_per_token']:>10.2f}{r['host_wait_share']:>11.1%}"
        lines.append(line)
    return "\n".join(lines)


LEGEND = ("tok/s: new tokens per second, wall clock of the whole generate() calls (what a stopwatch reads)",
          "nodes/cyc: draft nodes verified per decoding cycle (EAGLE-3 verifies its 7)",
          "tok/cyc: tokens committed per cycle (accepted draft tokens + 1 bonus token; AR: 1)",
          "exp/real: tokens the method expected its cycles to commit over those committed (1.00: right on average)",
          "fcst/real: seconds SpecFit's cost model predicted for its cycles over the decode time (1.00: the forecast "
          "matches the clock; -: the method forecasts no time)",
          "copies/tok: host-to-device expert copies per new token (slot-cache misses + prefetches); MiB/tok: their "
          "MiB per token",
          "copy wait: share of decode time the host was blocked by copies (on a CPU, emulated link included: all of "
          "the stall; on CUDA only the issue time, the device-side wait shows in tok/s)",
          "hit rate: share of the experts the forwards needed that were already in a slot",
          "hits/tok, host/tok (with a host lane): experts per token found in a slot, and computed on the host lane "
          "(neither resident nor copied); host wait: share of decode time the host waited for the lane (CPU: an "
          "emulated lane, the part of its time nothing hid)")


def plot_comparison(table, title: str | None = None):
    """Bar charts of tok/s and expert copies per token by method; ``table``: what ``compare`` returned (either
    form). Returns the two axes."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError('plotting needs matplotlib, an optional dependency: pip install "specfit[plot]"') from err
    rows = table if isinstance(table, list) else table.reset_index().to_dict("records")
    names = [r["label"] for r in rows]
    fig, (speed, copies) = plt.subplots(1, 2, figsize=(8, 3))
    speed.bar(names, [r["tok_s"] for r in rows], color="tab:blue")
    speed.set_ylabel("tok/s (wall clock)")
    copies.bar(names, [r["copies_per_token"] for r in rows], color="tab:red")
    copies.set_ylabel("expert copies per token")
    for ax in (speed, copies):
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return speed, copies


# --- checks, all before the first call ---------------------------------------------------------------------------
def _methods(methods) -> dict[str, Method]:
    from ..decoding.assistants import ASSISTANTS

    if isinstance(methods, str):
        methods = (methods,)
    out = {}
    for name in methods:
        if name in METHODS:
            out[name] = METHODS[name]
        elif name in ASSISTANTS:  # a registered assistant, e.g. your own
            out[name] = Method(name, name)
        else:
            raise ValueError(f"unknown method {name!r}; choose from 'ar', the registered assistants "
                             f"({', '.join(sorted(ASSISTANTS))}), or with one model per method: "
                             f"{', '.join(m for m in METHODS if m not in ASSISTANTS and m != 'ar')}")
    if not out:
        raise ValueError("methods is empty: name at least one, e.g. methods=('ar', 'specfit')")
    return out


def _models(model, methods: dict[str, Method]) -> dict:
    if isinstance(model, dict):
        missing = [m for m in methods if m not in model]
        if missing:
            raise ValueError(f"no model given for {', '.join(missing)}: the dict of models needs one per method")
        return {m: model[m] for m in methods}
    special = [m for m, method in methods.items() if method.options or method.cleared or method.cold]
    if special:
        raise ValueError(f"{', '.join(special)} need a model of their own (their own options, cache mode or cold "
                         f"experts): pass "
                         f"{{method: model}} with one model per method (for the embedded model: "
                         f"specfit.evaluation.harness.load_instances)")
    return {m: model for m in methods}


def _prompt_ids(prompts, tokenizer) -> list[torch.Tensor]:
    if isinstance(prompts, (str, torch.Tensor)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer: compare(model, tokenizer, prompts)")
            p = tokenizer(p, return_tensors="pt").input_ids
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"a prompt is a string or an input_ids tensor, got {type(p).__name__}")
        if p.dim() == 1:
            p = p[None]
        if p.shape[0] != 1:
            raise ValueError(f"one prompt per tensor (batch size 1), got a batch of {p.shape[0]}: pass a list")
        out.append(p)
    if not out:
        raise ValueError("no prompts: pass a string or a list of them")
    return out


def _check(models: dict, methods: dict[str, Method], max_new_tokens: int, needs: tuple, generate_kwargs) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    for name in ("assistant", "assistant_model", "prompt_lookup_num_tokens", "max_new_tokens", "max_length"):
        if name in generate_kwargs:
            raise ValueError(f"compare() sets the decoding method itself: leave out {name}= (use methods= and "
                             f"max_new_tokens=)")
    for name, model in models.items():
        runtime = getattr(model, "specfit", None)
        if runtime is None:
            raise ValueError(f"the model for {name!r} does not have SpecFit enabled: specfit.enable(model, "
                             f"cache_slots=..., drafter=...) or specfit.from_pretrained(...) first")
        if methods[name].assistant is not None and runtime.drafter is None:
            raise ValueError(f"method {name!r} needs a drafter: specfit.enable(model, ..., drafter=PATH_OR_MODULE)")
    for module in needs:
        try:
            __import__(module)
        except ImportError as err:
            extra = '"specfit[plot]"' if module == "matplotlib" else module
            raise ImportError(f"compare(... {'plot=True' if module == 'matplotlib' else 'as_frame=True'}) needs "
                              f"{module}: pip install {extra}") from err


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["compare", "Comparison", "COLUMNS", "DEFAULT_METHODS", "plot_comparison", "format_rows", "run"]
