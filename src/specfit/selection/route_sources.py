"""Where the selector gets the routes of draft nodes (bool ``[nodes, layers, experts]``) and of the root.

- ``"oracle"``: the paper's atlas method, a *measurement device*. The true routes of every pool node come from a
  target forward over root + pool that runs outside the offload (no slot touched, no counter moved, no emulated
  link) and outside the timed path; the KV entries it writes are dropped again. Not deployable: it costs a forward.
- Predictors (``"gate"``, ``"predictor"``) estimate routes from the drafter's state without touching the target.

A route source is any callable ``source(cycle, tree) -> (node_routes [N, L, E], root_routes [L, E])``; ``ROUTE_SOURCES``
maps names to factories ``factory(model) -> source``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import seam
from ..drafting.tree import DraftTree, verify_layout


@dataclass
class Cycle:
    """What a candidate generator may look at during one decoding cycle."""

    model: object
    cache: object
    base: int  # committed positions in the target KV cache; the root goes to position `base`
    root: int  # the root token
    untimed_seconds: float = 0.0  # measurement-only work, excluded from the timed path
    drafter: object = None  # the TreeDrafter of this cycle (route predictors read node states from it)


def oracle_routes(cycle: Cycle, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    t0 = time.perf_counter()
    model, cache = cycle.model, cycle.cache
    n = len(tree) + 1
    layout = verify_layout(tree, range(len(tree)), cycle.root, cycle.base, seam.kv_capacity(cache, n),
                           seam.compute_dtype(model), model.specfit.device)
    masks = seam.layer_masks(model, cache, layout.mask, layout.position_ids)  # per layer type (sliding windows)
    with model.specfit.measurement() as recorder, torch.no_grad():
        model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=masks,
              use_cache=True, logits_to_keep=1)
    seam.crop_kv(cache, cycle.base)
    routes = recorder.last.numpy()  # [n, L, E]
    cycle.untimed_seconds += time.perf_counter() - t0
    return routes[1:], routes[0]


class PredictedRoutes:
    """Routes of the root and the pool from the drafter's states, through a ``RoutePredictor`` (or the target's own
    routers for ``"gate"``). Part of the timed path: it is what a deployment pays."""

    def __init__(self, head):
        self.head = head

    def __call__(self, cycle: Cycle, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        drafter = cycle.drafter
        states = torch.cat([drafter.root_state[None], drafter.states(list(range(len(tree))))])  # [N+1, H]
        routes = self.head.routes(states).cpu().numpy()  # [N+1, L, E]
        return routes[1:], routes[0]


def gate_routes(model) -> PredictedRoutes:
    from .route_predictor import RoutePredictor

    drafter = model.specfit.drafter
    hidden = model.get_input_embeddings().weight.shape[1]
    if drafter is not None and drafter.config.hidden_size != hidden:
        raise ValueError(f"the 'gate' route source applies the target's routers ([E, {hidden}]) to drafter states of "
                         f"width {drafter.config.hidden_size}; train a predictor (`specfit train-router`) instead")
    return PredictedRoutes(RoutePredictor.from_gates(model))


def predictor_routes(model) -> PredictedRoutes:
    head = model.specfit.route_predictor
    if head is None:
        raise ValueError("route_source='predictor' needs a trained route predictor: pass route_predictor=FOLDER to "
                         "specfit.enable, or keep route_predictor.safetensors beside the drafter "
                         "(`specfit train-router` writes it)")
    return PredictedRoutes(head)


# name -> factory(model) -> source(cycle, tree)
ROUTE_SOURCES: dict[str, Callable] = {"oracle": lambda model: oracle_routes, "gate": gate_routes,
                                      "predictor": predictor_routes}


def register_route_source(name: str, factory: Callable) -> None:
    """``factory(model) -> source``, where ``source(cycle, tree) -> (node_routes [N, L, E], root_routes [L, E])``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"route source name must be an identifier, got {name!r}")
    if not callable(factory):
        raise TypeError(f"route source {name!r} needs a factory(model) -> source(cycle, tree)")
    ROUTE_SOURCES[name] = factory


def resolve_route_source(model, name: str) -> Callable:
    if name not in ROUTE_SOURCES:
        raise ValueError(f"unknown route source {name!r}; registered: {sorted(ROUTE_SOURCES)}")
    return ROUTE_SOURCES[name](model)
