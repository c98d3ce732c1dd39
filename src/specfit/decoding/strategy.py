"""The ``generate()`` strategy: ``generate(..., assistant=NAME)`` runs SpecFit's decoding loop.

transformers runs all of its usual preparation (generation config, logits processors, stopping criteria incl. stop
strings, cache, streamer) and then calls its private ``_sample`` for greedy and sampling modes; the mixin below takes
over there. It is mixed into the model's class by ``enable`` and taken out by ``disable``.
"""

from __future__ import annotations

import torch

from .assistants import resolve_assistant
from .loop import check_generate_arguments, decode


class SpecFitGenerationMixin:
    """Mixed into the model's class by ``enable``: ``generate(..., assistant=NAME)`` runs SpecFit's tree decoding
    loop with the named assistant; without ``assistant`` it is transformers' own ``generate()``."""

    def generate(self, *args, assistant: str | None = None, **kwargs):
        self.specfit.stats.generate_called()  # the stopwatch of the call starts here, before any preparation
        if assistant is None:
            return super().generate(*args, **kwargs)
        spec = resolve_assistant(assistant)
        check_generate_arguments(self, args, kwargs)
        runtime = self.specfit
        runtime.request, runtime.request_served = spec, False
        try:
            out = super().generate(*args, **kwargs)
        finally:
            runtime.request = None
        if not runtime.request_served:  # generate() chose another decoding method than greedy/sampling
            raise ValueError(f"assistant={assistant!r} needs greedy or sampling decoding, but these generate() "
                             f"arguments selected another mode (beam search, prompt lookup, assistant_model, ...)")
        return out

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        runtime = getattr(self, "specfit", None)
        if runtime is not None and runtime.request is not None:
            runtime.request_served = True
            return decode(self, runtime.request, input_ids, logits_processor, stopping_criteria, generation_config,
                          streamer=streamer, **model_kwargs)
        scope = runtime.stats.begin_generate() if runtime is not None else None
        out = super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                              synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        if scope is not None:
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            scope.end(new_tokens=(sequences.shape[1] - input_ids.shape[1]) * sequences.shape[0], autoregressive=True)
        return out


def install_generation_strategy(model) -> type:
    """Swap the model's class for a subclass with the SpecFit strategy (same name, so ``save_pretrained`` still
    writes the original architecture); return the original class for ``remove_generation_strategy``."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (SpecFitGenerationMixin, cls), {"__module__": cls.__module__})
    return cls


def remove_generation_strategy(model, original_class: type) -> None:
    model.__class__ = original_class
