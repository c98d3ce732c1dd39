"""What a comparison showed, in one line per workload: SpecFit against the best other method, with the prompt-to-prompt
spread of this run, so a reader can tell a gain from noise. Pure Python (no torch).
"""

from __future__ import annotations

import statistics

LABELS = {"ar": "AR", "eagle3": "EAGLE-3", "eagle3-vanilla": "EAGLE-3 vanilla", "specfit": "SpecFit"}


def verdict(per_prompt: dict[str, list[float]], ours: str = "specfit") -> str:
    """``per_prompt``: method -> tok/s of each prompt (the same prompts, in order). The best other method is the one
    with the highest mean tok/s; the gain is the ratio of the means, the spread the standard deviation over prompts
    of the per-prompt ratio.

    >>> verdict({"ar": [10, 10], "eagle3": [20, 20], "specfit": [22, 24]})
    'SpecFit +15% over EAGLE-3 (spread +-7%, 2 prompts)'
    >>> verdict({"ar": [10, 10], "specfit": [12, 12]})
    'SpecFit +20% over AR (spread under 1%, 2 prompts)'
    """
    others = {m: v for m, v in per_prompt.items() if m != ours}
    if ours not in per_prompt or not others:
        raise ValueError(f"a verdict needs {ours!r} and at least one other method, got {sorted(per_prompt)}")
    counts = {len(v) for v in per_prompt.values()}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(f"every method needs the same prompts (at least one), got counts {sorted(counts)}")
    best = max(others, key=lambda m: statistics.fmean(others[m]))
    mine, theirs = per_prompt[ours], others[best]
    gain = statistics.fmean(mine) / statistics.fmean(theirs) - 1
    n = len(mine)
    head = f"{LABELS.get(ours, ours)} {percent(gain)} over {LABELS.get(best, best)}"
    if n == 1:
        return f"{head} (1 prompt: no spread to judge it by; use more prompts)"
    spread = statistics.stdev(a / b for a, b in zip(mine, theirs))
    tail = ": within the spread, not a clear difference" if abs(gain) <= spread else ""
    shown = f"+-{spread * 100:.0f}%" if spread >= 0.005 else "under 1%"  # never "+-0%", which reads as a loss
    return f"{head} (spread {shown}, {n} prompts){tail}"


def percent(gain: float) -> str:
    """A signed whole percentage, with no "-0%" for a loss that rounds to nothing.

    >>> percent(0.152), percent(-0.004), percent(-0.06)
    ('+15%', '+0%', '-6%')
    """
    return f"{round(gain * 100):+d}%"
