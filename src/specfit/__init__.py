"""SpecFit: expert-aware speculative decoding for offloaded MoE models in Hugging Face transformers.

The public surface is the names in ``__all__``; everything else is internal. Names are imported lazily so
that ``import specfit`` and the CLI stay fast and the pure rules (selector, cost model) never pull in torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    # wiring: the model patch, and loading with offloaded experts
    "enable": "specfit.patch",
    "disable": "specfit.patch",
    "configure": "specfit.patch",
    "from_pretrained": "specfit.patch",
    # offload
    "LinkConfig": "specfit.offload.link",
    "HostConfig": "specfit.offload.host_lane",
    "OffloadConfig": "specfit.offload.config",
    "Stats": "specfit.stats",
    "Counters": "specfit.stats",
    # drafting
    "Eagle3Drafter": "specfit.drafting.drafter",
    "Eagle3Config": "specfit.drafting.drafter",
    "load_drafter": "specfit.drafting.formats",
    "save_drafter": "specfit.drafting.formats",
    "DraftTree": "specfit.drafting.tree",
    # decoding
    "register_assistant": "specfit.decoding.assistants",
    "ASSISTANTS": "specfit.decoding.assistants",
    "TreeCandidateGenerator": "specfit.decoding.assistants",
    "Eagle3Generator": "specfit.decoding.assistants",
    "DecodingOptions": "specfit.decoding.options",
    # the method's rules (pure, no torch)
    "select_subtree": "specfit.selection.selector",
    "Selection": "specfit.selection.selector",
    "CostModel": "specfit.selection.cost_model",
    # measuring on your own prompts, calibrating a model built in code
    "compare": "specfit.evaluation.comparison",
    "calibrate": "specfit.evaluation.calibrate:fit_profile",
    "CalibrationRefused": "specfit.evaluation.calibrate",  # what specfit.calibrate raises for a fit it refuses
    "AcceptanceModel": "specfit.selection.acceptance_model",
    "AcceptanceTables": "specfit.selection.acceptance_model",
    # an OpenAI-compatible server around an enabled model (needs the serve extra)
    "serve": "specfit.serving.server",
}
# subpackages reachable as attributes after a plain `import specfit`, e.g. specfit.embedded.load(...)
_SUBPACKAGES = ("embedded",)

__all__ = sorted(_LAZY) + list(_SUBPACKAGES) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        module, _, attr = _LAZY[name].partition(":")  # "module" or "module:attribute"
        value = getattr(import_module(module), attr or name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return import_module(f"specfit.{name}")  # the import binds it here as well
    raise AttributeError(f"module 'specfit' has no attribute {name!r}")


def __dir__():
    return __all__
