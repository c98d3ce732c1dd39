"""The routed experts through transformers' own idioms while SpecFit holds them in its host store.

``state_dict()`` of an enabled model holds every expert under the plain model's keys, in its order, with its true
values, each a tensor of its own (contiguous copies read from the store, as ``safetensors.torch.save_file`` and
transformers' tied-weight checks need: the store keeps a layer's experts in one arena, so views of it would share
memory); ``num_parameters()`` counts them (as frozen weights: not with ``only_trainable=True``);
``save_pretrained()`` writes the plain model's checkpoint: in one pass, as transformers writes it, when the experts'
copy fits in ``EXPERT_SHARD_BYTES``, else with the experts read from the store one group of layers at a time
(``seam.checkpoints.save_pretrained_streaming``); ``load_state_dict()`` writes expert tensors through to the store
(and empties the device slots that held the old values). ``remove`` undoes it.
"""

from __future__ import annotations

import functools

import torch

from ..seam import checkpoints, layers as hf_layers

EXPERT_SHARD_BYTES = 2 * 2**30  # save_pretrained copies at most this much of the experts at once (or one layer)


def install(model, runtime) -> list:
    """Hook every MoE layer's experts module; returns the hook handles (``disable`` removes them)."""
    handles = []
    for i, moe in enumerate(hf_layers.moe_layers(model)):
        handles.append(moe.experts.register_state_dict_post_hook(_add_experts(runtime.store, i, moe.transposed)))
        handles.append(moe.experts.register_load_state_dict_pre_hook(_write_experts(runtime, i, moe.transposed)))
    model.save_pretrained = functools.partial(save_pretrained, model)  # instance attributes: removed by remove()
    model.num_parameters = functools.partial(num_parameters, model)
    return handles


def remove(model) -> None:
    vars(model).pop("save_pretrained", None)
    vars(model).pop("num_parameters", None)


_SKIP_EXPERTS = "_specfit_state_dict_skips_experts"  # set on the store while save_pretrained reads the other weights


def _add_experts(store, layer: int, transposed: bool):
    def hook(module, state_dict, prefix, local_metadata):
        if getattr(store, _SKIP_EXPERTS, False):
            return
        for name, tensor in store.checkpoint_tensors(layer, transposed).items():
            state_dict[prefix + name] = tensor.clone(memory_format=torch.contiguous_format)

    return hook


def num_parameters(model, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """``model.num_parameters()`` on an enabled model: transformers' count of ``model.parameters()`` plus the routed
    experts in the host store (frozen while SpecFit holds them, so not counted with ``only_trainable=True``)."""
    count = type(model).num_parameters(model, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    if only_trainable:
        return count
    store = model.specfit.store
    return count + len(store.arenas) * store.num_experts * store.layout.numel


def expert_copy_bytes(store) -> int:
    """Bytes of every expert as the plain model holds them (the compute dtype): what copying them all takes."""
    size = torch.empty((), dtype=store.compute_dtype).element_size()
    return len(store.arenas) * store.num_experts * store.layout.numel * size


def _write_experts(runtime, layer: int, transposed: bool):
    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        names = runtime.store.checkpoint_tensors(layer, transposed)
        given = {n: state_dict.pop(prefix + n) for n in names if prefix + n in state_dict}
        if strict:
            missing_keys.extend(prefix + n for n in names if n not in given)
        if not given:
            return
        with runtime.serialized("load_state_dict()"):
            runtime.engine.drain()  # no copy in flight still reads the old values
            try:
                runtime.store.write_checkpoint_tensors(layer, given, transposed)
            except ValueError as err:
                error_msgs.append(f"{prefix}: {err}")
                return
            runtime.layers[layer].cache.clear(runtime.stats.total)  # its slots hold copies of the old values

    return hook


def expert_keys(model) -> list[tuple[int, str, list[str]]]:
    """(layer, state-dict prefix, parameter names) of every MoE layer's experts."""
    names = {id(m): n for n, m in model.named_modules()}
    store = model.specfit.store
    return [(i, names[id(moe.experts)] + ".", list(store.checkpoint_tensors(i, moe.transposed)))
            for i, moe in enumerate(hf_layers.moe_layers(model))]


def save_pretrained(model, save_directory, *, is_main_process: bool = True, state_dict=None,
                    push_to_hub: bool = False, max_shard_size="50GB", variant=None, **kwargs) -> None:
    """``model.save_pretrained`` on an enabled model: the plain model's checkpoint (every expert, its true values),
    the experts streamed from the host store (at most ``EXPERT_SHARD_BYTES`` of them copied at once)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if state_dict is not None:
        raise ValueError("save_pretrained(state_dict=...) on a SpecFit-enabled model: SpecFit writes the routed "
                         "experts from its host store itself. Call model.save_pretrained(folder) without state_dict=, "
                         "or specfit.disable(model) first")
    if push_to_hub:
        raise ValueError("save_pretrained(push_to_hub=True) on a SpecFit-enabled model: the expert shards are "
                         "written after transformers' upload step. Use model.push_to_hub(repo_id), or save to a "
                         "folder and upload it with huggingface_hub.upload_folder(repo_id=..., folder_path=...)")
    if variant is not None:
        raise ValueError(f"save_pretrained(variant={variant!r}) on a SpecFit-enabled model is not supported; save "
                         f"without variant=, or call specfit.disable(model) first")
    runtime = model.specfit
    with runtime.serialized("save_pretrained()"):
        if expert_copy_bytes(runtime.store) <= EXPERT_SHARD_BYTES:  # one pass: the plain model's files, exactly
            checkpoints.clear_checkpoint(save_directory)
            type(model).save_pretrained(model, save_directory, is_main_process=is_main_process,
                                        state_dict=model.state_dict(), max_shard_size=max_shard_size, **kwargs)
            return
        layers = expert_keys(model)
        setattr(runtime.store, _SKIP_EXPERTS, True)
        try:
            rest = model.state_dict()  # every weight but the experts (read below, a group at a time)
        finally:
            setattr(runtime.store, _SKIP_EXPERTS, False)
        if not is_main_process:
            type(model).save_pretrained(model, save_directory, is_main_process=False, state_dict=rest,
                                        max_shard_size=max_shard_size, **kwargs)
            return
        limit = min(parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size),
                    EXPERT_SHARD_BYTES)
        checkpoints.save_pretrained_streaming(model, save_directory, rest, _groups(model, layers, limit),
                                       max_shard_size=max_shard_size, **kwargs)


def _groups(model, layers, limit: int) -> list:
    """Consecutive MoE layers whose experts fit in ``limit`` bytes together (one layer at least), each as a
    callable that reads them from the store (views)."""
    store = model.specfit.store
    transposed = {i: moe.transposed for i, moe in enumerate(hf_layers.moe_layers(model))}
    groups, current, size = [], [], 0
    for i, prefix, _ in layers:
        if current and size + store.weight_bytes // len(store.arenas) > limit:
            groups.append(current)
            current, size = [], 0
        current.append((i, prefix))
        size += store.weight_bytes // len(store.arenas)

    def reader(group):
        return lambda: {prefix + n: t for i, prefix in group
                        for n, t in store.checkpoint_tensors(i, transposed[i]).items()}

    return [reader(g) for g in groups + ([current] if current else [])]
