"""The acceptance model: how likely the target is to accept each drafted child, calibrated on what it did.

Vocabulary (shared with ``selector``):

- A drafted *child* ``v`` has a *depth* (1: a child of the root), a *rank* among its siblings (1: the drafter's top
  choice at the parent, 2: its second, ...) and a *conditional draft probability* ``q``, the drafter's probability of
  its token at the parent (``path_prob(v) / path_prob(parent)``).
- The *acceptance estimate* ``a(v)`` is the probability that the target accepts ``v`` given that it accepted ``v``'s
  parent (the root token is always accepted).
- The *path value* of ``v`` is the product of the estimates from the root down to ``v``: the probability that ``v``
  is accepted. The *expected committed tokens* of a verified subtree are ``1 + sum of its path values`` (the bonus
  token included). The paper uses path probabilities (products of ``q``) instead; under greedy decoding a drafter's
  probability understates acceptance for its top-ranked child and overstates it for lower ranks.
- A *label* is what the target did with a drafted child of a node it scored. Greedy: ``1`` when the child's token
  is the target's choice at the parent, else ``0``. Sampling: the target's probability of the child's token, which
  under the one-hot draft scheme is exactly the chance the child is accepted (see ``decoding/acceptance.py``).

Estimates live in *buckets* of (depth, rank, q-bin), ``q`` binned on a logit scale; depths and ranks beyond the
table's last are pooled into it. ``AcceptanceTable`` holds offline evidence per bucket, fitted on calibration
prompts; ``AcceptanceTables`` pairs a greedy and a sampling table and is saved as ``acceptance.json`` beside the
drafter. ``AcceptanceModel`` starts from a table and learns online, with decay. Each bucket level backs off to a
coarser one, (depth, rank, bin) -> (rank, bin) -> (rank) -> everything::

    est(all)    = (s + k t) / (n + k),  t = the table's rate
    est(bucket) = (s + k m) / (n + k),  m = sigmoid(logit t(bucket) + logit est(coarser) - logit t(coarser))

with ``s`` and ``n`` the bucket's decayed sum of labels and count of them, and ``k`` the prior strength in
pseudo-labels. A bucket with few labels follows its coarser bucket's *shift* from the table: a prompt that drafts
better than the calibration prompts moves every estimate within a few cycles, while the table keeps the shape (how
depth, rank and ``q`` matter). A bucket with many labels follows them.

No torch here: plain Python, cheap enough to run for every drafted node (a prediction is a bisect and a dict lookup
once its bucket was estimated this cycle).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

__all__ = ["AcceptanceTable", "AcceptanceTables", "AcceptanceModel", "Q_EDGES", "FILENAME", "MODES",
           "DEFAULT_GREEDY_CURVE"]

FORMAT, VERSION = "specfit-acceptance", 1
FILENAME = "acceptance.json"  # beside the drafter
MODES = ("greedy", "sampling")
# q-bin edges: logit -4, -3, ..., 4 (0.018 ... 0.982), ten bins, finest where q is near 0 or 1
Q_EDGES = tuple(1.0 / (1.0 + math.exp(-x)) for x in range(-4, 5))
MAX_DEPTH, MAX_RANK = 6, 3  # deeper nodes and lower ranks share the last bucket
TABLE_STRENGTH = 2.0  # pseudo-labels a sparse offline bucket borrows from its coarser bucket
EPS = 1e-3  # estimates are kept in [EPS, 1 - EPS] on the logit scale

# The default greedy prior, used for a drafter without a table: greedy acceptance against q, pooled over ranks and
# depths, measured with the EAGLE-3 assistant on the embedded model (12 GSM8K + 12 CNN/DailyMail test prompts,
# 64 new tokens; shared/notes/acceptance-calibration.md): (mean q of a bucket, accepted fraction), both workloads
# weighted by node counts; linear in between, 0 at q = 0 and capped at 0.99. The sampling prior is q itself: a
# drafter trained to match the target's distribution has q close to the target's probability, the sampling label.
DEFAULT_GREEDY_CURVE = ((0.0, 0.0), (0.055, 0.19), (0.175, 0.507), (0.377, 0.759), (0.616, 0.936), (0.80, 0.965),
                        (0.967, 0.99), (1.0, 0.99))
DEFAULT_COUNT = 10.0  # labels per bucket the default tables stand for (only their rates matter online)


def _logit(p: float) -> float:
    p = min(max(p, EPS), 1.0 - EPS)
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def bin_centers(edges=Q_EDGES) -> list[float]:
    """A representative ``q`` per bin: the midpoint on the logit scale (outer bins: one logit unit past the edge)."""
    cuts = [_logit(e) for e in edges]
    cuts = [cuts[0] - 1.0] + cuts + [cuts[-1] + 1.0]
    return [_sigmoid((a + b) / 2) for a, b in zip(cuts, cuts[1:])]


def _interpolate(curve, q: float) -> float:
    for (q0, a0), (q1, a1) in zip(curve, curve[1:]):
        if q <= q1:
            return a0 + (a1 - a0) * (q - q0) / (q1 - q0)
    return curve[-1][1]


@dataclass(frozen=True)
class AcceptanceTable:
    """Offline evidence for one decoding mode: per bucket ``(depth, rank, bin)``, (sum of labels, number of labels).

    ``bin`` indexes ``edges`` as ``bisect_right(edges, q)``: 0 for ``q < edges[0]``, ``len(edges)`` for the last.
    """

    counts: dict = field(default_factory=dict)  # (depth, rank, bin) -> (label sum, labels)
    edges: tuple = Q_EDGES
    max_depth: int = MAX_DEPTH
    max_rank: int = MAX_RANK

    def bucket(self, depth: int, rank: int, q: float) -> tuple[int, int, int]:
        return (min(depth, self.max_depth), min(rank, self.max_rank), bisect_right(self.edges, q))

    @classmethod
    def fit(cls, records: Iterable, edges=Q_EDGES, max_depth: int = MAX_DEPTH,
            max_rank: int = MAX_RANK) -> "AcceptanceTable":
        """Sum ``(depth, rank, q, label)`` records into buckets."""
        table = cls({}, tuple(edges), max_depth, max_rank)
        counts = table.counts
        for depth, rank, q, label in records:
            key = table.bucket(depth, rank, q)
            s, n = counts.get(key, (0.0, 0.0))
            counts[key] = (s + float(label), n + 1.0)
        return table

    @property
    def labels(self) -> float:
        return sum(n for _, n in self.counts.values())

    def keys(self):
        """Every bucket of every level: fine ``(d, r, b)``, then ``(r, b)``, ``(r,)`` and ``()``."""
        bins = range(len(self.edges) + 1)
        ranks = range(1, self.max_rank + 1)
        return ([(d, r, b) for d in range(1, self.max_depth + 1) for r in ranks for b in bins]
                + [(r, b) for r in ranks for b in bins] + [(r,) for r in ranks] + [()])

    def rates(self, strength: float = TABLE_STRENGTH) -> dict:
        """The table's acceptance rate for every bucket of every level (keys as ``keys()``): each level's rate
        shrunk towards its coarser bucket's by ``strength`` pseudo-labels, so an empty bucket takes its parent's."""
        sums: dict = {}
        for (d, r, b), (s, n) in self.counts.items():
            for key in ((d, r, b), (r, b), (r,), ()):
                s0, n0 = sums.get(key, (0.0, 0.0))
                sums[key] = (s0 + s, n0 + n)
        s, n = sums.get((), (0.0, 0.0))
        rates = {(): (s + 1.0) / (n + 2.0)}  # a uniform Beta(1, 1) prior for the whole table
        for key in self.keys()[::-1][1:]:  # coarse to fine: parents first
            s, n = sums.get(key, (0.0, 0.0))
            rates[key] = (s + strength * rates[_parent(key)]) / (n + strength)
        return rates

    def as_dict(self) -> dict:
        return {"edges": list(self.edges), "max_depth": self.max_depth, "max_rank": self.max_rank,
                "buckets": [[d, r, b, s, n] for (d, r, b), (s, n) in sorted(self.counts.items())]}

    @classmethod
    def from_dict(cls, data: dict) -> "AcceptanceTable":
        table = cls({}, tuple(float(e) for e in data["edges"]), int(data["max_depth"]), int(data["max_rank"]))
        if list(table.edges) != sorted(table.edges) or not all(0.0 < e < 1.0 for e in table.edges):
            raise ValueError(f"acceptance table edges must be increasing, inside (0, 1): {table.edges}")
        for d, r, b, s, n in data["buckets"]:
            if not (1 <= d <= table.max_depth and 1 <= r <= table.max_rank and 0 <= b <= len(table.edges)
                    and 0 <= s <= n):
                raise ValueError(f"acceptance table bucket {[d, r, b, s, n]} is out of range")
            table.counts[(int(d), int(r), int(b))] = (float(s), float(n))
        return table


def _parent(key: tuple) -> tuple:
    """(d, r, b) -> (r, b) -> (r,) -> ()."""
    return key[1:] if len(key) == 3 else key[:1] if len(key) == 2 else ()


@dataclass(frozen=True)
class AcceptanceTables:
    """A greedy and a sampling table with what they were fitted on; ``acceptance.json`` beside the drafter."""

    greedy: AcceptanceTable
    sampling: AcceptanceTable
    meta: dict = field(default_factory=dict)

    def __getitem__(self, mode: str) -> AcceptanceTable:
        if mode not in MODES:
            raise KeyError(f"acceptance mode must be one of {MODES}, got {mode!r}")
        return getattr(self, mode)

    @classmethod
    def default(cls) -> "AcceptanceTables":
        """The documented prior for a drafter without a table: greedy, ``DEFAULT_GREEDY_CURVE`` at each bin's
        representative ``q``; sampling, ``q`` itself. Online labels correct both within a few cycles."""
        centers = bin_centers()
        greedy, sampling = AcceptanceTable(), AcceptanceTable()
        for d in range(1, MAX_DEPTH + 1):
            for r in range(1, MAX_RANK + 1):
                for b, q in enumerate(centers):
                    greedy.counts[(d, r, b)] = (DEFAULT_COUNT * _interpolate(DEFAULT_GREEDY_CURVE, q), DEFAULT_COUNT)
                    sampling.counts[(d, r, b)] = (DEFAULT_COUNT * q, DEFAULT_COUNT)
        return cls(greedy, sampling, {"source": "default prior (selection/acceptance_model.py)"})

    def save(self, path) -> Path:
        path = Path(path)
        data = {"format": FORMAT, "version": VERSION, "meta": self.meta,
                **{mode: self[mode].as_dict() for mode in MODES}}
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path) -> "AcceptanceTables":
        path = Path(path)
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a SpecFit acceptance table (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"{path} has acceptance table version {data.get('version')!r}; this SpecFit reads "
                             f"version {VERSION}: refit it (`specfit calibrate --acceptance-only`)")
        return cls(AcceptanceTable.from_dict(data["greedy"]), AcceptanceTable.from_dict(data["sampling"]),
                   data.get("meta", {}))


class AcceptanceModel:
    """Online acceptance estimates for one decoding mode, starting from an ``AcceptanceTable``.

    Args:
        table: the prior (offline evidence).
        strength: pseudo-labels of prior each bucket holds against its own labels (``k`` in the module docstring).
        decay: each ``update`` multiplies the weight of every earlier label by this (1.0: never forget). With about
            ten labels per cycle, 0.98 keeps roughly the last 50 cycles' worth.

    Buckets are kept as flat lists (fine index ``((depth - 1) * ranks + rank - 1) * bins + bin``): a prediction is a
    bisect and a list lookup once its bucket was estimated since the last update.

    >>> model = AcceptanceModel(AcceptanceTables.default().greedy)
    >>> round(model.predict(1, 1, 0.3), 2)
    0.76
    >>> model.update([(1, 1, 0.3, 0.0), (1, 1, 0.3, 1.0)] * 20)  # a prompt on which half of them are accepted
    >>> round(model.predict(1, 1, 0.3), 2), round(model.predict(2, 1, 0.3), 2)  # its bucket, and a neighbour too
    (0.5, 0.52)
    """

    def __init__(self, table: AcceptanceTable, strength: float = 4.0, decay: float = 0.98):
        if not strength > 0:
            raise ValueError(f"strength must be > 0 pseudo-labels, got {strength!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.table, self.strength, self.decay = table, float(strength), float(decay)
        self._edges, self._depth, self._rank = table.edges, table.max_depth, table.max_rank
        self._bins = len(table.edges) + 1
        rb = self._rank * self._bins
        rates = table.rates()
        # prior logits per level: fine (d, r, b), mid (r, b), rank (r), all
        self._prior = [_logit(rates[(d, r, b)]) for d in range(1, self._depth + 1) for r in range(1, self._rank + 1)
                       for b in range(self._bins)]
        self._prior_mid = [_logit(rates[(r, b)]) for r in range(1, self._rank + 1) for b in range(self._bins)]
        self._prior_rank = [_logit(rates[(r,)]) for r in range(1, self._rank + 1)]
        self._prior_all = _logit(rates[()])
        # decayed label sums and counts per level, in units of the current weight
        self._s, self._n = [0.0] * len(self._prior), [0.0] * len(self._prior)
        self._s_mid, self._n_mid = [0.0] * rb, [0.0] * rb
        self._s_rank, self._n_rank = [0.0] * self._rank, [0.0] * self._rank
        self._s_all = self._n_all = 0.0
        self._w = 1.0  # the weight of a label now: grows by 1/decay per update instead of decaying every count
        self._memo: list = [None] * len(self._prior)  # fine estimates, until the next update
        self._shift_mid: list = [None] * rb  # logit of a mid bucket's estimate minus its prior's, likewise
        self._shift_rank = self._rank_shifts()  # the same for each rank, after each update
        self.updates = 0

    def predict(self, depth: int, rank: int, q: float) -> float:
        """The acceptance estimate of a drafted child (depth >= 1, rank >= 1, q in [0, 1])."""
        i = (((depth if depth < self._depth else self._depth) - 1) * self._rank
             + (rank if rank < self._rank else self._rank) - 1) * self._bins + bisect_right(self._edges, q)
        est = self._memo[i]
        return est if est is not None else self._estimate(i)

    def update(self, labels: Iterable) -> None:
        """Learn from one cycle's ``(depth, rank, q, label)`` labels; earlier labels weigh ``decay`` times less."""
        self._w /= self.decay
        w, edges, top_d, top_r, bins = self._w, self._edges, self._depth, self._rank, self._bins
        s, n, s_mid, n_mid, s_rank, n_rank = self._s, self._n, self._s_mid, self._n_mid, self._s_rank, self._n_rank
        total = count = 0.0
        for depth, rank, q, label in labels:
            r = (rank if rank < top_r else top_r) - 1
            j = r * bins + bisect_right(edges, q)
            i = ((depth if depth < top_d else top_d) - 1) * top_r * bins + j
            x = w * label
            s[i] += x
            n[i] += w
            s_mid[j] += x
            n_mid[j] += w
            s_rank[r] += x
            n_rank[r] += w
            total += label
            count += 1.0
        self._s_all += w * total
        self._n_all += w * count
        self.updates += 1
        if self._w > 1e150:  # rescale before the floats run out of range; estimates are unchanged
            for values in (s, n, s_mid, n_mid, s_rank, n_rank):
                values[:] = [v / self._w for v in values]
            self._s_all, self._n_all, self._w = self._s_all / self._w, self._n_all / self._w, 1.0
        self._memo = [None] * len(s)
        self._shift_mid = [None] * len(s_mid)
        self._shift_rank = self._rank_shifts()

    @property
    def labels_seen(self) -> float:
        """The decayed number of labels learned so far."""
        return self._n_all / self._w

    def _estimate(self, i: int) -> float:
        """A fine bucket's estimate, memoised until the next update."""
        j = i % len(self._shift_mid)
        shift = self._shift_mid[j]
        if shift is None:
            shift = self._mid_shift(j)
        kw = self.strength * self._w
        rate = 1.0 / (1.0 + math.exp(-(self._prior[i] + shift)))
        est = self._memo[i] = (self._s[i] + kw * rate) / (self._n[i] + kw)
        return est

    def _mid_shift(self, j: int) -> float:
        """How far the estimate of a mid bucket (rank, bin) moved from the table, on the logit scale (memoised until
        the next update); its prior moved as its rank's did."""
        kw = self.strength * self._w
        prior = self._prior_mid[j]
        est = (self._s_mid[j] + kw * _sigmoid(prior + self._shift_rank[j // self._bins])) / (self._n_mid[j] + kw)
        shift = self._shift_mid[j] = _logit(est) - prior
        return shift

    def _rank_shifts(self) -> list[float]:
        """The same for each rank, whose prior moved as the whole table's estimate did."""
        kw = self.strength * self._w
        shift_all = _logit((self._s_all + kw * _sigmoid(self._prior_all)) / (self._n_all + kw)) - self._prior_all
        return [_logit((s + kw * _sigmoid(prior + shift_all)) / (n + kw)) - prior
                for s, n, prior in zip(self._s_rank, self._n_rank, self._prior_rank)]
