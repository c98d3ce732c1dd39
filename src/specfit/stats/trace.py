"""The per-cycle trace: ``CycleRecord``, one per decoding cycle, and its exports (rows, a DataFrame, a plot)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["CycleRecord", "Trace", "trace_rows", "trace_to_pandas", "plot_trace"]


@dataclass(frozen=True)
class CycleRecord:
    """One decoding cycle of an assistant, as ``stats.trace`` records it.

    - ``n_nodes``: draft nodes verified (the root not counted). ``pool``: draft nodes drafted (0: drafting skipped).
    - ``committed``: tokens the cycle committed (accepted draft tokens + the bonus token).
    - ``demand``: distinct experts its verify forward needed, summed over layers; ``misses``: of those, copied to a
      slot (the cycle's expert copies; prefetches are not in it); ``host_experts``: of those, computed on the host
      lane.
    - ``seconds``: the cycle's wall clock; ``draft_seconds`` the part spent drafting and selecting (phases 1-2);
      ``measurement_seconds`` the part spent on measurement only (the route or acceptance oracle).
    - ``predicted_seconds``: what the cost model predicted the cycle would take, drafting included, beside
      ``seconds`` (None: the assistant forecasts no time, as AR and EAGLE-3).
    - ``way``: the way SpecFit ran the cycle, ``"specfit"``, ``"eagle3"`` or ``"plain"`` (``""``: an assistant
      without ways). ``row_nodes``: in a batch, the draft nodes each row verified (the batch rule's choice under
      SpecFit's way), in the order of the rows in flight; ``row_levels`` the levels each row drafted; both empty at
      batch 1.
    """

    n_nodes: int
    demand: int
    seconds: float
    pool: int
    committed: int
    misses: int
    draft_seconds: float  # the part of `seconds` spent drafting and selecting (phases 1-2)
    measurement_seconds: float = 0.0  # the part of `seconds` spent measuring only (the route/acceptance oracle)
    predicted_seconds: float | None = None  # the cost model's forecast of `seconds` (None: not forecast)
    host_experts: int = 0  # of `demand`, computed on the host lane (neither resident nor copied)
    way: str = ""  # "specfit", "eagle3" or "plain": the way SpecFit ran the cycle ("" for other assistants)
    row_nodes: tuple[int, ...] = ()  # a batch: draft nodes verified per row in flight (empty at batch 1)
    row_levels: tuple[int, ...] = ()  # a batch: levels drafted per row in flight (empty at batch 1)


class Trace(list):
    """The per-cycle trace: a list of ``CycleRecord``, one per decoding cycle since ``stats.start_trace()``.

    ``rows()`` gives plain dicts (``cycle`` plus every ``CycleRecord`` field), ``to_pandas()`` the same as a
    DataFrame, ``plot()`` tokens, nodes and expert copies per cycle (matplotlib). The functions ``trace_rows``,
    ``trace_to_pandas`` and ``plot_trace`` do the same for any list of records.
    """

    def rows(self) -> list[dict]:
        return trace_rows(self)

    def to_pandas(self):
        return trace_to_pandas(self)

    def plot(self, title: str | None = None):
        return plot_trace(self, title)


def trace_rows(trace) -> list[dict]:
    """One dict per cycle: ``cycle`` (0, 1, ...) and the ``CycleRecord`` fields."""
    return [{"cycle": i, **asdict(record)} for i, record in enumerate(_records(trace))]


def trace_to_pandas(trace):
    """The trace as a pandas DataFrame, one row per cycle, indexed by ``cycle``."""
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError("trace_to_pandas() needs pandas (pip install pandas); trace_rows() gives the same rows as "
                          "plain dicts") from err
    columns = ["cycle"] + [f.name for f in fields(CycleRecord)]
    return pd.DataFrame(trace_rows(trace), columns=columns).set_index("cycle")


def plot_trace(trace, title: str | None = None):
    """Tokens committed and nodes verified per cycle (top), expert copies (and host experts) per cycle (bottom);
    returns the axes."""
    plt = _pyplot("plot()")
    rows = trace_rows(trace)
    x = [r["cycle"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 4))
    top.step(x, [r["committed"] for r in rows], where="mid", label="tokens committed")
    top.step(x, [r["n_nodes"] for r in rows], where="mid", label="draft nodes verified")
    top.set_ylabel("per cycle")
    top.legend(fontsize=8)
    copies = [r["misses"] for r in rows]
    bottom.bar(x, copies, color="tab:red", label="expert copies (slot-cache misses)")
    hosted = any(r["host_experts"] for r in rows)
    if hosted:
        bottom.bar(x, [r["host_experts"] for r in rows], bottom=copies, color="tab:purple",
                   label="host experts (misses computed on the host)")
    bottom.set_ylabel("copies + host experts" if hosted else "copies")
    bottom.set_xlabel("decoding cycle")
    bottom.legend(fontsize=8)
    top.set_title(title or f"{len(rows)} decoding cycles", fontsize=9)
    fig.tight_layout()
    return top, bottom


def _records(trace) -> list:
    if trace is None:
        raise ValueError("no trace recorded: call model.specfit.stats.start_trace() before generate()")
    return list(trace)


def _pyplot(what: str):
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(f'{what} needs matplotlib, an optional dependency: pip install "specfit[plot]"') from err
    return plt
