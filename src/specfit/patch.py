"""``enable``, ``disable``, ``configure`` and ``from_pretrained``: the one place that wires the stages together.

``enable`` moves every routed expert into the host ``ExpertStore`` (releasing the model's own 3-D expert
parameters: no second copy anywhere), gives each MoE layer a slot cache on the compute device, selects the
``"specfit"`` experts implementation (in a private copy of the model's config), hooks the forward for route recording
and counters, and, for a model that can generate, mixes SpecFit's generation strategy into the model's class. While
enabled, ``state_dict``/``save_pretrained``/``load_state_dict`` see the experts in the store
(``offload/checkpoint.py``); a cast of the whole model's dtype rebuilds the offload in the new dtype (``_cast``), and
other moves are refused at the call (``offload/moves.py``). ``disable`` undoes each step, so outputs are
bit-identical to before.
"""

from __future__ import annotations

import functools

import sys
from dataclasses import fields, replace
from pathlib import Path

import torch
from torch import nn

from .seam import experts as hf_experts, kv_cache, layers as hf_layers
from .decoding.options import DecodingOptions
from .decoding.strategy import guard_experts_implementation, install_generation_strategy, \
    remove_generation_strategy, unguard_experts_implementation
from .drafting.capture import AuxCapture
from .drafting.formats import load_drafter
from .offload import checkpoint, moves, policies, standin
from .offload.config import OffloadConfig
from .offload.formats import DenseFormat
from .offload.experts import ATTR, COMPILE_REASON, specfit_experts_forward
from .offload.host_lane import HostConfig
from .offload.link import LinkConfig
from .offload.loader import load_offloaded
from .offload.runtime import SpecFitRuntime
from .offload.store import ExpertStore
from .selection.acceptance_cache import tables_path
from .selection.acceptance_model import AcceptanceTables
from .selection.profiles import check_profile_options, checked_cost_model
from .selection.route_predictor import CONFIG, RoutePredictor
from .selection.route_sources import choose_route_source
from .enable_checks import (  # noqa: F401  (_cold_mode: imported from here by tests)
    DECODING_KEYWORDS, ENABLE_ONLY, FROM_PRETRAINED_KEYWORDS, OPTION_NAMES, _check_before_load, _check_experts,
    _check_keywords, _check_link_device, _check_slots, _check_weights_in_memory, _cold_mode, _decoding_options,
    _device_of_map, _host_config, _link_config)


def enable(model: nn.Module, cache_slots: int | None = None, *, cache_mode: str = "cached",
           cache_policy: str = policies.DEFAULT, link: LinkConfig | float | None = None, cold: str | None = None,
           host: HostConfig | float | None = None, pin: bool | str = "auto", device=None, drafter=None,
           store: ExpertStore | None = None, **decoding) -> nn.Module:
    """Offload ``model``'s routed experts to host memory with ``cache_slots`` device slots per MoE layer.

    Args:
        cache_slots: expert slots per layer on the compute device, 1..num_experts (the paper: 48, 24 or 12 of 128).
        cache_mode: ``"cached"`` (slots kept across forwards) or ``"cleared"`` (emptied before every forward).
        cache_policy: which resident expert a load evicts (``offload/policies.py``): ``"forecast"`` (the default:
            decayed frequency, plus the drafted tree's predicted routes where SpecFit drafts one), ``"frequency"``
            (decayed frequency alone), ``"frequency-age"`` (frequency over age) or ``"lru"``.
        link: an emulated host link for CPU studies: a ``LinkConfig`` or seconds per expert copy.
        cold: where experts that miss the slot cache are computed: ``"copy"`` (copied into a slot, then computed on
            the device), ``"host"`` (computed on the host CPU from host memory), ``"auto"`` (per expert, by
            predicted time). Default: ``"auto"`` where a host lane exists (CUDA; a CPU given ``host=``), else
            ``"copy"``.
        host: an emulated host lane for CPU studies: a ``HostConfig`` or the host's bandwidth in bytes/s
            (``specfit.embedded.default_host()`` for the embedded model's structural default).
        pin: pin the host arenas in place (CUDA only); ``"auto"`` pins when CUDA is available.
        device: the compute device; defaults to where the model's embeddings are.
        drafter: an EAGLE-3 drafter (module or checkpoint path) for ``generate(..., assistant=...)``.
        store: an already filled ``ExpertStore`` (used by ``specfit.from_pretrained``).
        **decoding: decoding options (see ``specfit.DecodingOptions``).
    Returns the same model, patched; ``model.specfit`` is the runtime with ``.stats``.
    """
    if getattr(model, "specfit", None) is not None:
        raise RuntimeError("SpecFit is already enabled on this model; call specfit.disable(model) first")
    # every setting is checked before the model is touched
    _check_keywords(decoding, DECODING_KEYWORDS, "specfit.enable", named=enable)
    _decoding_options(decoding)
    layers = hf_layers.moe_layers(model)
    first = layers[0]
    num_experts = first.num_experts
    _check_experts(model, num_experts)
    _check_slots(cache_slots, num_experts)
    link, host = _link_config(link), _host_config(host)
    device = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
    _check_link_device(link, device)
    cold = _cold_mode(cold, host, device, store.format if store is not None else None)
    config = OffloadConfig(cache_slots=cache_slots, cache_mode=cache_mode, link=link, pin=pin, cold=cold, host=host,
                           cache_policy=cache_policy)
    _check_weights_in_memory(model)

    # disable() gives the experts back as parameters where they were; a model built by from_pretrained never had
    # them, so they come back on the compute device, beside the rest of the model
    param_device, param_dtype, requires_grad = device, None, False
    if store is None:
        gate_up = hf_layers.expert_param(first)
        param_device, param_dtype, requires_grad = gate_up.device, gate_up.dtype, gate_up.requires_grad
        store = ExpertStore(len(layers), num_experts, first.hidden, first.intermediate, gate_up.dtype, pin=pin,
                            bias=first.layout.bias)
        for i, moe in enumerate(layers):
            with torch.no_grad():
                store.write_fused(i, *hf_layers.expert_tensors(moe))
            hf_layers.release_expert_tensors(moe)  # released: the store holds the only copy
    elif store.layout != first.layout:
        raise ValueError(f"the store holds experts of layout {store.layout}, the model's are {first.layout}")
    plans = hf_layers.hide_expert_plans(model)  # the parallel plans name only tensors the model holds
    device = standin.place(model, device)  # the CUDA stand-in: the weights on a device distinct from the host

    runtime = SpecFitRuntime(store, config, device)
    runtime.experts_module = first.experts  # the real host lane is timed on it
    runtime.measure_once()  # CUDA: the link and the lane timed now, not inside the first forward
    for moe, layer_rt in zip(layers, runtime.layers):
        setattr(moe.experts, ATTR, layer_rt)
    previous_impl = hf_experts.experts_implementation(model)
    saved_config = hf_experts.own_config(model)  # the caller's config object is never written to
    hf_experts.set_experts_implementation(model, hf_experts.enabled_name(previous_impl), specfit_experts_forward)
    hf_layers.route_blocks(layers, specfit_experts_forward)  # experts outside transformers' interface (Llama-4)
    base = hf_layers.base_model(model)
    # "specfit" (a family whose experts SpecFit routes keeps its own)
    selected = hf_experts.experts_implementation(model)

    def check_experts_implementation():
        now = hf_experts.experts_implementation(model)
        if now != selected:  # changed on a submodel, or in the config directly
            raise RuntimeError(f"the experts implementation was changed to {now!r} while SpecFit holds the experts in "
                               f"host memory; only {hf_experts.EXPERTS_IMPL!r} can run "
                               f"them. Call specfit.disable(model) first, then change it")

    _serialize_forward(base, runtime, check_experts_implementation)  # one forward at a time, from any thread
    hooks = checkpoint.install(model, runtime)  # state_dict / save_pretrained / load_state_dict see the experts
    moves.install(model, runtime, _cast)  # .half() / .to(dtype): cast (_cast); .cuda(), a layer's cast: refused
    # a model that cannot generate (sequence or token classification, question answering, the bare decoder) keeps
    # its class: only the offload applies to it, and its experts implementation is guarded as a generating model's
    if type(model).can_generate():
        original_class = install_generation_strategy(model)
    else:
        original_class = type(model)
        guard_experts_implementation(model)
    runtime._restore = dict(previous_impl=previous_impl, hooks=hooks, original_class=original_class,
                            param_device=param_device, param_dtype=param_dtype, requires_grad=requires_grad,
                            config=saved_config, plans=plans)
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
    with runtime.serialized("disable()"):  # a call in progress in another thread finishes first
        return _disable(model, runtime)


def _disable(model: nn.Module, runtime) -> nn.Module:
    detach_decoding(model)
    runtime.engine.close()  # no copy may still be writing into slots or reading the arenas
    if runtime.lane is not None:
        runtime.lane.close()  # nor the host lane's worker reading them
    r = runtime._restore
    for handle in r["hooks"]:
        handle.remove()
    checkpoint.remove(model)
    moves.remove(model)
    vars(hf_layers.base_model(model)).pop("forward", None)  # the serialized forward: the class's own is back
    remove_generation_strategy(model, r["original_class"])
    unguard_experts_implementation(model)
    hf_experts.set_experts_implementation(model, r["previous_impl"])
    hf_experts.restore_config(model, r["config"])
    hf_layers.restore_expert_plans(r["plans"])
    layers = hf_layers.moe_layers(model)
    hf_layers.unroute_blocks(layers)
    for i, moe in enumerate(layers):
        if hasattr(moe.experts, ATTR):
            delattr(moe.experts, ATTR)
        hf_layers.restore_expert_tensors(moe, runtime.store.tensors(i), r["param_device"], r["param_dtype"],
                                    r["requires_grad"])
    runtime.store.release()
    standin.unplace(model, runtime.device)
    del model.specfit
    return model


def _cast(model: nn.Module, apply, dtype: torch.dtype):
    """``model.half()``, ``model.to(torch.bfloat16)``, ... on an enabled model (``apply`` runs the cast of the plain
    model): SpecFit is disabled, the model cast as transformers casts it, and SpecFit enabled again with the same
    settings, so the host store is rebuilt in the new dtype (its arenas pinned again), the slots are new, the drafter
    is cast with the model (the route predictor computes in fp32 whatever the model's dtype), and the cost profile of
    the new dtype is looked up at the next generate(); what the acceptance model learned is kept. Returns None (the
    cast is refused, naming the call that loads the model in that dtype) where the experts are stored FP8 or would
    come back onto a GPU for the cast."""
    runtime = model.specfit
    back_on = torch.device(runtime._restore["param_device"])  # where disable() puts the experts
    if not isinstance(runtime.store.format, DenseFormat) or back_on.type != "cpu":
        return None
    c = runtime.config
    kept = dict(cache_slots=c.cache_slots, cache_mode=c.cache_mode, cache_policy=c.cache_policy, link=c.link,
                host=c.host, cold=c.cold, pin=c.pin, device=runtime.device, drafter=runtime.drafter,
                route_predictor=runtime.route_predictor, cost_model=None,
                **{f.name: getattr(runtime.options, f.name) for f in fields(runtime.options)})
    learned, tables = runtime.acceptance_models, runtime.acceptance_tables
    load_call, command = getattr(runtime, "load_call", None), runtime.calibrate_command
    disable(model)
    apply()
    try:
        enable(model, **kept)
    except Exception as err:
        raise RuntimeError(f"the model was cast to {dtype}, but enabling SpecFit again failed ({err}); it is a plain "
                           f"model now: call specfit.enable(model, ...) with your options") from err
    new = model.specfit
    new.acceptance_models, new.acceptance_tables = learned, tables
    if load_call is not None:
        new.load_call = load_call
    if command is not None:  # the command that fits a profile for this dtype
        name = str(dtype).replace("torch.", "")
        new.calibrate_command = command.split(" --dtype")[0] + ("" if name == "float32" else f" --dtype {name}")
    return model


def _serialize_forward(base: nn.Module, runtime, check) -> None:
    """Wrap ``base.forward`` (an instance attribute over the class's method, removed by ``disable``): each forward
    holds the model's lock while it opens and closes its counters and routes (``runtime.begin_forward`` /
    ``end_forward``) and runs; ``check()`` first. The lock is released on any exception, KeyboardInterrupt included
    (torch runs ``always_call`` forward hooks only for ``Exception``)."""
    forward = base.forward

    @torch.compiler.disable(reason=COMPILE_REASON)  # bookkeeping on the host: torch.compile traces around it
    def begin():
        check()
        scope = runtime.serialized("a forward")
        scope.__enter__()
        try:
            runtime.begin_forward()
        except BaseException:
            scope.__exit__(*sys.exc_info())
            raise
        return scope

    @torch.compiler.disable(reason=COMPILE_REASON)
    def end(scope, failed: bool) -> None:
        try:
            if not failed:
                runtime.end_forward()
        finally:
            scope.__exit__(None, None, None)

    @functools.wraps(forward)  # the forward's own signature, for anything that inspects it (transformers' tests, Trainer)
    def serialized(*args, **kwargs):
        scope = begin()
        try:
            out = forward(*args, **kwargs)
        except BaseException:
            end(scope, True)
            raise
        end(scope, False)
        return out

    base.forward = serialized


def from_pretrained(path_or_id, *, cache_slots: int, dtype: torch.dtype | None = None, device=None,
                    revision: str | None = None, pin: bool | str = "auto", device_map=None,
                    **enable_kwargs) -> nn.Module:
    """Load a checkpoint with its routed experts offloaded; returns the enabled model.

    Every argument is checked before any checkpoint byte is read (for a hub id, before anything but ``config.json``
    is downloaded): keywords, ``cache_slots`` against the model's experts, ``link``, the decoding options, a
    ``config.json`` that is not JSON (named by its path) or names no routed expert, and a ``drafter`` that cannot be
    found.

    Args:
        path_or_id: a local checkpoint folder or a hub repo id (e.g. ``"Qwen/Qwen3-30B-A3B"``).
        cache_slots: expert slots per MoE layer on the device (see ``specfit.enable``).
        dtype: weight dtype; defaults to the checkpoint's (``config.dtype``), else float32.
        device: compute device for everything but the routed experts; defaults to CUDA when available, else CPU.
        device_map: as in transformers, for the weights that are not routed experts, which SpecFit keeps on one
            device: ``"auto"`` (the default device), one device (``"cuda:1"``, ``0``, ``"cpu"``) or a dict mapping
            every module to the same device. Maps over several devices, and disk offload, are refused.
        **enable_kwargs: passed to ``specfit.enable`` (``drafter``, ``link``, ``cache_mode``, ``cache_policy``,
            decoding options...).
    """
    _check_keywords(enable_kwargs, FROM_PRETRAINED_KEYWORDS, "specfit.from_pretrained", named=from_pretrained)
    device = _device_of_map(device_map, device)
    _decoding_options(enable_kwargs)
    _check_slots(cache_slots)
    enable_kwargs["link"] = link = _link_config(enable_kwargs.get("link"))
    enable_kwargs["host"] = host = _host_config(enable_kwargs.get("host"))
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    _check_link_device(link, device)
    cold = _cold_mode(enable_kwargs.get("cold"), host, device, None)  # the stored format is checked at enable
    OffloadConfig(cache_slots=cache_slots, cache_mode=enable_kwargs.get("cache_mode", "cached"), link=link, pin=pin,
                  cold=cold, host=host, cache_policy=enable_kwargs.get("cache_policy", policies.DEFAULT))
    _check_before_load(path_or_id, enable_kwargs.get("drafter"))

    def check(skeleton):  # the model without weights, before the checkpoint's shards are read
        experts = hf_layers.moe_layers(skeleton)[0].num_experts
        _check_experts(skeleton, experts)
        _check_slots(cache_slots, experts)

    model, store, device = load_offloaded(path_or_id, dtype=dtype, device=device, revision=revision, pin=pin,
                                          check=check)
    return enable(model, cache_slots=cache_slots, store=store, device=device, pin=pin, **enable_kwargs)


# the checks of what enable / configure / from_pretrained are given: enable_checks.py

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
    if runtime.drafter is not None or options.cost != "paper":
        check_profile_options(model, options)  # cost="cache-aware", max_nodes: against the profile SpecFit will use


def set_drafter(model, drafter) -> None:
    """Attach an EAGLE-3 drafter (module, or checkpoint folder checked against the target at load). The acceptance
    model's tables fitted for a folder's drafter are loaded with it: those ``specfit calibrate --acceptance-only``
    wrote to the user cache for it, else the folder's own ``acceptance.json`` (``selection/acceptance_cache.py``);
    without either, or for a module, SpecFit starts from the default prior (``AcceptanceTables.default()``)."""
    runtime = model.specfit
    if not type(model).can_generate():
        raise ValueError(f"drafter=: {type(model).__name__} has no generate(), so there is nothing to draft for; "
                         f"SpecFit's decoding runs on causal LMs such as Qwen3MoeForCausalLM. Enable this model "
                         f"without drafter= (its experts are offloaded all the same)")
    kv_cache.check_layer_types(model)  # assistants need KV-attention layers: refuse hybrids before any work
    if runtime.aux_capture is not None:
        runtime.aux_capture.remove()
    tables = None
    if not isinstance(drafter, torch.nn.Module):
        folder = Path(drafter)
        drafter = load_drafter(folder, target=model)
        if (folder / CONFIG).is_file():  # a route predictor saved beside the drafter
            runtime.route_predictor = RoutePredictor.load(folder, model)
        path = tables_path(folder) if folder.is_dir() else None  # the user cache's tables first, else the folder's
        if path is not None:
            tables = AcceptanceTables.load(path)
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
    ``CostModel`` or a profile path) replaces the cost model. Everything is checked before anything changes. What
    ``enable`` set up (``cache_slots``, ``cache_mode``, ``link``, ``drafter``, ...) needs ``disable`` + ``enable``."""
    runtime = getattr(model, "specfit", None)
    if runtime is None:
        raise RuntimeError("SpecFit is not enabled on this model: specfit.enable(model, cache_slots=..., ...) first")
    _check_keywords(options, OPTION_NAMES, "specfit.configure", named=configure, enable_only=ENABLE_ONLY)
    new_options = replace(runtime.options, **options)
    with runtime.serialized("configure()"):  # never under a call in progress in another thread
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
