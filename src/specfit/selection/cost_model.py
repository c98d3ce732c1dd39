"""The cycle-time model: ``time = intercepts[n] + beta * demand + miss * misses``.

``n`` is the number of draft nodes a cycle verifies (the root token not counted), ``demand`` the experts the cycle
*computes* (``sum over layers of |union of the experts the verified tokens route to|``) and ``misses`` the experts it
*misses* (those of the demand not resident in the slot cache when the cycle starts: its cold experts, each copied or
computed on the host lane). ``intercepts[n]`` holds everything that does not scale with experts (drafting,
attention, dense layers, launch overhead); ``beta`` is the compute of one expert (real on a CPU, small on a GPU);
``miss`` is the time one cold expert adds: ``copy`` (a copy into a slot) under ``cold="copy"``, ``host`` (computed on
the host lane) under ``"host"``, the cheaper of the two under ``"auto"``, once per cycle and expert. A cycle's misses
are known at selection time from the live residency mask of the slot cache, so the selector prices what the verify
forward will really move or compute on the host (``cost="cache-aware"``, the default). The paper's model is the
special case ``miss = 0``: every expert of demand costs the same ``beta``, resident or not (``cost="paper"``).

One profile per machine and model. ``copy`` belongs to the link, not to the profile: a profile stores
``copy_overhead`` (what a copy costs besides the link's own time: bookkeeping, the slot write) and ``link_share``
(the share of the link's time a cycle waits for), and ``priced(link_seconds)`` makes the model for a link whose one
copy takes ``link_seconds`` (an emulated link: its set time per copy of this expert's bytes; CUDA: bytes over the
measured pinned bandwidth). The host lane likewise: ``host_overhead`` and ``host_share`` of the lane's own time per
expert, ``host_seconds`` (an emulated lane's set time; CUDA: measured once), so ``priced(link_seconds, host_seconds,
cold)`` prices both. Slots change only how often an expert misses, not what a miss costs, so the same profile prices
any slot count, cache mode, link and host lane.

Two rules shape the fit. Verifying more nodes cannot be cheaper at equal demand and misses, so the intercepts never
fall with ``n``: the fit solves non-negative least squares on the *increments* ``intercepts[n] - intercepts[n - 1]
>= 0``. And drafting is paid per level actually drafted: ``draft_level_seconds[l]`` is the time of drafting level
``l + 1``, measured by the probes, which draft every level; ``intercepts`` include all of them, and
``predict(..., levels=L)`` (or ``at_levels(L)``, a model the selector takes as it is) charges only the first ``L``.

No torch here. The fit itself (monotone NNLS) is in ``specfit.selection.cost_fit``, the profile files (their format,
checks and paths) in ``specfit.selection.profile_files``; the probes that produce the records are defined in
``specfit.evaluation.probes``, and the checks of a fit's quality in ``specfit.selection.fit_quality``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np

from ..offload.cold import check_cold
from .cost_fit import as_rows, fit_coefficients
from .profile_files import FORMAT, RESERVED, VERSION, ProfileError, check_meta, field_number, first_non_finite, \
    read_profile

__all__ = ["CostModel", "Record", "ProfileError"]

_TOLERANCE = 1e-12  # seconds: rounding slack when checking that intercepts cover the drafting


class Record(NamedTuple):
    """One timed calibration cycle: ``n_nodes`` draft nodes verified, ``demand`` experts computed, ``seconds``;
    ``misses`` experts copied, each over a link whose own time per copy was ``link_seconds`` (0: no emulated link,
    a plain memcpy); ``host`` experts computed on a host lane whose own time per expert was ``host_seconds``."""

    n_nodes: int
    demand: float
    seconds: float
    misses: float = 0.0
    link_seconds: float = 0.0
    host: float = 0.0
    host_seconds: float = 0.0



@dataclass(frozen=True)
class CostModel:
    """Predicted cycle time ``intercepts[n_nodes] + beta * demand + copy * misses``, in seconds.

    Attributes:
        intercepts: fixed time of a cycle verifying ``n`` draft nodes, for ``n = 0 .. len(intercepts) - 1``, when
            the drafter drafts ``draft_levels`` levels (what the calibration probes drafted; all of them).
        beta: seconds per expert computed (of demand, resident or not).
        meta: provenance, stored next to the numbers in the profile (device, model_id, fit quality, date, ...);
            JSON-serialisable values. ``meta["quality"]``, when present, is the calibration's verdict on the fit
            (see ``specfit.selection.fit_quality``); ``meta["paper"]`` the same probes fitted on demand alone.
        draft_level_seconds: seconds of drafting level ``1, 2, ..`` each (empty: drafting is not modelled per level,
            and ``levels`` cannot be asked for). Every intercept includes all of them.
        copy: seconds per expert copied, for the link this model is priced at (0: copies cost nothing beyond
            ``beta``, the paper's model). ``priced(link_seconds)`` sets it from the two fields below.
        copy_overhead: seconds a copy adds beside the link's own time; None for a demand-only model.
        link_share: the share of the link's time per copy a cycle waits for; None for a demand-only model.
        host: seconds per expert computed on the host lane this model is priced at (``priced`` sets it).
        host_overhead: seconds a host expert adds beside the lane's own time; None for a model fitted without a
            host lane (a profile from before issue 36).
        host_share: the share of the lane's time per host expert a cycle waits for; None with ``host_overhead``.
        cold: how the selector prices a cold expert (``miss``): ``"copy"``, ``"host"``, or ``"auto"`` (the
            cheaper of the two).

    >>> m = CostModel(intercepts=(0.10, 0.11, 0.12), beta=0.2e-3, draft_level_seconds=(0.002, 0.004, 0.004))
    >>> round(m.predict(2, demand=500), 6)      # 0.12 + 500 * 0.0002: all three levels drafted
    0.22
    >>> round(m.predict(2, demand=500, levels=1), 6)   # level 2 and 3 not drafted: 0.008 s less
    0.212
    >>> c = CostModel((0.10, 0.11), beta=1e-5, copy_overhead=2e-5, link_share=1.0).priced(link_seconds=3e-4)
    >>> round(c.copy, 9), round(c.predict(1, demand=400, misses=30), 6)   # 0.11 + 400 * 1e-5 + 30 * 3.2e-4
    (0.00032, 0.1236)
    """

    intercepts: tuple[float, ...]
    beta: float
    meta: dict = field(default_factory=dict, hash=False)
    draft_level_seconds: tuple[float, ...] = ()
    copy: float = 0.0
    copy_overhead: float | None = None
    link_share: float | None = None
    host: float = 0.0
    host_overhead: float | None = None
    host_share: float | None = None
    cold: str = "copy"

    def __post_init__(self):
        intercepts = tuple(field_number(a, f"intercepts[{i}]") for i, a in enumerate(self.intercepts))
        if not intercepts:
            raise ValueError("field 'intercepts' must hold at least one value (n = 0)")
        object.__setattr__(self, "intercepts", intercepts)
        object.__setattr__(self, "beta", field_number(self.beta, "beta"))
        object.__setattr__(self, "copy", field_number(self.copy, "copy"))
        if (self.copy_overhead is None) != (self.link_share is None):
            raise ValueError("fields 'copy_overhead_s' and 'link_share' come together (a model that prices copies) "
                             "or not at all (a demand-only model)")
        if self.copy_overhead is not None:
            object.__setattr__(self, "copy_overhead", field_number(self.copy_overhead, "copy_overhead_s"))
            object.__setattr__(self, "link_share", field_number(self.link_share, "link_share"))
        object.__setattr__(self, "host", field_number(self.host, "host"))
        if (self.host_overhead is None) != (self.host_share is None):
            raise ValueError("fields 'host_overhead_s' and 'host_share' come together (a model that prices the host "
                             "lane) or not at all")
        if self.host_overhead is not None:
            object.__setattr__(self, "host_overhead", field_number(self.host_overhead, "host_overhead_s"))
            object.__setattr__(self, "host_share", field_number(self.host_share, "host_share"))
        check_cold(self.cold)
        levels = tuple(field_number(t, f"draft_level_seconds[{i}]") for i, t in enumerate(self.draft_level_seconds))
        object.__setattr__(self, "draft_level_seconds", levels)
        if sum(levels) > min(intercepts) + _TOLERANCE:
            raise ValueError(f"field 'draft_level_seconds' sums to {sum(levels)!r} s, more than the smallest intercept "
                             f"({min(intercepts)!r} s); every intercept includes the drafting of all levels")
        if not isinstance(self.meta, dict):
            raise ValueError(f"field 'meta' must be a dict, got {type(self.meta).__name__}")
        bad = first_non_finite(self.meta)
        if bad is not None:
            raise ValueError(f"field {bad[0]!r} is {bad[1]!r}: a profile's numbers (fit quality included) must be "
                             f"finite, or null where a figure is undefined")
        clash = [k for k in self.meta if k in RESERVED]
        if clash:
            raise ValueError(f"meta may not use the reserved profile field(s) {clash}")

    @property
    def max_nodes(self) -> int:
        """The largest node count this model predicts for."""
        return len(self.intercepts) - 1

    @property
    def draft_levels(self) -> int:
        """How many drafted levels the intercepts include (0: drafting is not modelled per level)."""
        return len(self.draft_level_seconds)

    @property
    def monotone(self) -> bool:
        """Whether the intercepts never fall with the node count (every fit since profile version 2 is)."""
        return all(b >= a for a, b in zip(self.intercepts, self.intercepts[1:]))

    @property
    def quality(self) -> dict | None:
        """The calibration's verdict on this fit (``meta["quality"]``), or None for a model that was not assessed."""
        return self.meta.get("quality")

    @property
    def prices_copies(self) -> bool:
        """Whether this model has a copy coefficient of its own (a version-3 profile), so ``priced`` can carry it
        to any link; a demand-only model (the paper's, or a version-1/2 profile) has none."""
        return self.copy_overhead is not None

    @property
    def prices_host(self) -> bool:
        """Whether this model has a host coefficient of its own (fitted on a host lane), so ``priced`` can carry it
        to any lane; without one a host expert is priced at the lane's own time."""
        return self.host_overhead is not None

    @property
    def miss(self) -> float:
        """Seconds one cold expert (of the demand, not resident) adds, as ``cold`` computes it: its copy, its host
        time, or under ``"auto"`` the cheaper of the two (the selector's price per missing expert).

        >>> CostModel((0.1,), 0.0, copy=3e-4, host=1e-4, cold="auto").miss
        0.0001
        """
        if self.cold == "copy":
            return self.copy
        return self.host if self.cold == "host" else min(self.copy, self.host)

    def priced(self, link_seconds: float, host_seconds: float | None = None, cold: str = "copy") -> "CostModel":
        """This profile on a link whose own time per expert copy is ``link_seconds`` (0: no link, a memcpy):
        ``copy = copy_overhead + link_share * link_seconds``; and, with ``cold`` other than ``"copy"``, on a host lane
        whose own time per expert is ``host_seconds``: ``host = host_overhead + host_share * host_seconds`` (the
        lane's own time where the profile has no host term).

        >>> round(CostModel((0.1,), 1e-5, copy_overhead=1e-5, link_share=0.9).priced(1e-3).copy, 9)
        0.00091
        >>> m = CostModel((0.1,), 1e-5, copy_overhead=1e-5, link_share=1.0, host_overhead=2e-5, host_share=0.5)
        >>> round(m.priced(1e-3, 4e-4, "auto").miss, 9)   # the host: 2e-5 + 0.5 * 4e-4, below the copy's 1.01e-3
        0.00022
        """
        if not self.prices_copies:
            raise ValueError("this cost model prices demand only (the paper's model, or a profile from before "
                             "version 3): it has no copy coefficient to carry to a link; recalibrate with this "
                             "version of `specfit calibrate`")
        link_seconds = field_number(link_seconds, "link_seconds")
        check_cold(cold)
        meta = {**self.meta, "priced_link_seconds": link_seconds}
        host = 0.0
        if cold != "copy":
            if host_seconds is None:
                raise ValueError(f"cold={cold!r} prices host experts: give the host lane's seconds per expert")
            meta["priced_host_seconds"] = host_seconds = field_number(host_seconds, "host_seconds")
            host = self.host_overhead + self.host_share * host_seconds if self.prices_host else host_seconds
        return replace(self, copy=self.copy_overhead + self.link_share * link_seconds, host=host, cold=cold,
                       meta=meta)

    def paper(self) -> "CostModel":
        """The paper's demand-only model (``cost="paper"``): this model itself when it prices demand only, else the
        same probes fitted on demand alone (``meta["paper"]``), which is valid only at the slot count and link the
        calibration ran with (recorded in its meta).

        >>> m = CostModel((0.02,), 1e-5, {"paper": {"intercepts": [0.025], "beta": 3e-4, "slots": 12}},
        ...               copy_overhead=0.0, link_share=1.0)
        >>> m.paper().beta, m.paper().meta["slots"]
        (0.0003, 12)
        """
        if not self.prices_copies:
            return self
        extra = self.meta.get("paper")
        if not isinstance(extra, dict) or "intercepts" not in extra or "beta" not in extra:
            raise ValueError("cost='paper' needs the profile's fit on demand alone, and this profile has none; "
                             "recalibrate with this version of `specfit calibrate`")
        levels = extra.get("draft_level_seconds", self.draft_level_seconds)
        meta = {"source": "paper fit", **{k: v for k, v in extra.items()
                                          if k not in ("intercepts", "beta", "draft_level_seconds")}}
        return CostModel(tuple(extra["intercepts"]), extra["beta"], meta, tuple(levels))

    def drafting_seconds(self, levels: int) -> float:
        """Time to draft ``levels`` levels: the measured levels, then the last one's time for each deeper level."""
        if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 0:
            raise ValueError(f"levels must be an int >= 0, got {levels!r}")
        if not self.draft_level_seconds:
            raise ValueError("this cost model does not model drafting per level (no draft_level_seconds; a "
                             "version-1 profile or a hand-made model): recalibrate with `specfit calibrate`")
        measured = self.draft_level_seconds
        return sum(measured[:levels]) + max(0, levels - len(measured)) * measured[-1]

    def at_levels(self, levels: int) -> "CostModel":
        """The same model for a cycle that drafts ``levels`` levels: every intercept charges those levels instead of
        the ``draft_levels`` the probes drafted. Pass it to the selector as it is.

        >>> m = CostModel((0.10, 0.11), beta=1e-4, draft_level_seconds=(0.01, 0.02))
        >>> [round(a, 6) for a in m.at_levels(1).intercepts], m.at_levels(1).draft_levels
        ([0.08, 0.09], 1)
        """
        shift = self.drafting_seconds(levels) - sum(self.draft_level_seconds)
        extra = self.draft_level_seconds[:levels] + (self.draft_level_seconds[-1],) * max(0, levels - self.draft_levels)
        return replace(self, intercepts=tuple(max(a + shift, 0.0) for a in self.intercepts), meta=dict(self.meta),
                       draft_level_seconds=extra)

    def predict(self, n_nodes: int, demand: float, levels: int | None = None, misses: float = 0.0) -> float:
        """Predicted seconds for a cycle verifying ``n_nodes`` draft nodes that computes ``demand`` experts, ``misses``
        of them cold (each priced at ``miss``), having drafted ``levels`` levels (None: the ``draft_levels`` the
        intercepts include). With ``levels=0`` nothing was drafted, so nothing can be verified: ``n_nodes`` must be 0."""
        if not 0 <= n_nodes <= self.max_nodes:
            raise ValueError(f"n_nodes={n_nodes} is outside the fitted range 0..{self.max_nodes}")
        fixed = self.intercepts[n_nodes]
        if levels is not None:
            if levels == 0 and n_nodes > 0:
                raise ValueError(f"n_nodes={n_nodes} with levels=0: a cycle that drafts nothing verifies no node")
            fixed = max(fixed + self.drafting_seconds(levels) - sum(self.draft_level_seconds), 0.0)
        return fixed + self.beta * demand + self.miss * misses

    def record_seconds(self, record) -> float:
        """A calibration record's predicted seconds (``Record`` or its fields): its copies priced at the link it ran
        over, its host experts at the lane it ran on (this model's own prices where it has no such term)."""
        r = Record(*record)
        copy = self.copy_overhead + self.link_share * r.link_seconds if self.prices_copies else self.copy
        host = self.host_overhead + self.host_share * r.host_seconds if self.prices_host else r.host_seconds
        return self.predict(r.n_nodes, r.demand) + copy * r.misses + host * r.host

    @classmethod
    def fit(cls, records: Iterable, max_nodes: int | None = None, draft_level_seconds=(), kind: str = "paper",
            **meta) -> "CostModel":
        """Fit intercepts and the expert coefficients to timed cycles by non-negative least squares, with intercepts
        that cannot fall.

        Args:
            records: ``Record``s or tuples ``(n_nodes, demand, seconds[, misses, link_seconds])``; ``seconds``
                includes the drafting of every level (the probes draft them all).
            max_nodes: the last intercept to return; defaults to the largest ``n_nodes`` seen.
            draft_level_seconds: measured drafting time of each level (see the class); the smallest intercept is
                held at or above their sum, since every cycle the probes timed paid them.
            kind: ``"paper"``, demand alone (``beta`` per expert computed, copies not told apart); ``"cache-aware"``,
                demand and copies (``beta``, ``copy_overhead``, ``link_share``; see ``fit_coefficients``). A
                cache-aware model comes back priced at the link of its records' first copy
                (``priced(link_seconds)`` moves it to another).
            **meta: provenance stored in ``meta`` (device, model_id, ...). It may override the fit-quality keys the
                fit writes (``r2``, ``rms_residual_s``, ``max_abs_residual_s``, ``n_records``, ``observed_nodes``,
                ``date``), e.g. a fixed ``date`` for a reproducible file.

        >>> recs = [(n, d, 0.1 + 0.01 * n + 2e-4 * d) for n in range(3) for d in (100, 300, 600)]
        >>> m = CostModel.fit(recs, date="2025-01-01")
        >>> [round(a, 6) for a in m.intercepts], round(m.beta, 9), m.meta["n_records"]
        ([0.1, 0.11, 0.12], 0.0002, 9)
        """
        rows = as_rows(records)
        levels = tuple(field_number(t, f"draft_level_seconds[{i}]") for i, t in enumerate(draft_level_seconds))
        top = None if max_nodes is None else int(max_nodes)
        coef = fit_coefficients(rows, top, floor=sum(levels), kind=kind)
        residual = rows[:, 2] - coef.predict(rows)
        seconds = rows[:, 2]
        spread = float(np.sum((seconds - seconds.mean()) ** 2))
        quality = {
            "r2": 1.0 - float(residual @ residual) / spread if spread > 0 else None,
            "rms_residual_s": float(np.sqrt(np.mean(residual**2))),
            "max_abs_residual_s": float(np.max(np.abs(residual))),
            "n_records": len(rows),
            "observed_nodes": coef.observed,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        model = cls(tuple(coef.intercepts), coef.beta, {**quality, **meta}, levels)
        if kind == "paper":
            return model
        copied = rows[rows[:, 3] > 0]
        link = float(copied[0, 4]) if len(copied) else 0.0
        model = replace(model, copy_overhead=coef.copy_overhead, link_share=coef.link_share,
                        host_overhead=coef.host_overhead, host_share=coef.host_share)
        hosted = rows[rows[:, 5] > 0]
        if len(hosted):  # priced at the first lane the records ran on, choosing per expert as "auto" does
            return model.priced(link, float(hosted[0, 6]), "auto")
        return model.priced(link)

    @classmethod
    def default(cls, max_nodes: int = 7) -> "CostModel":
        """A rough placeholder for when no profile exists; the caller warns loudly when it uses it.

        ``beta`` is the paper's A100 PCIe 40GB figure with the slot cache, 0.211 ms per expert. The intercepts are
        flat at 0.133 s, which is what the paper's own numbers imply for autoregressive decoding on that machine:
        1 / 4.67 tok/s - 384 experts (48 layers x top-8) * 0.211 ms = 0.214 - 0.081 = 0.133 s. Real intercepts grow
        with the node count and differ by device and model: calibrate (``specfit calibrate``).
        """
        return cls((0.133,) * (max_nodes + 1), 0.211e-3, {"source": "default"})

    def to_json(self) -> dict:
        """The profile as a JSON object: format tag, version, units, intercepts, beta, the drafting time of each
        level, the copy coefficient's two parts (a model that prices copies), then the meta fields. ``copy`` is
        not stored: it belongs to the link the profile is used with."""
        data = {"format": FORMAT, "version": VERSION, "units": "seconds", "intercepts": list(self.intercepts),
                "beta": self.beta, "draft_level_seconds": list(self.draft_level_seconds)}
        if self.prices_copies:
            data.update(copy_overhead_s=self.copy_overhead, link_share=self.link_share)
        if self.prices_host:
            data.update(host_overhead_s=self.host_overhead, host_share=self.host_share)
        meta = {k: v for k, v in self.meta.items() if k not in ("priced_link_seconds", "priced_host_seconds")}
        return {**data, **meta}

    def save(self, path) -> Path:
        """Write the profile to ``path`` (parent folders created; written to a temporary file, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path, expect: dict | None = None) -> "CostModel":
        """Read a profile; ``expect`` names meta fields that must match, e.g. ``{"model_id": "Qwen/Qwen3-30B-A3B"}``.

        A version-3 profile prices copies (``copy_overhead_s``, ``link_share``); load it, then ``priced(...)`` it
        for the link at hand. Profiles of versions 1 and 2 still load as demand-only models fitted for one slot
        count and link (``meta["slots"]``, ``meta["link"]``); a version-1 profile models no drafting per level, and
        its ``meta["quality"]`` says ``"unassessed"`` with the reasons (``specfit.enable`` warns about it).

        Raises:
            ProfileError: naming the file and the field, for unreadable JSON, a missing or malformed field, or a
                mismatch with ``expect``.
        """
        path = Path(path)
        fields = read_profile(path)
        try:
            model = cls(**fields)
        except ValueError as e:
            raise ProfileError(f"{path}: {e}") from None
        check_meta(path, model.meta, expect)
        return model
