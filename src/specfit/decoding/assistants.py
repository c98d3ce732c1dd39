"""Assistants: the candidate generators that ``generate(..., assistant=NAME)`` looks up by name.

A tree candidate generator owns phases 1 (draft), 2 (select) and 6 (observe) of the decoding loop:

- ``"eagle3"``: drafts the whole pool (top-k expansion to the full depth and node budget) and verifies the tree
  EAGLE-3 itself would verify: the ``max_nodes`` pool nodes with the highest path probability (EAGLE-2's reranking;
  always ancestor-closed). The paper's baseline.
- ``"specfit"``: after each drafted level, runs the SpecFit selector on the pool so far and stops drafting when the
  winning subtree takes no node of the newest level; verifies exactly the winner. The selector's expected tokens
  are path values from the acceptance model (``acceptance="calibrated"``, the default: per-node acceptance
  estimates, learned online from what the target did with every drafted child it scored), or the paper's path
  probabilities (``acceptance="paper"``). The cost of a subtree is what its verify forward computes and copies
  (``cost="cache-aware"``, the default: experts resident in the slot cache cost their compute, the others their
  compute and a copy, or their time on the host lane, as ``cold=`` computes them), or the paper's demand alone
  (``cost="paper"``). Options: where draft-node routes come from
  (``route_source``), prefetching the winner's experts while the next level is drafted (``prefetch``).

Register your own with ``register_assistant(name, factory)``; ``factory(model)`` returns a ``TreeCandidateGenerator``.
"""


from __future__ import annotations

from typing import Callable

from .learned_state import Backoff, acceptance_model, dominance_guard, miss_path, online_refresh  # noqa: F401
from .specfit_generator import SpecFitGenerator
from .tree_generators import Eagle3Generator, TreeCandidateGenerator, eagle_tree  # noqa: F401

ASSISTANTS: dict[str, Callable] = {"eagle3": Eagle3Generator, "specfit": SpecFitGenerator}
# "acceptance-oracle" is registered by decoding/oracle.py, which decoding/strategy.py imports


def register_assistant(name: str, factory: Callable, *, replace: bool = False) -> None:
    """Make ``generate(..., assistant=name)`` use ``factory(model) -> TreeCandidateGenerator``."""
    if not isinstance(name, str) or not name or name != name.lower() or not name.replace("-", "_").isidentifier():
        raise ValueError(f"assistant names are lowercase identifiers (dashes allowed), got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory for assistant {name!r} must be callable: factory(model) -> generator")
    if name in ASSISTANTS and not replace:
        raise ValueError(f"assistant {name!r} is already registered; pass replace=True to override it")
    ASSISTANTS[name] = factory


def resolve_assistant(name) -> Callable:
    """A registered name, or a factory itself: ``factory(model) -> TreeCandidateGenerator``."""
    if callable(name):
        return name
    if name not in ASSISTANTS:
        raise ValueError(f"unknown assistant {name!r}; registered: {sorted(ASSISTANTS)}")
    return ASSISTANTS[name]
