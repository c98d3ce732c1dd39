"""How well acceptance is predicted: expected calibration error and reliability diagrams, raw vs calibrated.

The input is SpecFit's acceptance log (``model.specfit.acceptance_log = []`` before decoding): one entry
``(depth, rank, q, estimate, label)`` per labelled drafted child, where ``estimate`` is the acceptance model's
prediction made when the child was drafted (before its label was known) and ``q`` the drafter's conditional
probability, which is what the paper's reward uses as the child's acceptance. A prediction is *calibrated* when,
among children predicted ``x``, a fraction ``x`` is accepted.

The *expected calibration error* (ECE) bins the predictions into ten equal-width bins and averages
``|mean prediction - mean label|`` over the bins, weighted by how many children each holds. On few labels it is
biased upwards: even a perfectly calibrated predictor scores about ``0.8 * sqrt(p (1 - p) / labels per bin)`` (0.07
with 300 labels), so ``summary`` also reports that *floor*, the mean ECE of labels drawn from the predictions
themselves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BINS = 10


def ece(predicted, observed, bins: int = BINS) -> float:
    """Expected calibration error of predictions in [0, 1] against labels in [0, 1] (nan when there are none)."""
    predicted, observed = np.asarray(predicted, float), np.asarray(observed, float)
    if predicted.size == 0:
        return float("nan")
    which = np.minimum((predicted * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            total += sel.sum() * abs(predicted[sel].mean() - observed[sel].mean())
    return float(total / predicted.size)


def ece_floor(predicted, draws: int = 20, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor would show with these predictions and this many labels: the mean
    over ``draws`` sets of labels drawn with the predicted probabilities (seeded)."""
    predicted = np.asarray(predicted, float)
    if predicted.size == 0:
        return float("nan")
    rng = np.random.default_rng(seed)
    return float(np.mean([ece(predicted, rng.random(predicted.size) < predicted) for _ in range(draws)]))


def replay(model, cycles) -> dict:
    """An acceptance model (``predict``, ``update``) over labelled cycles in order, each a list of ``(depth, rank, q,
    label)``: every cycle's children predicted before their labels are learnt. Its ECE, the floor for as many
    labels, and how many."""
    predicted, labels = [], []
    for cycle in cycles:
        if cycle:
            predicted += [model.predict(d, r, q) for d, r, q, _ in cycle]
            labels += [y for *_, y in cycle]
            model.update(cycle)
    return {"ece": ece(predicted, labels), "floor": ece_floor(predicted), "labels": len(labels)}


def summary(log) -> dict:
    """ECE of the raw conditional probabilities and of the calibrated estimates, overall and per (depth, rank)."""
    if not log:
        return {"labels": 0}
    depth, rank, q, est, label = (np.asarray(c, float) for c in zip(*log))
    out = {"labels": len(log), "ece_raw": ece(q, label), "ece_calibrated": ece(est, label),
           "ece_floor": ece_floor(est), "mean_q": float(q.mean()), "mean_estimate": float(est.mean()),
           "mean_label": float(label.mean()), "by_depth_rank": {}}
    for d in sorted(set(depth.astype(int))):
        for r in sorted(set(rank.astype(int))):
            sel = (depth == d) & (rank == r)
            if sel.any():
                out["by_depth_rank"][f"{d},{r}"] = {
                    "labels": int(sel.sum()), "ece_raw": ece(q[sel], label[sel]),
                    "ece_calibrated": ece(est[sel], label[sel]), "mean_q": float(q[sel].mean()),
                    "mean_estimate": float(est[sel].mean()), "mean_label": float(label[sel].mean())}
    return out


def describe(name: str, s: dict) -> str:
    if not s.get("labels"):
        return f"{name}: no labelled children (SpecFit drafted nothing)"
    return (f"{name}: expected calibration error of per-node acceptance {s['ece_calibrated']:.3f} calibrated vs "
            f"{s['ece_raw']:.3f} raw draft probabilities over {s['labels']} labelled children (a perfectly "
            f"calibrated predictor would score {s['ece_floor']:.3f} on as many; mean label {s['mean_label']:.3f}, "
            f"estimate {s['mean_estimate']:.3f}, q {s['mean_q']:.3f})")


def plot(logs: dict, path, min_labels: int = 5) -> Path | None:
    """One reliability diagram per workload and sibling rank: observed acceptance against prediction, per depth,
    for the calibrated estimates (solid) and the raw draft probabilities (dashed). ``logs``: name -> log. Returns the
    path, or None (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no reliability diagram written")
        return None
    logs = {name: log for name, log in logs.items() if log}
    if not logs:
        print("no labelled children: no reliability diagram written")
        return None
    ranks = sorted({int(e[1]) for log in logs.values() for e in log})
    fig, axes = plt.subplots(len(logs), len(ranks), figsize=(4.0 * len(ranks), 3.8 * len(logs)), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for row, (name, log) in zip(axes, logs.items()):
        depth, rank, q, est, label = (np.asarray(c, float) for c in zip(*log))
        depths = sorted(set(depth.astype(int)))
        for ax, r in zip(row, ranks):
            for k, d in enumerate(depths):
                sel = (depth == d) & (rank == r)
                color = cmap(k / max(1, len(depths) - 1))
                for pred, style, tag in ((est, "-o", "calibrated"), (q, "--x", "raw q")):
                    xs, ys = _binned(pred[sel], label[sel], min_labels)
                    if xs:
                        ax.plot(xs, ys, style, color=color, ms=4, lw=1,
                                label=f"depth {d}, {tag}" if r == ranks[0] else None)
            ax.plot([0, 1], [0, 1], "k:", lw=1)
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            sel = rank == r
            ax.set_title(f"{name}, rank {r}: ECE {ece(q[sel], label[sel]):.3f} raw, "
                         f"{ece(est[sel], label[sel]):.3f} calibrated", fontsize=8)
            ax.set_xlabel("predicted acceptance")
            ax.set_ylabel("observed acceptance")
        row[0].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"reliability diagram: {path}")
    return path


def _binned(pred, label, min_labels: int):
    xs, ys = [], []
    which = np.minimum((pred * BINS).astype(int), BINS - 1)
    for b in range(BINS):
        sel = which == b
        if sel.sum() >= min_labels:
            xs.append(float(pred[sel].mean()))
            ys.append(float(label[sel].mean()))
    return xs, ys
