"""A fitted cost profile shown to the user: ``describe`` (its figures and verdict as text, printed by ``specfit
calibrate`` and ``specfit bench``) and ``plot_fit`` (predicted against measured cycle time, with the held-out fit)."""

from __future__ import annotations

READ_THE_PLOT = ("how to read the plot: one point per probe configuration and link (its fastest repeat); filled dots "
                 "are the fit, hollow circles the same probes predicted by a fit that held them out; on the dashed "
                 "diagonal a prediction is exact, and hollow circles far wider than the dots mean the fit does not "
                 "generalise")


def describe(cost) -> str:
    m, q = cost.meta, cost.quality or {}
    probes = m.get("probes") or {}

    def num(x, scale=1.0, digits=3):
        return "n/a" if x is None else f"{x * scale:.{digits}f}"

    def ms(values, digits=2):
        return " ".join(num(v, 1e3, digits) for v in values)

    lines = [f"device      {m.get('device')}", f"model       {m.get('model_key', m.get('model_id'))}",
             f"probes      {probes.get('slots')} slots ({probes.get('cache_mode')}), links: "
             f"{', '.join(dict.fromkeys(probes.get('links', [])))}"
             + (f", host lanes: {', '.join(lane for lane in probes['lanes'] if lane)}"
                if any(probes.get("lanes") or ()) else "")
             + "; one profile for every slot count, link and host lane",
             f"compute     {cost.beta * 1e3:.4f} ms per expert computed (beta)"]
    if cost.prices_copies:
        lines.append(f"copy        {cost.copy_overhead * 1e3:.4f} ms per expert copied + {cost.link_share:.2f} x the "
                     f"link's time per copy ({cost.copy * 1e3:.4f} ms at the probes' link)")
    if cost.prices_host:
        lines.append(f"host        {cost.host_overhead * 1e3:.4f} ms per host expert + {cost.host_share:.2f} x the "
                     f"lane's time per expert ({cost.host * 1e3:.4f} ms at the probes' lane)")
    lines += [f"intercepts  {ms(cost.intercepts)} ms (n = 0..)",
              f"drafting    {ms(cost.draft_level_seconds)} ms per level (1..), included in every intercept"
              if cost.draft_levels else "drafting    not modelled per level",
              f"fit         R^2 {num(m.get('r2'))}, rms residual {num(m.get('rms_residual_s'), 1e3, 2)} ms over "
              f"{m.get('n_records')} probe records"]
    paper = m.get("paper")
    if paper:
        lines.append(f"paper       {paper['beta'] * 1e3:.4f} ms per expert of demand, R^2 {num(paper.get('r2'))} "
                     f"(held out {num(paper.get('heldout_r2'))}): the demand-only fit for cost='paper', valid at "
                     f"{paper.get('slots')} slots and {paper.get('link')} only")
    if q.get("verdict") in ("good", "poor"):
        name = "copy" if q.get("kind") == "cache-aware" else "beta"
        width = q.get(f"{name}_halfwidth")
        interval = q.get(f"{name}_interval_s") or [None, None]
        lines += [f"held out    R^2 {num(q.get('heldout_r2'))}, rms {num(q.get('heldout_rms_s'), 1e3, 2)} ms "
                  f"({q.get('folds')}-fold cross-validation)",
                  f"bootstrap   {name} 95% [{ms(interval, 4).replace(' ', ', ')}] ms "
                  f"({'unbounded' if width is None else f'+-{100 * width:.0f}%'}); intercepts "
                  + " ".join(f"[{ms(pair).replace(' ', ', ')}]" for pair in q.get("intercept_intervals_s", []))
                  + " ms"]
        if q.get("choice_change_rate") is not None:
            lines.append(f"selector    choice changes on {100 * q['choice_change_rate']:.1f}% of (pool, bootstrap "
                         f"fit) pairs over {q.get('pools')} recorded pools, losing {100 * q['choice_loss']:.2f}% of "
                         f"the predicted tokens per second on average")
        limit = q.get("gate", {}).get("max_beta_halfwidth")
        if q["verdict"] == "good" and limit is not None and (width is None or width > limit):
            lines.append(f"note        the {name} interval is wider than +-{100 * limit:.0f}%, but the choices it "
                         f"moves lose little (see fit_quality's gate, rule 2)")
        lines.append(f"verdict     {q['verdict'].upper()}" + "".join(f"\n            - {r}" for r in q["reasons"]))
    elif q:
        lines.append(f"verdict     {q.get('verdict')}: " + "; ".join(q.get("reasons", [])))
    return "\n".join(lines)


def plot_fit(result, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no plot written")
        return
    cost, records = result.cost, result.records
    measured = [r.seconds * 1e3 for r in records]
    predicted = [_predict(cost, r) * 1e3 for r in records]
    heldout = [s * 1e3 for s in result.heldout_seconds]
    q = cost.quality or {}
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(heldout, measured, s=22, facecolors="none", edgecolors="tab:red", lw=0.7,
               label=f"held out ({q.get('folds', '?')}-fold)")
    dots = ax.scatter(predicted, measured, s=8, c=[r.n_nodes for r in records], cmap="viridis", label="fitted")
    fig.colorbar(dots, ax=ax, label="draft nodes verified (n)", shrink=0.8)
    lo, hi = min(measured + predicted + heldout), max(measured + predicted + heldout)
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set_xlabel("predicted cycle time (ms)")
    ax.set_ylabel("measured cycle time (ms, fastest of the repeats)")
    held = q.get("heldout_r2")
    ax.set_title(f"compute {cost.beta * 1e3:.3f} ms/expert, copy {cost.copy * 1e3:.3f} ms, R² "
                 f"{cost.meta.get('r2') or 0:.3f}, held-out R² "
                 f"{'n/a' if held is None else f'{held:.3f}'}\nverdict: {q.get('verdict', 'n/a')}", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    print(READ_THE_PLOT)


def _predict(cost, record) -> float:
    """A record's predicted seconds, its copies priced at the link it ran over, its host experts at its lane."""
    return cost.record_seconds(record)
