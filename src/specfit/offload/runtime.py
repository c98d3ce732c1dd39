"""``model.specfit``: the state SpecFit attaches to a model — expert store, slot caches, copies, routes, stats,
and the decoding parts (drafter, cost model, route source)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from contextlib import contextmanager

import torch

from ..stats.counters import Counters
from ..stats.scope import Stats
from ..transfer import Staging
from .cache import CopyEngine, LayerCache
from .config import OffloadConfig
from .experts import LayerRuntime
from .grouped_check import choose_experts_path
from .host_compute import LANE_EXPERTS, ROWS_WITH_ROUTES, InlineLane, ThreadedLane, measure_lane
from .host_lane import EmulatedHostLane
from .link import EmulatedLink
from .policies import tree_forecast
from .routes import RouteRecorder
from .standin import for_device
from .store import ExpertStore

log = logging.getLogger("specfit")


class SpecFitRuntime:
    def __init__(self, store: ExpertStore, config: OffloadConfig, device: torch.device,
                 engine: CopyEngine | None = None):
        self.store, self.config, self.device = store, config, torch.device(device)
        standin = for_device(self.device)  # the CPU stand-in's doubles for CUDA's calls (offload/standin.py), or None
        self.cuda = self.device.type == "cuda" or standin is not None  # the CUDA flow: streams, staging, the real lane
        num_layers = len(store.arenas)
        self.stats = Stats()
        self.routes = RouteRecorder(num_layers, store.num_experts)
        self.engine = engine or CopyEngine(self.device, EmulatedLink(config.link) if config.link else None,
                                           standin.streams if standin is not None else None)
        # generate() scopes wait for queued work before reading clocks and counters (a CPU run only reports the wait
        # to the sync counters: specfit.transfer.host_wait)
        self.stats.settle = self.engine.drain
        self.layers = [LayerRuntime(self, i, LayerCache(store, i, config.cache_slots, self.engine,
                                                        config.cache_policy)) for i in range(num_layers)]
        self.staging = Staging(self.device, standin.copies if standin is not None else None)  # index lists reach the device without a host sync
        # experts grouped over all slots where the device can (CUDA, bf16): no per-layer copy of gathered weights
        self.grouped_experts = store.rows_are_weights and choose_experts_path(self.device, store.dtype, store.layout)
        self.forward_counters = Counters()
        # where cold experts are computed (offload/cold.py; switched by the calibration probes) and the host lane
        # that computes them beside the device: emulated on a CPU (config.host), real on CUDA, else none
        self.cold = config.cold
        self.experts_module = None  # the first MoE layer's experts module (set by enable): the real lane is timed on it
        self.lane = InlineLane(EmulatedHostLane(config.host)) if config.host is not None else \
            ThreadedLane(self.device, standin.host_copies if standin is not None else None) if self.cuda else None
        # one call at a time on this model: the slot LRU, the counters, the route recorder, the drafter's features
        # and the pending assistant request are per model (reentrant: generate() holds it across its forwards)
        self.lock = threading.RLock()
        self.untracked = False
        self.request = None  # the assistant of the generate() call in progress
        self.request_served = False  # whether generate() reached SpecFit's loop for it
        self.calibrate_command = None  # the command that fits this machine's cost profile, set by who loaded it
        # decoding parts, set by enable()
        self.drafter = None
        self.options = None
        self.cost_model = None
        self.route_predictor = None
        self.aux_capture = None
        self.backoff = None  # SpecFit's drafting backoff, kept across generate() calls (decoding/learned_state.py)
        self.cost_refresh = None  # SpecFit's online cost-model refresh, kept across calls (selection/cost_refresh.py)
        self.guard = None  # (options, SpecFit's dominance guard), kept across calls (decoding/guard.py)
        # (options, {rows in flight: guard}) and the batch cost model's online refresh: batches' own, kept across
        # calls (decoding/batch_ways.py)
        self.batch_guards = None
        self.batch_refresh = None
        self.cost_source = None  # (cost model, where it came from): set where a profile is found (profiles.py)
        self.profile_read = None  # ((path, mtime, size), the profile read there): profiles.py reads a file once
        # SpecFit's acceptance model (selection/acceptance_model.py): the drafter's tables (set with the drafter;
        # None: the default prior), the online models learned from them per decoding mode (kept across generate()
        # calls), and, when set to a list, a log of (depth, rank, q, estimate, label) per labelled child
        self.acceptance_tables = None
        self.acceptance_models: dict = {}
        self.acceptance_log: list | None = None
        self._restore = None  # what disable() needs; set by enable()
        self.frozen_experts_said = False  # backward was told once that the routed experts get no gradient

    @property
    def num_experts(self) -> int:
        return self.store.num_experts

    @property
    def emulated(self) -> bool:
        return self.engine.link is not None

    @property
    def link_label(self) -> str:
        return self.config.link.label if self.config.link else "real copies"

    @property
    def host_label(self) -> str:
        """What computes host experts: the emulated lane's label, the real host, or none."""
        if self.config.host is not None:
            return self.config.host.label
        return "the host CPU" if self.lane is not None else "no host lane"

    def lane_for(self, num_tokens: int):
        """The host lane a forward of ``num_tokens`` tokens may compute cold experts on, or None (``cold="copy"``,
        no lane; on CUDA under ``"auto"``, a forward too long for its rows to come with the routes: a prefill)."""
        if self.cold == "copy" or self.lane is None:
            return None
        if self.lane.real and self.cold == "auto" and num_tokens > ROWS_WITH_ROUTES:
            return None
        return self.lane

    def copy_seconds(self) -> float:
        """The link's own time for one expert copy (the stored bytes of one expert): the emulated link's set time
        (the one in use), on CUDA the bytes over the measured pinned bandwidth, 0 for a CPU memcpy."""
        if self.engine.link is not None:
            return float(self.engine.link.config.copy_time(self.store.expert_bytes))
        if self.cuda:
            from .bandwidth import copy_seconds

            return copy_seconds(self)
        return 0.0

    def host_seconds(self, tokens: int = 1) -> float | None:
        """The host lane's own time for one expert with ``tokens`` routed to it (an emulated lane's set time; on
        CUDA measured once, at 1 and 32 tokens, on the first expert, by ``measure_once`` at enable); None without a
        lane."""
        if self.lane is None:
            return None
        if self.lane.real and self.lane.measured is None:
            self._measure_lane()
        return self.lane.expert_seconds(self.store.expert_bytes, tokens)

    def measure_once(self) -> None:
        """On CUDA, called by enable(): the link's copy time and the real host lane measured once, here, outside any
        forward (a forward then makes no probe copy and no extra sync; its counters hold only its own copies)."""
        if not self.cuda:
            return
        self.copy_seconds()
        if self.lane is not None and self.lane.real:
            self.host_seconds()

    def link_busy(self) -> float:
        """Seconds of copies the emulated link still has queued (prefetches), 0 elsewhere."""
        return self.engine.link.busy() if self.engine.link is not None else 0.0

    def _measure_lane(self) -> None:
        """Time the real host lane at 1 and 32 tokens, over experts of the first MoE layer in turn (a missed
        expert's bytes come from DRAM, not from the cache one expert timed again and again sits in; once per
        runtime)."""
        import numpy as np

        from .experts import HOST_PATH, host_work, plan_group, rows_by_expert

        if self.experts_module is None:
            raise RuntimeError("the host lane is measured on the model's experts: enable() sets experts_module")
        x = torch.randn(32, self.store.hidden, dtype=self.store.compute_dtype)  # [32, H] on the host
        experts, turn = min(LANE_EXPERTS, self.num_experts), itertools.count()

        def work(tokens):  # each run the next expert, in turn
            each = [host_work(self.experts_module, self.store, 0, x, plan_group(
                rows_by_expert(np.full(tokens, e, dtype=np.int64)), 1, [e], None, HOST_PATH, 0))
                for e in range(experts)]  # expert e <- rows 0..tokens-1
            return lambda: each[next(turn) % experts]()

        measure_lane(self.lane, work)
        log.info("specfit host lane (%d threads): %.3f ms per expert at 1 token, %.1f us per extra token, over %d "
                 "experts in turn", self.lane.threads, self.lane.measured[0] * 1e3, self.lane.measured[1] * 1e6,
                 experts)

    def resident_mask(self):
        """bool [layers, experts]: which experts sit in a device slot now."""
        import numpy as np

        width = self.num_experts
        flat = np.zeros(len(self.layers) * width, dtype=bool)  # [layers * experts]: one write for every layer
        flat[[i * width + e for i, layer in enumerate(self.layers) for e in layer.cache.lru.resident]] = True
        return flat.reshape(len(self.layers), width)

    def prefetch(self, experts) -> None:
        """Start copying the experts of bool [layers, experts] that are not resident, on the prefetch stream (no
        forward waits on them yet; the next forward's demand copies do not queue behind them). Counted in
        ``stats.total`` as copies (bytes now, copy time once landed); those the next forward does not use are
        counted as wasted."""
        for layer, row in zip(self.layers, experts):
            layer.cache.prefetch([int(e) for e in row.nonzero()[0]], self.stats.total)

    def expect_tree(self, weights, node_routes) -> None:
        """A drafted pool as the slot caches' forecast for the next forward (a policy that reads one, e.g.
        ``"forecast"``): per layer and expert, the pool's tokens expected to route there, ``weights`` (each node's
        path value) over ``node_routes`` (bool [nodes, layers, experts]). Does nothing for a policy that ignores
        forecasts."""
        if not self.layers or not self.layers[0].cache.lru.policy.reads_forecasts or not len(weights):
            return
        for layer, row in zip(self.layers, tree_forecast(weights, node_routes)):
            layer.cache.lru.expect(row)

    def clear_cache(self) -> None:
        """Empty every slot of every layer (prefetched experts no forward used count as wasted)."""
        for layer in self.layers:
            layer.cache.clear(self.stats.total)

    @contextmanager
    def serialized(self, what: str = "generate()"):
        """Hold this model's lock (waiting for a call in another thread to finish); yields the seconds waited."""
        t0 = time.perf_counter()
        if not self.lock.acquire(blocking=False):
            log.debug("specfit: %s waits for a call in another thread on this model", what)
            self.lock.acquire()
        waited = time.perf_counter() - t0
        if waited > 1e-3:
            log.debug("specfit: %s waited %.3f s for another thread's call on this model", what, waited)
        try:
            yield waited
        finally:
            self.lock.release()

    # called by forward hooks on the model -----------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.routes.begin()
        if self.untracked:
            return
        self.forward_counters = Counters(forwards=1)
        if self.config.cache_mode == "cleared":
            self.clear_cache()

    def end_forward(self) -> None:
        self.routes.end()
        if self.untracked:
            return
        self.engine.settle(self.forward_counters)  # this forward's copies, timed (its last layer waited for them)
        self.stats.forward_done(self.forward_counters)

    def warn_frozen_experts(self) -> None:
        """Said once per model, at its first backward: the routed experts are frozen while SpecFit holds them."""
        if not self.frozen_experts_said:
            self.frozen_experts_said = True
            warnings.warn("backward() on a SpecFit-enabled model: gradients reach the inputs and every weight in "
                          "model.parameters() (attention, routers, norms, embeddings), none reach the routed experts, "
                          "which are frozen in SpecFit's host store while it is enabled. Call specfit.disable(model) "
                          "first to train the experts", UserWarning, stacklevel=3)

    @contextmanager
    def measurement(self):
        """Forwards inside run outside the offload: no slots touched, no counters, no emulated link. Yields the
        RouteRecorder that receives their routes. Used by the route oracle, a measurement device."""
        if self.untracked:
            raise RuntimeError("measurement() does not nest")
        saved = self.routes
        self.routes = RouteRecorder(saved.num_layers, saved.num_experts)
        self.untracked = True
        try:
            yield self.routes
        finally:
            self.untracked = False
            self.routes = saved

    def __repr__(self) -> str:
        return (f"SpecFitRuntime(moe_layers={len(self.layers)}, experts={self.num_experts}, "
                f"slots={self.config.cache_slots}, cache_mode={self.config.cache_mode!r}, "
                f"cache_policy={self.config.cache_policy!r}, link={self.link_label!r}, "
                f"cold={self.cold!r}, host={self.host_label!r}, "
                f"device={self.device}, pinned_bytes={self.store.pinned_bytes}, "
                f"weight_bytes={self.store.weight_bytes}, pageable_copies={self.stats.total.pageable_copies})")
