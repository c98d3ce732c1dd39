"""A route predictor for draft nodes, trained on what decoding actually sees (``specfit train-router``: the command
is ``router_command.py``).

Pairs are collected while decoding calibration prompts (GSM8K *train* questions and OpenStax passages in the
summarisation format) with the EAGLE-3 tree: for every pool node and the root, the drafter's state and the node's
true routes from the route oracle. The head (layers x experts x hidden, initialised from the target's routers) is
trained with a per-layer softmax cross-entropy towards the true top-k set, and saved beside the drafter.
"""

from __future__ import annotations

import torch

from ..decoding.assistants import Eagle3Generator
from ..selection.route_predictor import RoutePredictor
from ..selection.route_sources import oracle_routes


class CollectingGenerator(Eagle3Generator):
    """EAGLE-3 decoding that records (drafter state, true routes) for the root and every pool node."""

    def __init__(self, model, sink: list):
        super().__init__(model)
        self.sink = sink

    def draft(self, cycle):
        tree = super().draft(cycle)
        node_routes, root_routes = oracle_routes(cycle, tree)
        states = torch.cat([self.drafter.root_state[None], self.drafter.states(list(range(len(tree))))])
        routes = torch.cat([torch.from_numpy(root_routes)[None], torch.from_numpy(node_routes)])
        self.sink.append((states.float().cpu(), routes))
        return tree


def collect(model, prompt_ids, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    sink: list = []
    for ids in prompt_ids:
        model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                       assistant=lambda m: CollectingGenerator(m, sink))
    return torch.cat([s for s, _ in sink]), torch.cat([r for _, r in sink])  # [N, H], [N, L, E]


def loss_fn(head: RoutePredictor, states: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(head(states), dim=-1)  # [N, L, E]
    return -(logp * routes).sum(-1).div(routes.sum(-1).clamp(min=1)).mean()


def train(head: RoutePredictor, states, routes, epochs: int = 30, lr: float = 3e-3, batch: int = 256,
          seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(states), generator=g)
        for i in range(0, len(states), batch):
            idx = order[i:i + batch]
            loss = loss_fn(head, states[idx], routes[idx].float())
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.detach().item())
    return losses
