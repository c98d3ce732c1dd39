"""The ``generate()`` strategy: ``generate(..., assistant=NAME)`` runs SpecFit's decoding loop.

transformers runs all of its usual preparation (generation config, logits processors, stopping criteria incl. stop
strings, cache, streamer) and then calls its private ``_sample`` for greedy and sampling modes; the mixin below takes
over there. It is mixed into the model's class by ``enable`` and taken out by ``disable``.

The assistant is a generation setting like any other: the ``assistant=`` keyword, else ``generation_config.assistant``
of the config passed to ``generate()``, else ``model.generation_config.assistant``. Every call, whichever path runs,
leaves its own figures in ``model.specfit.stats`` (``last_generate``, ``last_method``).
"""

from __future__ import annotations

import time

import torch

from ..seam import experts as hf_experts
from . import oracle  # noqa: F401  registers "acceptance-oracle": every enabled model knows the name
from .assistants import resolve_assistant
from .batch_checks import check_batch_arguments
from .batch_loop import decode_batch
from .batch_rows import new_tokens
from .loop import SAMPLE_MODES, call_config, check_generate_arguments, decode, generate_arguments

_UNSET = object()  # assistant= not passed: the generation config decides (an explicit None means no assistant)


class SpecFitGenerationMixin:
    """Mixed into the model's class by ``enable``: ``generate(..., assistant=NAME)`` runs SpecFit's tree decoding
    loop with the named assistant; without an assistant it is transformers' own ``generate()``."""

    def __new__(cls, *args, **kwargs):
        """``type(model)(config)`` (and ``type(model)._from_config``) builds a plain model of the original class:
        ``enable`` acts on one model, never on a class. (Copies made without arguments keep this class.)"""
        plain = cls.__dict__.get("_plain_class")
        if plain is not None and (args or kwargs):
            return plain(*args, **kwargs)
        return super().__new__(cls)

    def generate(self, *args, assistant=_UNSET, **kwargs):
        """One call at a time per model, from any number of threads (a call waits for the one in progress; the wait
        is in its wall clock, and shown apart as ``lock_wait_seconds``)."""
        runtime = self.specfit
        started = time.perf_counter()  # the stopwatch starts here, before any waiting or preparation
        with runtime.serialized() as waited:
            runtime.stats.generate_called(started, waited)  # old figures cleared
            return self._generate(args, kwargs, assistant)

    def _generate(self, args, kwargs, assistant):
        runtime = self.specfit
        named = generate_arguments(args, kwargs)
        if isinstance(named.get("assistant_model"), str):
            raise ValueError(f"assistant_model= takes a draft model (transformers' assisted decoding), got the string "
                             f"{named['assistant_model']!r}; for SpecFit's tree decoding pass "
                             f"assistant={named['assistant_model']!r}")
        name = requested_assistant(self, assistant, named)
        if name is None:
            return self._plain_generate(named, args, kwargs)
        spec = resolve_assistant(name)
        check_generate_arguments(self, args, kwargs)
        check_batch_arguments(self, named)  # several rows: padding, lengths, streamer (decoding/batch_checks.py)
        runtime.request, runtime.request_served = spec, False
        try:
            out = super().generate(*args, **kwargs)
        finally:
            runtime.request = None
        if not runtime.request_served:  # generate() chose another decoding method than greedy/sampling
            raise ValueError(f"assistant={name!r} needs greedy or sampling decoding, but these generate() "
                             f"arguments selected another mode (beam search, prompt lookup, assistant_model, ...)")
        runtime.stats.last_method = name if isinstance(name, str) else getattr(name, "__name__", type(name).__name__)
        return out

    def _plain_generate(self, named: dict, args, kwargs):
        """transformers' own generate(), accounted as one call whichever method it runs (``_sample`` accounts greedy
        and sampling itself; the scope opened here covers the others)."""
        stats = self.specfit.stats
        scope = stats.begin_generate()
        try:
            out = super().generate(*args, **kwargs)
        except BaseException:
            stats.scope = None
            raise
        if stats.scope is scope:  # _sample did not run: assisted decoding, prompt lookup, beam search, ...
            sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            ids = named.get("inputs") if named.get("inputs") is not None else named.get("input_ids")
            prompt = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 0
            # a custom_generate may return anything (text, a dict, ...): then its new tokens are not known, and 0
            # are counted
            known = isinstance(sequences, torch.Tensor) and sequences.dim() == 2
            scope.end(new_tokens=(sequences.shape[1] - prompt) * sequences.shape[0] if known else 0)
            stats.last_method = transformers_method(self, named)
        return out

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        runtime = getattr(self, "specfit", None)
        if runtime is not None and runtime.request is not None:
            runtime.request_served = True
            # inputs on any device, as transformers' own loop takes them ("Inputs on CPU are supported"): moved to
            # the model's device before SpecFit's loops call the model with them; the output goes back to the inputs'
            # device, where transformers' loop keeps the sequences and scores
            home = input_ids.device
            input_ids = input_ids.to(self.device)  # [B, T]
            for key in ("attention_mask", "position_ids"):
                if isinstance(model_kwargs.get(key), torch.Tensor):
                    model_kwargs[key] = model_kwargs[key].to(self.device)
            loop = decode_batch if input_ids.shape[0] > 1 else decode  # a batch: every row's tree in one forward
            out = loop(self, runtime.request, input_ids, logits_processor, stopping_criteria, generation_config,
                       streamer=streamer, **model_kwargs)
            return returned_on(out, home)
        scope = None if runtime is None else runtime.stats.scope or runtime.stats.begin_generate()
        out = super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                              synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        if scope is not None:
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            scope.end(new_tokens=new_tokens(sequences, input_ids.shape[1], generation_config), autoregressive=True)
            runtime.stats.last_method = "ar"
        return out

    def set_experts_implementation(self, experts_implementation):
        """While SpecFit is enabled the experts live in its host store and only its experts implementation can run
        them: refuse any other, before anything changes."""
        check_experts_implementation(self, experts_implementation)
        return super().set_experts_implementation(experts_implementation)


def returned_on(out, device: torch.device):
    """``_sample``'s output with its sequences [B, T] (and scores, raw logits) on ``device``, the inputs' device, as
    transformers' own loop returns them."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    out.sequences = out.sequences.to(device)
    for key in ("scores", "logits"):
        if getattr(out, key, None) is not None:
            setattr(out, key, tuple(t.to(device) for t in getattr(out, key)))
    return out


def requested_assistant(model, assistant, named: dict):
    """The ``assistant=`` keyword when given (None: no assistant), else ``assistant`` of the generation config
    passed, else of ``model.generation_config`` (transformers carries custom entries of the model's config over)."""
    if assistant is not _UNSET:
        return assistant
    for config in (named.get("generation_config"), model.generation_config):
        value = getattr(config, "assistant", None)
        if value is not None:
            return value
    return None


def transformers_method(model, named: dict) -> str:
    """Which of transformers' decoding methods a call with arguments ``named`` ran (see ``Stats.last_method``)."""
    if named.get("custom_generate") is not None:
        return "custom_generate"
    config = call_config(model, named)
    mode = config.get_generation_mode(named.get("assistant_model"))
    if mode in SAMPLE_MODES:
        return "ar"
    if mode.value == "assisted_generation":
        return "prompt_lookup" if config.prompt_lookup_num_tokens is not None else "assisted"
    return str(mode.value)


def check_experts_implementation(model, experts_implementation) -> None:
    """Refuse another experts implementation than SpecFit's on an enabled model (``set_experts_implementation``)."""
    if getattr(model, "specfit", None) is not None and experts_implementation != hf_experts.EXPERTS_IMPL:
        raise ValueError(f"set_experts_implementation({experts_implementation!r}): SpecFit is enabled on this "
                         f"model, its experts live in host memory and run only through the "
                         f"{hf_experts.EXPERTS_IMPL!r} experts implementation. Call specfit.disable(model) first "
                         f"(it restores the experts as parameters), then set the implementation")


def guard_experts_implementation(model) -> None:
    """A model that cannot generate keeps its class: its ``set_experts_implementation`` refuses as an enabled
    generating model's does, through an instance attribute that ``unguard_experts_implementation`` removes."""
    method = model.set_experts_implementation

    def set_experts_implementation(experts_implementation):
        check_experts_implementation(model, experts_implementation)
        return method(experts_implementation)
    model.__dict__["set_experts_implementation"] = set_experts_implementation


def unguard_experts_implementation(model) -> None:
    model.__dict__.pop("set_experts_implementation", None)


def install_generation_strategy(model) -> type:
    """Swap the model's class for a subclass with the SpecFit strategy (same name, so ``save_pretrained`` still
    writes the original architecture); return the original class for ``remove_generation_strategy``."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (SpecFitGenerationMixin, cls), {"__module__": cls.__module__,
                                                                         "_plain_class": cls})
    return cls


def remove_generation_strategy(model, original_class: type) -> None:
    model.__class__ = original_class
