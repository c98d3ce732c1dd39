"""``specfit.compare``: AR, EAGLE-3 and SpecFit (or any registered assistant) side by side on your own prompts.

    table = specfit.compare(model, tokenizer, ["Question: ...\\nAnswer:", ...], max_new_tokens=64)

The methods take turns prompt by prompt (prompt 0 by each method, then prompt 1, ...), so a slow stretch of a busy
machine hits them all alike; each method first makes one short untimed call, so one-time costs stay out of the
figures. ``tok_s`` is wall clock of the whole ``generate()`` calls (what a stopwatch around them reads, prefill
included); the other figures come from ``model.specfit.stats.last_generate`` of each call. Greedy outputs must be
identical across methods (decoding is lossless): a difference stops the comparison.

``specfit demo`` runs this same code on the embedded model. A progress bar counts the calls (``progress=False``: none);
Ctrl-C stops the comparison and returns the table of the prompts every method finished, said in one line.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

import torch

from ..stats.counters import Counters
from .comparison_view import LEGEND, format_rows, plot_comparison  # noqa: F401  (part of this module's interface)
from .harness import METHODS, Method, Runs, interleave

DEFAULT_METHODS = ("ar", "eagle3", "specfit")
WARMUP_TOKENS = 8

# column -> meaning, in table order
COLUMNS = {
    "method": "the method's name (the table's index in a DataFrame)",
    "label": "what the method is",
    "tok_s": "new tokens per second, wall clock of the whole generate() calls (prefill included)",
    "tok_s_spread": "standard deviation over the prompts (batches) of each call's tok/s; None with one prompt",
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

ROUNDING = {"tok_s": 1, "tok_s_spread": 1, "speedup": 2, "nodes_per_cycle": 2, "tokens_per_cycle": 2,
            "copies_per_token": 2,
            "mib_per_token": 2, "copy_wait_share": 3, "hit_rate": 3, "hits_per_token": 2, "host_per_token": 2,
            "host_wait_share": 3, "expected_over_committed": 2,
            "forecast_over_real": 2, "decode_tok_s": 1, "seconds": 3}


@dataclass
class Comparison:
    """The measured figures: per method, summed decode-phase ``Counters``, summed wall clock of whole calls, the
    new tokens of every prompt (``outputs``) and each call's whole-call tok/s (``per_prompt``); ``total``: the
    prompts asked for (more than ``prompts`` when Ctrl-C stopped the comparison: ``interrupted``)."""

    methods: dict[str, Method]
    prompts: int
    counters: dict[str, Counters]
    seconds: dict[str, float]
    outputs: dict[str, list[torch.Tensor]]
    per_prompt: dict[str, list[float]] = field(default_factory=dict)
    total: int | None = None
    setup: str = ""  # what it ran on (``setup``): slots, link, host lane, device

    @property
    def interrupted(self) -> bool:
        return self.total is not None and self.prompts < self.total

    def rows(self) -> list[dict]:
        """One dict per method, keys as in ``COLUMNS``."""
        out = []
        for name, method in self.methods.items():
            c, seconds = self.counters[name], self.seconds[name]
            each = self.per_prompt.get(name, [])
            out.append(dict(method=name, label=method.label, tok_s=c.new_tokens / seconds if seconds else 0.0,
                            tok_s_spread=statistics.stdev(each) if len(each) > 1 else None,
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
        """The two bar charts (``plot_comparison``), titled with what was compared unless ``title`` is given."""
        if title is None:
            done = f"{self.prompts} of {self.total}" if self.interrupted else f"{self.prompts}"
            title = f"specfit.compare: {done} prompt{'s' if self.prompts != 1 else ''}; {self.setup}"
        return plot_comparison(self.rows(), title)


def compare(model, tokenizer, prompts, methods=DEFAULT_METHODS, *, max_new_tokens: int = 64, warmup: bool = True,
            plot: bool = False, as_frame: bool | None = None, batch: int = 1, progress: bool = True,
            **generate_kwargs):
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
    - ``warmup``: one short untimed call per method first. ``plot``: also draw the table (matplotlib), titled with
      what was compared, the spread over prompts as error bars. ``progress``: a progress bar of the calls (tqdm).
    - Returns a pandas DataFrame indexed by method when pandas is installed (``as_frame=False``: always the rows,
      a list of dicts); ``specfit.evaluation.comparison.COLUMNS`` says what each column means.
    - Ctrl-C stops it: the table of the prompts every method finished comes back, and one line on stderr says so
      (with none finished, the KeyboardInterrupt goes on).

    Everything is checked before the first call; on a slow machine keep ``prompts`` and ``max_new_tokens`` small.
    """
    try:
        result = run(model, tokenizer, prompts, methods, max_new_tokens=max_new_tokens, warmup=warmup, batch=batch,
                     needs=("matplotlib",) * plot + ("pandas",) * bool(as_frame), progress=progress,
                     **generate_kwargs)
    except Interrupted as stop:
        if stop.partial is None:
            raise KeyboardInterrupt from None
        print(f"specfit.compare: interrupted (Ctrl-C) {stop}", file=sys.stderr)
        result = stop.partial
    table = result.table(as_frame)
    if plot:
        result.plot()
    return table


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during ``run``: ``partial`` is the ``Comparison`` of the prompts every method finished (None when
    none did); the message says how far it got."""

    def __init__(self, partial: "Comparison | None", total: int):
        done = 0 if partial is None else partial.prompts
        kept = "nothing to keep" if partial is None else f"the table holds those {done}"
        super().__init__(f"after {done} of {total} prompt{'s' if total != 1 else ''} measured by every method: "
                         f"{kept}")
        self.partial, self.total = partial, total


def run(model, tokenizer, prompts, methods=DEFAULT_METHODS, *, max_new_tokens: int = 64, warmup: bool = True,
        needs: tuple = (), on_prompt=None, batch: int = 1, progress: bool = False, **generate_kwargs) -> Comparison:
    """``compare``'s measurement, returned whole (figures and generated tokens): what ``specfit demo`` prints.
    Ctrl-C raises ``Interrupted``, carrying the comparison of the prompts every method finished."""
    methods = _methods(methods)
    models = _models(model, methods)
    prompt_ids = _prompt_ids(prompts, tokenizer)
    _check(models, methods, max_new_tokens, needs, generate_kwargs)
    sampling = bool(generate_kwargs.get("do_sample", False))
    runs = Runs({}, {}, {}, {})
    calls = -(-len(prompt_ids) // batch) if isinstance(batch, int) and batch >= 1 else 0
    done = _Done(methods, batch, len(prompt_ids), setup(next(iter(models.values()))))
    bar = _bar(calls, progress)

    def prompt_done(i):
        done.take(runs, i)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(", ".join(f"{methods[m].label} {done.per_prompt[m][-1]:.1f}" for m in methods)
                                + " tok/s")
        if on_prompt is not None:
            on_prompt(i)

    try:
        interleave(models, prompt_ids, max_new_tokens, assistants={m: methods[m].assistant for m in methods},
                   warmup_tokens=min(WARMUP_TOKENS, max_new_tokens) if warmup else 0, check_lossless=not sampling,
                   on_prompt=prompt_done, batch=batch, runs=runs, **generate_kwargs)
    except KeyboardInterrupt:
        raise Interrupted(done.comparison(), len(prompt_ids)) from None
    finally:
        if bar is not None:
            bar.close()
    return done.comparison()


class _Done:
    """What every method finished so far: a copy of the counters, seconds and outputs after each prompt (batch),
    and each call's whole-call tok/s."""

    def __init__(self, methods: dict, batch: int, total: int, setup_text: str):
        self.methods, self.batch, self.total, self.setup = methods, batch, total, setup_text
        self.calls = 0
        self.counters = {m: Counters() for m in methods}
        self.seconds = {m: 0.0 for m in methods}
        self.outputs = {m: [] for m in methods}
        self.per_prompt = {m: [] for m in methods}

    def take(self, runs: Runs, i: int) -> None:
        for m in self.methods:
            tokens = runs.counters[m].new_tokens - self.counters[m].new_tokens
            seconds = runs.seconds[m] - self.seconds[m]
            self.per_prompt[m].append(tokens / seconds if seconds > 0 else 0.0)
            self.counters[m] = Counters()
            self.counters[m] += runs.counters[m]
            self.seconds[m] = runs.seconds[m]
            self.outputs[m] = list(runs.outputs[m])
        self.calls = i + 1

    def comparison(self) -> "Comparison | None":
        if self.calls == 0:
            return None
        prompts = min(self.total, self.calls * self.batch)
        return Comparison(self.methods, prompts, self.counters, self.seconds, self.outputs, self.per_prompt,
                          self.total, self.setup)


def _bar(total: int, progress: bool):
    if not progress or total == 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="specfit.compare", unit="prompt")


def setup(model) -> str:
    """What a comparison ran on, for its title: slots, the link and host lane (emulated ones say so), the device."""
    runtime = model.specfit
    config = runtime.config
    link = config.link.label if config.link is not None else "no emulated link"
    host = f", {config.host.label}" if config.host is not None else ""
    where = "CPU (not GPU speed)" if runtime.device.type == "cpu" else str(runtime.device)
    return f"{config.cache_slots} slots of {runtime.store.num_experts} per layer, {link}{host}, {where}"


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


__all__ = ["compare", "Comparison", "COLUMNS", "DEFAULT_METHODS", "Interrupted", "plot_comparison",
           "format_rows", "run"]
