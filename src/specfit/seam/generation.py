"""``generate()`` plumbing: the generation config a call runs with, and its stopping criteria read on the host.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["call_generation_config", "host_stopping"]

def call_generation_config(model, generation_config, **kwargs):
    """The generation config one ``generate()`` call runs with, built as transformers builds it (its private
    ``_prepare_generation_config``): ``generation_config`` (or a default one) over the model's own
    ``generation_config``, custom entries such as ``assistant`` carried over, then the call's keyword arguments.
    A copy: nothing of the model's changes."""
    config, _ = model._prepare_generation_config(generation_config, **kwargs)
    return config


def host_stopping(criteria) -> Callable[[list[int]], bool] | None:
    """The stopping criteria as a check on the host's token list, with no device read, when every criterion is one
    whose rule is known (max length, eos); None otherwise (then they run on the ids as transformers runs them)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    lengths, eos = [], set()
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            lengths.append(c.max_length)
        elif type(c) is EosTokenCriteria:
            eos.update(int(t) for t in c.eos_token_id.detach().to("cpu").reshape(-1).numpy())
        else:
            return None
    longest = min(lengths) if lengths else None
    return lambda tokens: (longest is not None and len(tokens) >= longest) or (bool(eos) and tokens[-1] in eos)
