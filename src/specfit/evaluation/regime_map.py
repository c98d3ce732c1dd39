"""The regime map of ``specfit bench --map``: SpecFit against the best of AR, EAGLE-3 and prompt lookup in every cell
of link cost x slot count, on the embedded model, whole ``generate()`` calls, wall clock.

A row of the map is a link cost: copying one token's full expert demand takes ``ratio`` x that token's compute
(0.5, 1, 1.4 (the paper's A100, the default link), 2, 4, 8; 0: no link), an emulated link on a CPU (labelled as
such: not GPU speed). A column is a slot count (6, 12, 24, all 64 of the embedded model's experts). A cell decodes
``--map-prompts`` prompts per workload (after one untimed prompt) with ``--map-tokens`` tokens each, the methods
taking turns prompt by prompt. Printed as tables (SpecFit / the best baseline, with which one: A, E or P; then
SpecFit / each baseline) and drawn as heat maps (``regime_map.png``).

The host axis (``--map-host-ratios``): at the default link (ratio 1.4), an emulated host lane whose bandwidth is 1x,
2.5x (the structural default, a PCIe 4.0 host) or 4x the link's, at 6, 12 and 24 slots (``MAP_HOST_SLOTS``). Every
method computes cold experts where predicted cheaper (``cold="auto"``); AR with every cold expert copied
(``ar-copy``) is measured beside them, so each cell also says what the host lane alone gives AR. Printed as its own
tables (rows: host ratio) and drawn beside the link maps (``regime_map_host.png``). The link axis stays without a
host lane (every cold expert copied), as before.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .harness import LABELS, load_instances, side_by_side

# the emulated link of each row of the map: one token's full expert demand costs this many times its compute (1.4:
# the paper's A100, the structural default; 0: no link)
MAP_RATIOS = (0.5, 1.0, 1.4, 2.0, 4.0, 8.0)
MAP_SLOTS = (6, 12, 24, 64)
MAP_METHODS = ("ar", "eagle3", "specfit", "prompt-lookup")
MAP_BASELINES = ("ar", "eagle3", "prompt-lookup")  # SpecFit is held against the best of these in each cell
# the host axis: host lane bandwidth as a multiple of the link's (2.5: the structural default), at the default link
MAP_HOST_RATIOS = (1.0, 2.5, 4.0)
MAP_HOST_SLOTS = (6, 12, 24)
MAP_HOST_LINK = 1.4  # the link ratio the host axis runs at: the default link


def check_arguments(args) -> None:
    """The map's options, refused before any model loads."""
    for name in ("map_prompts", "map_tokens"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    bad = [r for r in args.map_ratios if not r >= 0]
    if bad:
        raise ValueError(f"--map-ratios are link costs as multiples of a token's compute, each >= 0 (0: no link), "
                         f"got {bad}")
    bad = [s for s in args.map_slots if s < 1]
    if bad:
        raise ValueError(f"--map-slots are expert slots per layer, each >= 1, got {bad}")
    bad = [r for r in getattr(args, "map_host_ratios", ()) if not (r > 0 and r < float("inf"))]
    if bad:
        raise ValueError(f"--map-host-ratios are host lane bandwidths as multiples of the link's, each a finite "
                         f"number > 0 (2.5: the structural default), got {bad}")
    host = getattr(args, "host_ratio", None)
    if host is not None and not (host >= 0 and host < float("inf")):
        raise ValueError(f"--host-ratio must be a finite number >= 0 (the host's expert bandwidth as a multiple of "
                         f"the link's; 0: no host lane), got {host}")


def map_link(link, link_ratio: float, ratio: float):
    """The emulated link of a map row where one token's full expert demand costs ``ratio`` x its compute (0: no
    link). ``link``: the run's link, whose demand costs ``link_ratio`` x compute (measured). The structural default
    (``link.relative`` set) is scaled by its own rule (it is ``DEMAND_TO_COMPUTE`` x compute by definition), so its
    cells keep labels that name the rule; a link given in ms is scaled by the measured ratio."""
    from .. import embedded

    if ratio <= 0:
        return None
    if link.relative is not None:
        return embedded.scale_link(link, ratio / (embedded.DEMAND_TO_COMPUTE * link.relative))
    return embedded.scale_link(link, ratio / link_ratio)


def run(args, workloads, link, link_ratio: float, out_dir: Path, prepare=None) -> list[dict]:
    """SpecFit against AR, EAGLE-3 and prompt lookup in every (link ratio, slots) cell, whole calls, wall clock."""
    from tqdm.auto import tqdm

    cells = []
    tokens = args.map_tokens or args.max_new_tokens
    prompts = {w: p[: args.map_prompts + 1] for w, p in workloads.items()}  # + 1: the untimed first prompt
    total = len(args.map_ratios) * len(args.map_slots) * sum(len(p) for p in prompts.values())
    print(f"regime map: {len(args.map_ratios)} link ratios x {len(args.map_slots)} slot counts, "
          f"{args.map_prompts} prompt(s) of {tokens} tokens per workload and cell (+1 untimed)")
    with tqdm(total=total, desc="regime map", unit="prompt") as bar:
        for ratio in args.map_ratios:
            for slots in args.map_slots:
                cell_link = map_link(link, link_ratio, ratio)
                instances, _ = load_instances(MAP_METHODS, slots, cell_link, prepare=prepare,
                                              fp8=getattr(args, "fp8", False))
                for w, ids in prompts.items():
                    runs = side_by_side(instances, ids, tokens, on_prompt=lambda i: bar.update(1))
                    cells.append(map_cell(ratio, slots, w, len(ids) - 1, runs))
    host_cells = run_host_axis(args, prompts, tokens, link, link_ratio, prepare)
    if cells:
        print(report(cells))
        plot(cells, out_dir / "regime_map.png")
    if host_cells:
        print(report_host(host_cells))
        plot(host_cells, out_dir / "regime_map_host.png", host=True)
    return cells + host_cells


def run_host_axis(args, prompts: dict, tokens: int, link, link_ratio: float, prepare=None) -> list[dict]:
    """The host axis: every (host ratio, slots) cell at the default link, the methods on ``cold="auto"`` and AR with
    every cold expert copied beside them."""
    from tqdm.auto import tqdm

    from .. import embedded

    ratios = list(getattr(args, "map_host_ratios", ()))
    slots_axis = [s for s in getattr(args, "map_host_slots", MAP_HOST_SLOTS)]
    if not ratios or not slots_axis:
        return []
    cell_link = map_link(link, link_ratio, MAP_HOST_LINK)
    methods = MAP_METHODS + ("ar-copy",)
    cells = []
    total = len(ratios) * len(slots_axis) * sum(len(p) for p in prompts.values())
    print(f"host axis: host lane at {', '.join(f'{r:g}x' for r in ratios)} the link's bandwidth x "
          f"{len(slots_axis)} slot counts, at the default link")
    with tqdm(total=total, desc="host axis", unit="prompt") as bar:
        for ratio in ratios:
            host = embedded.default_host(ratio, cell_link)
            for slots in slots_axis:
                instances, _ = load_instances(methods, slots, cell_link, prepare=prepare,
                                              fp8=getattr(args, "fp8", False), host=host)
                for w, ids in prompts.items():
                    runs = side_by_side(instances, ids, tokens, on_prompt=lambda i: bar.update(1))
                    cell = map_cell(MAP_HOST_LINK, slots, w, len(ids) - 1, runs)
                    cell.update(host_ratio=ratio, host_per_token={m: c.host_experts_per_token
                                                                  for m, c in runs.counters.items()})
                    cells.append(cell)
    return cells


def map_cell(ratio: float, slots: int, workload: str, prompts: int, runs) -> dict:
    """One cell of the map from what ``side_by_side`` measured: tok/s of whole calls per method, SpecFit over the
    best baseline, and SpecFit's figures (nodes and tokens per cycle, both forecasts, the copies' cost)."""
    tok_s = {m: runs.counters[m].new_tokens / runs.seconds[m] if runs.seconds[m] else 0.0 for m in runs.counters}
    best = max(MAP_BASELINES, key=lambda m: tok_s[m])
    sf = runs.counters["specfit"]
    return dict(link_ratio=ratio, slots=slots, workload=workload, prompts=prompts, tok_s=tok_s, best_baseline=best,
                specfit_over_best=tok_s["specfit"] / tok_s[best] if tok_s[best] else 0.0,
                specfit_nodes_per_cycle=sf.nodes_per_cycle, specfit_tokens_per_cycle=sf.tokens_per_cycle,
                specfit_expected_over_committed=sf.expected_over_committed,
                specfit_forecast_over_real=sf.forecast_over_real,
                copies_per_token={m: c.copies_per_token for m, c in runs.counters.items()},
                mib_per_token={m: c.mib_copied_per_token for m, c in runs.counters.items()},
                copy_wait_share={m: c.copy_wait_share for m, c in runs.counters.items()},
                hit_rate={m: c.hit_rate for m, c in runs.counters.items()})


def _best(cell: dict) -> float:
    """SpecFit / the best of the baselines in ``cell`` (recomputed from tok/s, so hand-made cells work too)."""
    best = max(cell["tok_s"][m] for m in MAP_BASELINES)
    return cell["tok_s"]["specfit"] / best if best else 0.0


def _map_grid(cells: list[dict], workload: str, value, key: str = "link_ratio") -> tuple[list, list, list[list]]:
    """(ratios, slots, grid[ratio][slot]) of ``value(cell)`` for one workload (None where a cell is missing); rows by
    ``key`` (``"host_ratio"``: the host axis)."""
    ratios = sorted({c[key] for c in cells})
    slots = sorted({c["slots"] for c in cells})
    at = {(c[key], c["slots"]): c for c in cells if c["workload"] == workload}
    return ratios, slots, [[value(at[r, s]) if (r, s) in at else None for s in slots] for r in ratios]


SHORT = {"ar": "A", "eagle3": "E", "prompt-lookup": "P"}  # which baseline was best, in the map's text and PNG


def report(cells: list[dict]) -> str:
    lines = ["\nRegime map (whole generate() calls, wall clock; CPU, emulated link: copying one token's full expert "
             "demand costs <ratio> x its compute; 0 = no link; not GPU speed):"]
    for w in sorted({c["workload"] for c in cells}):
        panels = [("the best of AR, EAGLE-3 and prompt lookup (A/E/P: which)", _best, True)]
        panels += [(LABELS[base], lambda c, b=base: c["tok_s"]["specfit"] / c["tok_s"][b], False)
                   for base in MAP_BASELINES]
        for title, value, tagged in panels:
            ratios, slots, grid = _map_grid(cells, w, value)
            _, _, which = _map_grid(cells, w, lambda c: SHORT[max(MAP_BASELINES, key=lambda m: c["tok_s"][m])])
            lines.append(f"[{w}] SpecFit / {title}; rows: link ratio, columns: slots")
            lines.append("ratio  " + "".join(f"{s:>8}" for s in slots))
            for ratio, row, tags in zip(ratios, grid, which):
                cells_text = [f"{'-':>8}" if v is None else
                              (f"{v:>7.2f}{t}" if tagged else f"{v:>8.2f}") for v, t in zip(row, tags)]
                lines.append(f"{ratio:<7g}" + "".join(cells_text))
    return "\n".join(lines)


def report_host(cells: list[dict]) -> str:
    """The host axis as tables: SpecFit / the best baseline (all on ``cold="auto"``), SpecFit / EAGLE-3, and AR on
    ``"auto"`` / AR with every cold expert copied (what the host lane alone gives)."""
    lines = ["\nHost axis (default link; an emulated host lane reading experts <ratio> x as fast as the link copies "
             "them; every method on cold='auto'; whole calls, wall clock, CPU: not GPU speed):"]
    panels = [("SpecFit / the best of AR, EAGLE-3 and prompt lookup (A/E/P: which)", _best, True),
              ("SpecFit / EAGLE-3", lambda c: c["tok_s"]["specfit"] / c["tok_s"]["eagle3"], False),
              ("AR cold='auto' / AR every cold expert copied", lambda c: c["tok_s"]["ar"] / c["tok_s"]["ar-copy"],
               False)]
    for w in sorted({c["workload"] for c in cells}):
        for title, value, tagged in panels:
            ratios, slots, grid = _map_grid(cells, w, value, "host_ratio")
            _, _, which = _map_grid(cells, w, lambda c: SHORT[max(MAP_BASELINES, key=lambda m: c["tok_s"][m])],
                                    "host_ratio")
            lines.append(f"[{w}] {title}; rows: host lane / link bandwidth, columns: slots")
            lines.append("host   " + "".join(f"{s:>8}" for s in slots))
            for ratio, row, tags in zip(ratios, grid, which):
                lines.append(f"{ratio:<7g}" + "".join(f"{'-':>8}" if v is None else
                                                      (f"{v:>7.2f}{t}" if tagged else f"{v:>8.2f}")
                                                      for v, t in zip(row, tags)))
    return "\n".join(lines)


def plot(cells: list[dict], path: Path, host: bool = False) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'specfit[plot]'): no regime map PNG written")
        return
    workloads = sorted({c["workload"] for c in cells})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.8 * len(workloads), 3.8), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        key = "host_ratio" if host else "link_ratio"
        ratios, slots, grid = _map_grid(cells, w, _best, key)
        _, _, which = _map_grid(cells, w, lambda c: SHORT[max(MAP_BASELINES, key=lambda m: c["tok_s"][m])], key)
        values = [[float("nan") if v is None else v for v in row] for row in grid]
        im = ax.imshow(values, cmap="RdYlGn", vmin=0.6, vmax=1.6, origin="lower", aspect="auto")
        for a in range(len(ratios)):
            for b in range(len(slots)):
                if grid[a][b] is not None:
                    ax.text(b, a, f"{grid[a][b]:.2f}{which[a][b]}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(slots)), [str(s) for s in slots])
        ax.set_yticks(range(len(ratios)), ["none" if r == 0 else f"{r:g}x" for r in ratios])
        ax.set_xlabel("expert slots per layer (of 64)")
        ax.set_ylabel("host lane: its expert bandwidth / the link's" if host else
                      "link: a token's expert copies / its compute")
        ax.set_title(f"{w}: SpecFit / best of AR (A), EAGLE-3 (E), prompt lookup (P)\nwhole calls, wall clock, CPU"
                     + (", emulated host lane, default link" if host else ""), fontsize=8)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"regime map: {path}")
