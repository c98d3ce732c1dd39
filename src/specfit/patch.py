"""``enable``, ``disable``, ``configure`` and ``from_pretrained``: the one place that wires the stages together.

``enable`` moves every routed expert into the host ``ExpertStore`` (releasing the model's own 3-D expert
parameters: no second copy anywhere), gives each MoE layer a slot cache on the compute device, selects the
``"specfit"`` experts implementation, hooks the forward for route recording and counters, and mixes SpecFit's
generation strategy into the model's class. ``disable`` undoes each step, so outputs are bit-identical to before.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from . import seam
from .decoding.options import DecodingOptions
from .decoding.strategy import install_generation_strategy, remove_generation_strategy
from .drafting.capture import AuxCapture
from .drafting.formats import load_drafter
from .offload.config import OffloadConfig
from .offload.experts import ATTR, specfit_experts_forward
from .offload.link import LinkConfig
from .offload.loader import load_offloaded
from .offload.runtime import SpecFitRuntime
from .offload.store import ExpertStore
from .selection.acceptance_model import FILENAME as ACCEPTANCE_FILE, AcceptanceTables
from .selection.profiles import checked_cost_model
from .selection.route_predictor import CONFIG, RoutePredictor
from .selection.route_sources import choose_route_source


def enable(model: nn.Module, cache_slots: int | None = None, *, cache_mode: str = "cached",
           link: LinkConfig | float | None = None, pin: bool | str = "auto", device=None, drafter=None,
           store: ExpertStore | None = None, **decoding) -> nn.Module:
    """Offload ``model``'s routed experts to host memory with ``cache_slots`` device slots per MoE layer.

    Args:
        cache_slots: expert slots per layer on the compute device, 1..num_experts (the paper: 48, 24 or 12 of 128).
        cache_mode: ``"cached"`` (LRU across forwards) or ``"cleared"`` (slots emptied before every forward).
        link: an emulated host link for CPU studies: a ``LinkConfig`` or seconds per expert copy.
        pin: pin the host arenas in place (CUDA only); ``"auto"`` pins when CUDA is available.
        device: the compute device; defaults to where the model's embeddings are.
        drafter: an EAGLE-3 drafter (module or checkpoint path) for ``generate(..., assistant=...)``.
        store: an already filled ``ExpertStore`` (used by ``specfit.from_pretrained``).
        **decoding: decoding options (see ``specfit.DecodingOptions``).
    Returns the same model, patched; ``model.specfit`` is the runtime with ``.stats``.
    """
    if getattr(model, "specfit", None) is not None:
        raise RuntimeError("SpecFit is already enabled on this model; call specfit.disable(model) first")
    layers = seam.moe_layers(model)
    first = layers[0]
    num_experts = first.num_experts
    if cache_slots is None:
        raise ValueError(f"cache_slots is required: expert slots per MoE layer on the device, 1..{num_experts}")
    if isinstance(cache_slots, bool) or not isinstance(cache_slots, int) or not 1 <= cache_slots <= num_experts:
        raise ValueError(f"cache_slots must be an integer in 1..{num_experts} (the model's experts per layer), "
                         f"got {cache_slots!r}")
    if isinstance(link, (int, float)) and not isinstance(link, bool):
        link = LinkConfig(seconds_per_expert=float(link))
    elif link is not None and not isinstance(link, LinkConfig):
        raise ValueError(f"link must be a LinkConfig or seconds per expert copy (a float), got {link!r}")
    config = OffloadConfig(cache_slots=cache_slots, cache_mode=cache_mode, link=link, pin=pin)
    device = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
    if link is not None and device.type == "cuda":
        raise ValueError("link= emulates a host link for CPU studies; on CUDA the copies are real: leave it unset")

    # disable() gives the experts back as parameters where they were; a model built by from_pretrained never had
    # them, so they come back on the compute device, beside the rest of the model
    param_device, param_dtype, requires_grad = device, None, False
    if store is None:
        gate_up = seam.expert_param(first)
        param_device, param_dtype, requires_grad = gate_up.device, gate_up.dtype, gate_up.requires_grad
        store = ExpertStore(len(layers), num_experts, first.hidden, first.intermediate, gate_up.dtype, pin=pin,
                            bias=first.layout.bias)
        for i, moe in enumerate(layers):
            with torch.no_grad():
                store.write_fused(i, *seam.expert_tensors(moe))
            seam.release_expert_tensors(moe)  # released: the store holds the only copy
    elif store.layout != first.layout:
        raise ValueError(f"the store holds experts of layout {store.layout}, the model's are {first.layout}")

    runtime = SpecFitRuntime(store, config, device)
    for moe, layer_rt in zip(layers, runtime.layers):
        setattr(moe.experts, ATTR, layer_rt)
    previous_impl = seam.experts_implementation(model)
    seam.set_experts_implementation(model, seam.EXPERTS_IMPL, specfit_experts_forward)
    seam.route_blocks(layers, specfit_experts_forward)  # experts outside transformers' interface (Llama-4)
    base = model.model
    hooks = [base.register_forward_pre_hook(lambda module, args: runtime.begin_forward()),
             base.register_forward_hook(lambda module, args, output: runtime.end_forward())]
    original_class = install_generation_strategy(model)
    runtime._restore = dict(previous_impl=previous_impl, hooks=hooks, original_class=original_class,
                            param_device=param_device, param_dtype=param_dtype, requires_grad=requires_grad)
    model.specfit = runtime
    try:
        attach_decoding(model, drafter=drafter, **decoding)
    except BaseException:
        disable(model)
        raise
    return model


def disable(model: nn.Module) -> nn.Module:
    """Exact inverse of ``enable``: expert parameters, experts implementation, class and hooks are restored. (For a
    model made by ``specfit.from_pretrained`` the experts become parameters on the compute device.)"""
    runtime = getattr(model, "specfit", None)
    if runtime is None:
        raise RuntimeError("SpecFit is not enabled on this model")
    detach_decoding(model)
    runtime.engine.close()  # no copy may still be writing into slots or reading the arenas
    r = runtime._restore
    for handle in r["hooks"]:
        handle.remove()
    remove_generation_strategy(model, r["original_class"])
    seam.set_experts_implementation(model, r["previous_impl"])
    layers = seam.moe_layers(model)
    seam.unroute_blocks(layers)
    for i, moe in enumerate(layers):
        if hasattr(moe.experts, ATTR):
            delattr(moe.experts, ATTR)
        seam.restore_expert_tensors(moe, runtime.store.tensors(i), r["param_device"], r["param_dtype"],
                                    r["requires_grad"])
    runtime.store.release()
    del model.specfit
    return model


def from_pretrained(path_or_id, *, cache_slots: int, dtype: torch.dtype | None = None, device=None,
                    revision: str | None = None, pin: bool | str = "auto", **enable_kwargs) -> nn.Module:
    """Load a Qwen3-MoE checkpoint with its routed experts offloaded; returns the enabled model.

    Args:
        path_or_id: a local checkpoint folder or a hub repo id (e.g. ``"Qwen/Qwen3-30B-A3B"``).
        cache_slots: expert slots per MoE layer on the device (see ``specfit.enable``).
        dtype: weight dtype; defaults to the checkpoint's (``config.dtype``), else float32.
        device: compute device; defaults to CUDA when available, else CPU.
        **enable_kwargs: passed to ``specfit.enable`` (``drafter``, ``link``, ``cache_mode``, ...).
    """
    model, store, device = load_offloaded(path_or_id, dtype=dtype, device=device, revision=revision, pin=pin)
    return enable(model, cache_slots=cache_slots, store=store, device=device, pin=pin, **enable_kwargs)


# --- decoding parts -------------------------------------------------------------------------------------------
def attach_decoding(model, drafter=None, cost_model=None, route_predictor=None, **options) -> None:
    runtime = model.specfit
    runtime.options = DecodingOptions(**options)
    if drafter is not None:
        set_drafter(model, drafter)
    if route_predictor is not None:
        runtime.route_predictor = route_predictor if isinstance(route_predictor, torch.nn.Module) else \
            RoutePredictor.load(route_predictor, model)
    runtime.cost_model = cost_model
    _check_options(model, runtime.options)


def _check_options(model, options: DecodingOptions) -> None:
    """Options that depend on how the model was enabled and what is attached; checked at enable and configure. A
    cost model given as a path is loaded here, so a bad profile fails now, not at the first generate()."""
    runtime = model.specfit
    if options.prefetch and runtime.config.cache_mode == "cleared":
        raise ValueError("prefetch=True needs cache_mode='cached': a cleared cache drops prefetched experts")
    if runtime.drafter is not None:
        choose_route_source(model, options.route_source)  # "auto" with nothing deployable fails here, not later
    if runtime.cost_model is not None:
        runtime.cost_model = checked_cost_model(model, runtime.cost_model)


def set_drafter(model, drafter) -> None:
    """Attach an EAGLE-3 drafter (module, or checkpoint folder checked against the target at load). A folder's
    ``acceptance.json`` (the acceptance model's tables, fitted for this drafter) is loaded with it; without one, or
    for a module, SpecFit starts from the default prior (``AcceptanceTables.default()``)."""
    runtime = model.specfit
    seam.check_layer_types(model)  # assistants need KV-attention layers: refuse hybrids before any work
    if runtime.aux_capture is not None:
        runtime.aux_capture.remove()
    tables = None
    if not isinstance(drafter, torch.nn.Module):
        folder = Path(drafter)
        drafter = load_drafter(folder, target=model)
        if (folder / CONFIG).is_file():  # a route predictor saved beside the drafter
            runtime.route_predictor = RoutePredictor.load(folder, model)
        if (folder / ACCEPTANCE_FILE).is_file():  # the acceptance model's tables for this drafter
            tables = AcceptanceTables.load(folder / ACCEPTANCE_FILE)
    runtime.acceptance_tables, runtime.acceptance_models = tables, {}
    weight = model.get_input_embeddings().weight
    drafter.to(device=runtime.device, dtype=weight.dtype)
    if getattr(drafter, "embed_tokens", None) is None:
        drafter.set_embedding(model.get_input_embeddings())
    drafter.eval()
    runtime.drafter = drafter
    runtime.aux_capture = AuxCapture(model, drafter.config.aux_layer_ids, paused=lambda: runtime.untracked)


def detach_decoding(model) -> None:
    runtime = model.specfit
    if runtime.aux_capture is not None:
        runtime.aux_capture.remove()
    runtime.aux_capture = runtime.drafter = None


def configure(model, cost_model=None, **options) -> DecodingOptions:
    """Change decoding options on an enabled model, e.g. ``configure(model, max_nodes=5)``; ``cost_model=`` (a
    ``CostModel`` or a profile path) replaces the cost model. Everything is checked before anything changes."""
    runtime = model.specfit
    new_options = replace(runtime.options, **options)
    previous = runtime.options, runtime.cost_model
    runtime.options = new_options
    try:
        if cost_model is not None:
            runtime.cost_model = cost_model
        _check_options(model, new_options)
    except BaseException:
        runtime.options, runtime.cost_model = previous
        raise
    runtime.backoff = None  # whether drafting pays is judged anew under the new options
    return runtime.options
