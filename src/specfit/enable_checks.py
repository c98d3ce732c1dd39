"""Checks of what ``enable``, ``configure`` and ``from_pretrained`` are given, each before the model is touched: the
keywords (a misspelt one named with the closest), the slot count, the link and host lane, where cold experts run,
a ``device_map``, weights that are really in memory. Each refusal names the value and what would be right.
"""

from __future__ import annotations

import difflib
import inspect
import os
from dataclasses import fields
from pathlib import Path

import torch

from .decoding.options import DecodingOptions
from .offload import standin
from .offload.cold import check_cold
from .offload.formats import host_path_formats
from .offload.host_lane import HostConfig
from .offload.link import LinkConfig

OPTION_NAMES = tuple(f.name for f in fields(DecodingOptions))  # new options pass the keyword check by themselves
DECODING_KEYWORDS = OPTION_NAMES + ("cost_model", "route_predictor")  # enable's **decoding
FROM_PRETRAINED_KEYWORDS = DECODING_KEYWORDS + ("cache_mode", "cache_policy", "link", "cold", "host", "drafter")
ENABLE_ONLY = ("cache_slots", "cache_mode", "cache_policy", "link", "cold", "host", "pin", "device", "store", "drafter",
               "route_predictor")


def _check_keywords(given, accepted, where: str, named=None, enable_only=()) -> None:
    """Unknown keywords in ``given`` (a function's ``**kwargs``) are refused by name, with the closest of the
    keywords the function takes: ``accepted`` and the keyword parameters of ``named`` (``max_node`` -> ``max_nodes``,
    ``device_map`` -> ``device``)."""
    for key in given:
        if key in accepted:
            continue
        if key in enable_only:
            raise TypeError(f"{where} cannot change {key}= on an enabled model: it is set by specfit.enable. Call "
                            f"specfit.disable(model), then specfit.enable(model, {key}=..., ...) again")
        parameters = inspect.signature(named).parameters.values() if named is not None else ()
        takes = sorted({*accepted, *(p.name for p in parameters if p.kind in (p.KEYWORD_ONLY,
                                                                              p.POSITIONAL_OR_KEYWORD))} - {"model"})
        close = difflib.get_close_matches(key, takes, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise TypeError(f"{where} got an unexpected keyword argument {key!r}{hint} It takes: {', '.join(takes)}")


def _decoding_options(kwargs) -> DecodingOptions:
    """The decoding options among ``kwargs``, checked (values too) before any work."""
    return DecodingOptions(**{k: v for k, v in kwargs.items() if k in OPTION_NAMES})


def _check_slots(cache_slots, num_experts: int | None = None) -> None:
    """``cache_slots``: an integer in 1..num_experts (only its type when the number of experts is not known yet)."""
    span = "1..number of experts per layer" if num_experts is None else f"1..{num_experts}"
    if cache_slots is None:
        raise ValueError(f"cache_slots is required: expert slots per MoE layer on the device, {span}")
    if isinstance(cache_slots, bool) or not isinstance(cache_slots, int) or \
            (num_experts is not None and not 1 <= cache_slots <= num_experts):
        raise ValueError(f"cache_slots must be an integer in {span}" +
                         (" (the model's experts per layer)" if num_experts is not None else "") +
                         f", got {cache_slots!r}")


def _link_config(link) -> LinkConfig | None:
    """A ``LinkConfig`` from seconds per expert copy (finite, >= 0: checked by LinkConfig), or as given."""
    if isinstance(link, (int, float)) and not isinstance(link, bool):
        return LinkConfig(seconds_per_expert=float(link))
    if link is not None and not isinstance(link, LinkConfig):
        raise ValueError(f"link must be a LinkConfig or seconds per expert copy (a float), got {link!r}")
    return link


def _check_link_device(link, device: torch.device) -> None:
    if link is not None and device.type == "cuda":
        raise ValueError("link= emulates a host link for CPU studies; on CUDA the copies are real: leave it unset")


def _host_config(host) -> HostConfig | None:
    """A ``HostConfig`` from the host's bandwidth in bytes/s (a finite number > 0: checked by HostConfig), or as
    given."""
    if isinstance(host, (int, float)) and not isinstance(host, bool):
        return HostConfig(bandwidth=float(host))
    if host is not None and not isinstance(host, HostConfig):
        raise ValueError(f"host must be a HostConfig or the host lane's bandwidth in bytes/s (a float), e.g. "
                         f"specfit.embedded.default_host(), got {host!r}")
    return host


def _cold_mode(cold, host: HostConfig | None, device: torch.device, fmt) -> str:
    """``cold=`` checked against where a host lane exists: CUDA (the host CPU itself), or a CPU device given an
    emulated lane (``host=``); and against the stored format (``offload/formats.py``: a format without a host path
    is copied). None: ``"auto"`` where a lane exists, else ``"copy"``."""
    if host is not None and device.type == "cuda":
        raise ValueError("host= emulates a host lane for CPU studies; on CUDA the host CPU computes host experts "
                         "for real: leave it unset")
    hosted = fmt is None or getattr(fmt, "host_path", False)
    lane = (host is not None or device.type == "cuda" or standin.active(device)) and hosted
    if cold is None:
        return "auto" if lane else "copy"
    check_cold(cold)
    if cold != "copy" and not hosted:
        raise ValueError(f"cold={cold!r}: the experts are stored as {fmt.name}, which has no host path (the host "
                         f"lane computes {', '.join(host_path_formats())} experts); use cold='copy'")
    if cold != "copy" and not lane:
        raise ValueError(f"cold={cold!r} needs a host lane: on a CPU device the host is the device itself, so give "
                         f"an emulated one, host=specfit.embedded.default_host() (or a HostConfig), or use "
                         f"cold='copy'")
    return cold


def _device_of_map(device_map, device):
    """``from_pretrained``'s ``device_map`` as the one device for the weights that are not routed experts."""
    if device_map is None:
        return device
    targets = set(map(str, device_map.values())) if isinstance(device_map, dict) else {str(device_map)}
    reason = None
    if len(targets) != 1:
        reason = f"it spreads the model over {sorted(targets)}"
    elif targets & {"disk", "meta"}:
        reason = "it offloads weights to disk"
    elif targets & {"balanced", "balanced_low_0", "sequential"}:
        reason = "it spreads the model over several GPUs"
    if reason is not None:
        raise ValueError(f"device_map={device_map!r}: {reason}. SpecFit places the model itself: the routed experts "
                         f"in host memory with a slot cache on the device, every other weight on one device. Pass "
                         f"device_map='auto' or device=... (default: CUDA when available, else CPU)")
    target = targets.pop()
    chosen = None if target == "auto" else torch.device(int(target) if target.isdigit() else target)
    if device is not None and chosen is not None and torch.device(device) != chosen:
        raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; pass one of them")
    return device if chosen is None else chosen


def _check_weights_in_memory(model) -> None:
    """enable moves the experts out of the model's own tensors: each must hold its values (not meta, as weights of
    a model loaded with disk or CPU offload are, or of one built without weights)."""
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        mapped = getattr(model, "hf_device_map", None)
        how = f" (hf_device_map places modules on {sorted(set(map(str, mapped.values())))})" if mapped else ""
        raise ValueError(f"{len(meta)} of the model's weights hold no values (meta tensors: {shown}){how}: SpecFit "
                         f"needs every weight in memory to move the experts to its host store. Load the model without "
                         f"disk or CPU offload (no device_map, or device_map='cpu'), or stream the checkpoint with "
                         f"specfit.from_pretrained(path, cache_slots=...)")


def _check_experts(model, num_experts: int) -> None:
    """A model whose MoE blocks hold no routed expert (a config naming 0) has nothing to offload."""
    if num_experts < 1:
        from .offload.config_file import MOE_EXAMPLES

        raise ValueError(f"{type(model).__name__} has no MoE layers (its MoE blocks hold {num_experts} routed "
                         f"experts); SpecFit offloads the experts of models such as {MOE_EXAMPLES}")


def _check_before_load(path_or_id, drafter) -> None:
    """What ``from_pretrained`` refuses before it reads anything of the target but its config: a local folder's
    ``config.json`` that is not JSON (named by its path) or names 0 routed experts ("has no MoE layers", as a model
    without routers is refused from its skeleton); and a drafter given by path or hub id that cannot be found
    (``drafting/checkpoint_files.locate``: a hub id is fetched now, the drafter's few files, before the target's)."""
    from .offload.config_file import MOE_EXAMPLES, architecture, read_config, zero_experts

    where = "specfit.from_pretrained"
    local = Path(path_or_id).expanduser() if isinstance(path_or_id, (str, os.PathLike)) else None
    if local is not None and (local / "config.json").is_file():
        config = read_config(local / "config.json", where, str(path_or_id))
        zero = zero_experts(config)
        if zero:
            raise ValueError(f"{where} {str(path_or_id)!r}: {architecture(config)} has no MoE layers (its "
                             f"config.json names {zero}, no routed expert); SpecFit offloads the experts of models "
                             f"such as {MOE_EXAMPLES}")
    if drafter is not None and not isinstance(drafter, torch.nn.Module):
        from .drafting.checkpoint_files import locate

        try:
            locate(drafter)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{where}(..., drafter={str(drafter)!r}): {err}; nothing of the target was "
                                    f"loaded") from None
