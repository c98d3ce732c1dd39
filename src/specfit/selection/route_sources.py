"""Where the selector gets the routes of draft nodes (bool ``[nodes, layers, experts]``) and of the root.

- Deployable sources estimate routes from the drafter's state without touching the target: ``"predictor"`` (a
  trained route head, ``specfit train-router``) and ``"gate"`` (the target's own routers on drafter states, when the
  drafter's hidden size equals the target's). ``"auto"``, the default, picks the predictor when one is attached,
  else the gates, else refuses with the choices.
- ``"oracle"``: the paper's atlas method, a *measurement device*, used only when asked for. The true routes of every
  pool node come from an extra target forward over root + pool that runs outside the offload (no slot touched, no
  counter moved, no emulated link); the KV entries it writes are dropped again. It costs a forward per drafted level:
  that time is part of the call's wall clock and is shown apart as ``measurement_seconds``.

A route source is any callable ``source(cycle, tree) -> (node_routes [N, L, E], root_routes [L, E])``; ``ROUTE_SOURCES``
maps names to factories ``factory(model) -> source``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..seam import kv_cache, layers as hf_layers
from ..drafting.tree import DraftTree, verify_layout


@dataclass
class Cycle:
    """What a candidate generator may look at during one decoding cycle."""

    model: object
    cache: object
    base: int  # committed positions in the target KV cache; the root goes to position `base`
    root: int  # the root token
    sampling: bool = False  # do_sample: the acceptance model keeps a table per decoding mode
    measurement_seconds: float = 0.0  # measurement-only work in this cycle (the oracle): shown apart, still timed
    drafter: object = None  # the TreeDrafter of this cycle (route predictors read node states from it)


def oracle_routes(cycle: Cycle, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
    t0 = time.perf_counter()
    model, cache = cycle.model, cycle.cache
    n = len(tree) + 1
    capacity = kv_cache.kv_capacity(cache, n, cycle.base)
    layout = verify_layout(tree, range(len(tree)), cycle.root, cycle.base, capacity, hf_layers.compute_dtype(model),
                           model.specfit.staging)
    masks = kv_cache.layer_masks(model, cache, layout.mask, layout.position_ids)  # per layer type (sliding windows)
    with model.specfit.measurement() as recorder, torch.no_grad():
        model(layout.tokens, cache=cache, position_ids=layout.position_ids, attention_mask=masks,
              use_cache=True, logits_to_keep=1)
    kv_cache.crop_kv(cache, cycle.base, current=cycle.base + n)
    routes = recorder.last.numpy()  # [n, L, E]
    cycle.measurement_seconds += time.perf_counter() - t0
    return routes[1:], routes[0]


class PredictedRoutes:
    """Routes of the root and the pool from the drafter's states, through a ``RoutePredictor`` (or the target's own
    routers for ``"gate"``). Part of the timed path: it is what a deployment pays. The head runs inside each drafted
    level's step (``TreeDrafter.route_head``), so its routes reach the host in the level's one transfer."""

    def __init__(self, head):
        self.head = head

    def attach(self, drafter) -> None:
        """Have ``drafter`` (a ``TreeDrafter``) run the head on every node it drafts."""
        drafter.route_head = self.head.routes

    def __call__(self, cycle: Cycle, tree: DraftTree) -> tuple[np.ndarray, np.ndarray]:
        drafter = cycle.drafter
        if drafter.route_head is None:
            raise RuntimeError("PredictedRoutes.attach(drafter) must run before drafting")
        return drafter.routes()


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


AUTO = "auto"


def choose_route_source(model, name: str) -> str:
    """The route source ``name`` stands for on this model: ``"auto"`` becomes ``"predictor"`` when a trained route
    predictor is attached, else ``"gate"`` when the drafter's hidden size equals the target's; other names as given."""
    if name != AUTO:
        if name not in ROUTE_SOURCES:
            raise ValueError(f"unknown route source {name!r}; choose 'auto' or one of {sorted(ROUTE_SOURCES)}")
        return name
    runtime = model.specfit
    if runtime.route_predictor is not None:
        return "predictor"
    drafter = runtime.drafter
    hidden = model.get_input_embeddings().weight.shape[1]
    if drafter is not None and drafter.config.hidden_size == hidden:
        return "gate"
    width = drafter.config.hidden_size if drafter is not None else None
    raise ValueError(f"route_source='auto' found no deployable route source: no route predictor is attached and the "
                     f"drafter's hidden size ({width}) differs from the target's ({hidden}), so the target's gates "
                     f"cannot read its states. Train a predictor (`specfit train-router`, saved beside the drafter, "
                     f"or pass route_predictor=FOLDER), or choose route_source='oracle' (a measurement device: an "
                     f"extra target forward per drafted level)")


def resolve_route_source(model, name: str) -> Callable:
    return ROUTE_SOURCES[choose_route_source(model, name)](model)
