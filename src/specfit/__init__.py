"""SpecFit: expert-aware speculative decoding for offloaded MoE models in Hugging Face transformers.

The public surface is the names in ``__all__``; everything else is internal. Names are imported lazily so
that ``import specfit`` and the CLI stay fast and the pure rules (selector, cost model) never pull in torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    # offloaded experts and the model patch
    "enable": "specfit.patch",
    "disable": "specfit.patch",
    "from_pretrained": "specfit.loader",
    "LinkConfig": "specfit.link",
    "OffloadConfig": "specfit.runtime",
    "Stats": "specfit.stats",
    "Counters": "specfit.stats",
    # drafting and decoding
    "Eagle3Drafter": "specfit.drafter",
    "Eagle3Config": "specfit.drafter",
    "load_drafter": "specfit.drafter_io",
    "save_drafter": "specfit.drafter_io",
    "DraftTree": "specfit.tree",
    "register_assistant": "specfit.assistants",
    "configure": "specfit.decoding",
    "DecodingOptions": "specfit.decoding",
    "ASSISTANTS": "specfit.assistants",
    # the method's rules (pure, no torch)
    "select_subtree": "specfit.selector",
    "Selection": "specfit.selector",
    "CostModel": "specfit.cost_model",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specfit' has no attribute {name!r}")


def __dir__():
    return __all__
