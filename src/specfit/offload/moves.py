"""Moves and casts of an enabled model (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``, ``.to(device)``,
``.cuda()``, ``.cpu()``, ...) are refused at the call when they would change a dtype or a device.

They all go through ``nn.Module._apply(fn)``, which reaches the model's parameters but not SpecFit's host store of
routed experts nor the device slots filled from it: accepted, they would leave the experts in the old dtype or
place, and the next forward would fail (or mix dtypes). The guard sits on the model and on every module on the path
to an experts module (``model.model.layers[3].to(...)`` is caught too). It asks ``fn`` what it would do to a tensor
like the model's weights (an empty probe): a move that changes nothing (``.float()`` on a float32 model, ``.cpu()``
on a CPU model) runs as before. ``remove`` takes the guards off (``specfit.disable``).

A cast of the whole model's dtype (``model.half()``, ``model.to(torch.bfloat16)``) is handed to ``cast`` (given by
``enable``: ``patch._cast``), which does it where it can (SpecFit disabled, the model cast, SpecFit enabled again
with the same settings) and returns None where it cannot; then it is refused as any other move.
"""

from __future__ import annotations

import torch

from ..seam import layers as hf_layers

ATTR = "_apply"


def install(model, runtime, cast=None) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    guarded = {""}
    for moe in hf_layers.moe_layers(model):
        parts = names[id(moe.experts)].split(".")
        guarded.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    for name in sorted(guarded):
        module = model.get_submodule(name)
        setattr(module, ATTR, _guard(module, model, runtime, cast))


def remove(model) -> None:
    for module in model.modules():
        vars(module).pop(ATTR, None)


def _guard(module, model, runtime, cast):
    own = type(module)._apply

    def _apply(fn, *args, **kwargs):
        weight = model.get_input_embeddings().weight
        probe = torch.empty(0, dtype=weight.dtype, device=weight.device)
        moved = fn(probe)  # a move that cannot happen at all (.cuda() without CUDA) raises here, as on the plain model
        if isinstance(moved, torch.Tensor) and (moved.dtype != probe.dtype or moved.device != probe.device):
            if module is model and moved.device == probe.device and cast is not None:  # the whole model's dtype
                done = cast(model, lambda: own(module, fn, *args, **kwargs), moved.dtype)
                if done is not None:
                    return done
            raise RuntimeError(refusal(runtime, probe, moved))
        return own(module, fn, *args, **kwargs)

    return _apply


def refusal(runtime, before: torch.Tensor, after: torch.Tensor) -> str:
    """The message of a refused move (``before`` -> ``after``: a probe's dtype and device): what, why, and the calls
    that do it."""
    change, target = [], []
    if after.device != before.device:
        change.append(f"a move from {before.device} to {after.device}")
        target.append(f"device={str(after.device)!r}")
    if after.dtype != before.dtype:
        change.append(f"a cast from {before.dtype} to {after.dtype}")
        target.append(f"dtype={after.dtype}")
    config = runtime.config
    why = (f"{' and '.join(change).capitalize()} is refused on a SpecFit-enabled model: its routed experts live in "
           f"SpecFit's host store ({runtime.store.dtype}) with device slots on {runtime.device}, which moving the "
           f"model's parameters does not reach, so every later generate() would fail.")
    loaded_by = getattr(runtime, "load_call", None)  # the call that loaded it, with {dtype}: embedded.load's
    if loaded_by is not None and after.device == before.device:
        return (f"{why} Load it again in the dtype you want with the call that loaded it (it keeps the drafter and "
                f"the link): {loaded_by.replace('{dtype}', f'dtype={after.dtype}')} (with your other options)")
    made = runtime._restore is not None and runtime._restore.get("param_dtype") is None  # by from_pretrained
    if made and loaded_by is None:
        return (f"{why} Load it again in the dtype and on the device you want: specfit.from_pretrained(path_or_id, "
                f"cache_slots={config.cache_slots}, {', '.join(target)}) (with your other options)")
    link = config.link
    simple = link is not None and link == type(link)(seconds_per_expert=link.seconds_per_expert)
    link = "" if link is None else f", link={link.seconds_per_expert!r}" if simple else f", link=specfit.{link!r}"
    mode = "" if config.cache_mode == "cached" else f", cache_mode={config.cache_mode!r}"
    source = getattr(runtime.drafter, "name_or_path", None)  # a drafter loaded from a folder or hub id
    drafter = "" if runtime.drafter is None else f", drafter={source!r}" if source else ", drafter=..."
    move = ", ".join(t.split("=", 1)[1] for t in target)
    return (f"{why} Disable SpecFit, move the model, enable it again: specfit.disable(model); model.to({move}); "
            f"specfit.enable(model, cache_slots={config.cache_slots}{mode}{link}{drafter}) (with your other options)")
