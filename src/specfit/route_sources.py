"""Where the selector gets the routes of draft nodes (bool ``[nodes, layers, experts]``) and of the root.

- ``"oracle"``: the paper's atlas method, a *measurement device*. The true routes of every pool node come from a
  target forward over root + pool that runs outside the offload (no slot touched, no counter moved, no emulated
  link) and outside the timed path; the KV entries it writes are dropped again. Not deployable: it costs a forward.
- Predictors (``"gate"``, ``"predictor"``) estimate routes from the drafter's state without touching the target.

A route source is any callable ``source(cycle, tree) -> (node_routes [N, L, E], root_routes [L, E])``, registered in
``ROUTE_SOURCES`` by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import seam
from .tree import DraftTree, verify_layout


@dataclass
class Cycle:
    """What a candidate generator may look at during one decoding cycle."""

    model: object
    cache: object
    base: int  # committed positions in the target KV cache; the root goes to position `base`
    root: int  # the root token
    untimed_seconds: float = 0.0  # measurement-only work, excluded from the timed path
    notes: dict = field(default_factory=dict)


def oracle_routes(cycle: Cycle, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    t0 = time.perf_counter()
    model, cache = cycle.model, cycle.cache
    n = len(tree) + 1
    dtype = model.get_input_embeddings().weight.dtype
    layout = verify_layout(tree, range(len(tree)), cycle.root, cycle.base, seam.kv_capacity(cache, n), dtype,
                           model.specfit.device)
    with model.specfit.measurement() as recorder, torch.no_grad():
        model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=layout.mask,
              use_cache=True, logits_to_keep=1)
    seam.crop_kv(cache, cycle.base)
    routes = recorder.last.numpy()  # [n, L, E]
    cycle.untimed_seconds += time.perf_counter() - t0
    return routes[1:], routes[0]


ROUTE_SOURCES: dict[str, Callable] = {"oracle": oracle_routes}


def register_route_source(name: str, source: Callable) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"route source name must be an identifier, got {name!r}")
    if not callable(source):
        raise TypeError(f"route source {name!r} must be callable (cycle, tree) -> (node_routes, root_routes)")
    ROUTE_SOURCES[name] = source


def resolve_route_source(source) -> Callable:
    if callable(source):
        return source
    if source not in ROUTE_SOURCES:
        raise ValueError(f"unknown route source {source!r}; registered: {sorted(ROUTE_SOURCES)}")
    return ROUTE_SOURCES[source]
