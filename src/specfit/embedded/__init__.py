"""The embedded default: a small Qwen3-MoE trained from scratch by SpecFit's own code (``specfit train-target``) and
its EAGLE-3 drafter (``specfit train-drafter``), shipped with the package so the demo, the benchmark and the
regression run on a fresh machine. See the model cards in ``target/README.md`` and ``drafter/README.md``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .paths import DRAFTER_DIR, HERE, TARGET_DIR
MODEL_ID = "specfit/embedded-qwen3-moe"  # the model id cost profiles are filed under

# CPU threads that decode this model fastest: its matrices are so small that more threads only add synchronisation
# (`python benchmarks/run.py speed --threads 1 2` measures it; a notebook on a many-core machine ran up to 7x slower with
# torch's default). `load` advises it once; the CLI commands set it themselves. A library call never changes it.
FASTEST_THREADS = 1


# the paper's A100 (Qwen3-30B-A3B over PCIe 4.0): copying one token's full expert demand takes ~1.4x that token's
# compute. The embedded model's emulated link keeps that ratio on whatever CPU it runs (default_link_seconds)
DEMAND_TO_COMPUTE = 1.4


# The structural default host lane (``default_host``), beside the default link: a PCIe 4.0 host whose CPU experts
# kernel reads experts 2.5x faster than the link copies them (FreeToken's measured 2x Xeon Platinum 8358P, an RTX
# 4090 host: 63.2 GB/s against its PCIe 4.0 link's 25.1 GB/s). Its two small parts, as shares of the time that host
# takes to read one bf16 expert (Qwen3-30B-A3B's 9.4 MB at 63.2 GB/s: 149 us), so they scale with this machine as the
# link does: a fixed cost per host expert of 22 us (the 18-26 us per request measured for a tuned CPU experts
# kernel), 0.148 of it; and per token routed to it, 0.3 ms over 31 tokens (one core: 1.9 ms for 1 token, 2.2 ms for
# 32, bytes-bound at 1.87 ms), 0.0052 of its bytes time
HOST_TO_LINK = 2.5
HOST_OVERHEAD = 22 / 149
HOST_PER_TOKEN = (2.2 - 1.9) / 31 / 1.87

# the demo's slots per layer (of 64): where copies dominate, as the paper's 24 of 128 (``demo_settings``)
DEMO_SLOTS = 12


class ThreadsNotice(UserWarning):
    """torch's CPU thread count would slow the embedded model down (issued once per process)."""


_threads_noticed = False
_link: dict = {}  # torch thread count -> (seconds per copy, one token's compute seconds)


def available() -> bool:
    return (TARGET_DIR / "config.json").is_file() and (DRAFTER_DIR / "config.json").is_file()


def load(cache_slots: int, *, drafter: bool = True, dtype=None, fp8: bool = False, **enable_kwargs):
    """The embedded target with offloaded experts (and its drafter), fp32 on the CPU; returns (model, tokenizer).

    ``cache_slots``: expert slots per layer (of 64); ``enable_kwargs`` go to ``specfit.enable`` (e.g.
    ``link=0.28e-3`` for an emulated host link, ``cache_mode``, decoding options). The model is fastest with one
    CPU thread: call ``torch.set_num_threads(1)`` first (a ``ThreadsNotice`` says so once when torch uses more).
    ``fp8=True``: the block-wise FP8 variant (``embedded.fp8``, built into the user cache on first use), experts
    kept FP8 in the host arenas and device slots; ``model.name_or_path`` is its folder, which plain transformers
    loads too. The same drafter drafts for it.
    """
    import torch
    from transformers import AutoTokenizer

    from ..patch import from_pretrained

    if not available():
        raise FileNotFoundError(f"the embedded model is missing from {HERE}; reinstall specfit, or train it with "
                                f"`specfit train-target --out {TARGET_DIR}` then "
                                f"`specfit train-drafter --out {DRAFTER_DIR}`")
    advise_threads(torch.get_num_threads())
    if fp8:
        from .fp8 import folder

        path = folder()
    else:
        path = TARGET_DIR
    model = from_pretrained(path, cache_slots=cache_slots, dtype=dtype or torch.float32, device="cpu",
                            drafter=str(DRAFTER_DIR) if drafter else None, **enable_kwargs)
    model.config._name_or_path = str(path) if fp8 else MODEL_ID
    # what warnings name to fit this machine's profile for it: the profile is filed under the dtype computed in
    model.specfit.calibrate_command = calibrate_command(fp8, dtype)
    # what a refused cast names to load it again in another dtype (offload/moves.py), drafter and link kept
    model.specfit.load_call = _load_call(cache_slots, drafter, fp8, enable_kwargs)
    return model, AutoTokenizer.from_pretrained(TARGET_DIR)


def _load_call(cache_slots: int, drafter: bool, fp8: bool, enable_kwargs: dict) -> str:
    """This ``load`` call as Python, with ``{dtype}`` where the dtype goes; the link as it was given (the structural
    default by its rule, so the call measures it again)."""
    args = [str(cache_slots)] + ([] if drafter else ["drafter=False"]) + (["fp8=True"] if fp8 else [])
    link = enable_kwargs.get("link")
    if link is not None and getattr(link, "relative", None) is not None:
        args.append("link=specfit.embedded.default_link()" if link.relative == 1 else
                    f"link=specfit.embedded.default_link({link.relative!r})")
    elif link is not None:
        args.append(f"link={link!r}" if isinstance(link, (int, float)) else f"link=specfit.{link!r}")
    host = enable_kwargs.get("host")
    if host is not None and getattr(host, "relative", None) is not None and getattr(link, "relative", None):
        beside = "" if link.relative == 1 else f", specfit.embedded.default_link({link.relative!r})"
        args.append(f"host=specfit.embedded.default_host({host.relative!r}{beside})")
    elif host is not None:
        args.append(f"host={host!r}" if isinstance(host, (int, float)) else f"host=specfit.{host!r}")
    if enable_kwargs.get("cache_mode", "cached") != "cached":
        args.append(f"cache_mode={enable_kwargs['cache_mode']!r}")
    return f"model, tokenizer = specfit.embedded.load({', '.join(args)}, {{dtype}})"


def calibrate_command(fp8: bool = False, dtype=None) -> str:
    """The command that fits this machine's profile for ``load(fp8=fp8, dtype=dtype)``.

    >>> calibrate_command(True, "bfloat16")
    'specfit calibrate --fp8 --dtype bfloat16'
    """
    name = str(dtype or "float32").replace("torch.", "")
    return "specfit calibrate" + (" --fp8" if fp8 else "") + ("" if name == "float32" else f" --dtype {name}")


def is_embedded(model) -> bool:
    """Whether ``model`` is the embedded model or its FP8 variant (as ``load`` names them)."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    return name == MODEL_ID or Path(name).name.startswith("target-fp8-")


def advise_threads(threads: int) -> None:
    """Warn once per process (``ThreadsNotice``) when ``threads`` CPU threads would slow the embedded model."""
    global _threads_noticed
    if threads <= FASTEST_THREADS or _threads_noticed:
        return
    _threads_noticed = True
    warnings.warn(f"torch uses {threads} CPU threads in this process; the embedded model is so small that "
                  f"{FASTEST_THREADS} is fastest (more threads only add synchronisation: with a many-core default "
                  f"decoding ran up to 7x slower). Call torch.set_num_threads({FASTEST_THREADS}) before generating; "
                  f"SpecFit leaves this process-wide setting to you (`specfit demo` and `specfit bench` set it "
                  f"themselves).", ThreadsNotice, stacklevel=3)


def default_link_seconds(refresh: bool = False) -> float:
    """Seconds per expert copy of the emulated host link the demo and the bench use by default: 1.4 x (one token's
    compute with every expert resident) / (layers x top-k), so that, as on the paper's A100, copying a token's full
    expert demand costs 1.4x its compute on this machine. Measured once per machine, thread count and weights (each
    part of a forward at its fastest over many forwards: ``fastest_forward_seconds``, which a busy core does not
    move) and kept in the user cache (``link_store``), so runs on one machine compare; ``refresh=True`` (``specfit
    calibrate``, ``recheck_default_link``) measures and keeps it again; ``token_compute_seconds()`` gives the
    compute it was derived from and ``default_link_note()`` says where it is kept."""
    return _measured_link(refresh)[0]


def recheck_default_link() -> tuple[tuple[float, float] | None, tuple[float, float]]:
    """Measure the default link again and keep the new figure in place of the kept one (``specfit calibrate`` does,
    before it fits the profile the link is priced under): (the kept (seconds per copy, compute) before, or None;
    the new one)."""
    import torch

    from . import link_store

    before = link_store.read(link_store.key(torch.get_num_threads(), TARGET_DIR / "model.safetensors"))
    return before, _measured_link(True)


def default_link_known() -> bool:
    """Whether the default link is known without measuring it: measured in this process, or kept for this machine."""
    import torch

    from . import link_store

    threads = torch.get_num_threads()
    return threads in _link or link_store.read(link_store.key(threads, TARGET_DIR / "model.safetensors")) is not None


def default_link_note() -> str:
    """How the default link was set, for a run's header: the rule, the compute it scales, when it was measured,
    where it is kept and how to measure it again."""
    import torch

    from . import link_store

    entry = link_store.read_entry(link_store.key(torch.get_num_threads(), TARGET_DIR / "model.safetensors")) or {}
    when = f"measured {entry['measured'][:10]}" if entry.get("measured") else "measured now"
    return (f"default: 1.4 x one token's compute ({token_compute_seconds() * 1e3:.2f} ms, {when} on this machine, "
            f"kept in {link_store.path()}; `specfit calibrate` measures it again) / (layers x top-k)")


def default_link(ratio: float = 1.0):
    """The ``LinkConfig`` of the structural default link, labelled by that rule (its cost profiles are found on any
    machine, whatever the ms there): priced per byte, at the bandwidth that copies one bf16 expert (the shipped
    weights' dtype, kept as stored in the arenas) in ``ratio`` x ``default_link_seconds()``, so an FP8 expert (e4m3
    + scales, ``load(fp8=True)``) costs about half. ``ratio=0`` is no link (None)."""
    from ..offload.link import LinkConfig

    if ratio == 0:
        return None
    return LinkConfig(bandwidth=bf16_expert_bytes() / (ratio * default_link_seconds()), relative=ratio)


def demo_settings(cache_slots: int = DEMO_SLOTS, link_ratio: float = 1.0, host_ratio: float = HOST_TO_LINK) -> dict:
    """The one configuration ``specfit demo``, the README's snippet and table, and the quickstart notebook and
    script run, as ``load``'s keywords (``load(**demo_settings())``): ``cache_slots`` expert slots per layer, the
    structural default link at ``link_ratio`` x its time per copy (0: no link) and beside it the structural default
    host lane at ``host_ratio`` x the link's bandwidth (0: no lane, every cold expert copied; with no link there is
    no lane either, as the lane is scaled to the link). Emulated on a CPU: figures with it are not GPU speed."""
    for name, value in (("link_ratio", link_ratio), ("host_ratio", host_ratio)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"demo_settings: {name} must be a finite number >= 0 (0: none), got {value!r}")
    link = default_link(link_ratio)
    host = default_host(host_ratio, link) if link is not None and host_ratio > 0 else None
    return dict(cache_slots=cache_slots, link=link, host=host)


def default_host(ratio: float = HOST_TO_LINK, link=None):
    """The ``HostConfig`` of the structural default host lane, labelled by that rule: the host reads experts
    ``ratio`` x as fast as ``link`` (default: the structural default link) copies them (2.5: a PCIe 4.0 host,
    ``HOST_TO_LINK``), plus a fixed cost per host expert and a cost per token routed to it, each a share of the
    2.5x host's time for one bf16 expert (``HOST_OVERHEAD``, ``HOST_PER_TOKEN``; the same whatever ``ratio``: only
    the bandwidth moves). Emulated: figures with it are CPU figures, not GPU speed."""
    from ..offload.host_lane import HostConfig

    link = link if link is not None else default_link()
    expert = bf16_expert_bytes()
    if not link.copy_time(expert) > 0:
        raise ValueError(f"default_host scales the host lane to the link, and {link.label} copies for free: give a "
                         f"link that costs time, or no host lane (every cold expert copied)")
    bandwidth = expert / link.copy_time(expert)  # the link's bytes/s for a bf16 expert
    read = expert / (HOST_TO_LINK * bandwidth)  # the 2.5x host's seconds for one bf16 expert
    return HostConfig(bandwidth=ratio * bandwidth, overhead=HOST_OVERHEAD * read, per_token=HOST_PER_TOKEN * read,
                      relative=ratio)


def bf16_expert_bytes() -> int:
    """Bytes of one embedded expert in bf16 (gate, up and down: 3 x moe_intermediate x hidden x 2)."""
    import json

    config = json.loads((TARGET_DIR / "config.json").read_text())
    return 3 * config["moe_intermediate_size"] * config["hidden_size"] * 2


def scale_link(link, ratio: float):
    """``link`` with every copy ``ratio`` times as dear (the structural default stays labelled by its rule); None for
    ``ratio`` 0 or no link."""
    from dataclasses import replace

    if link is None or ratio <= 0:
        return None
    if link.relative is not None and link.bandwidth is not None:
        return replace(link, bandwidth=link.bandwidth / ratio, relative=link.relative * ratio)
    if link.bandwidth is not None:
        return replace(link, bandwidth=link.bandwidth / ratio, latency=link.latency * ratio)
    return replace(link, seconds_per_expert=link.seconds_per_expert * ratio,
                   relative=None if link.relative is None else link.relative * ratio)


def link_seconds_per_expert(link) -> float:
    """Seconds ``link`` (a ``LinkConfig``) takes to copy one bf16 expert of the embedded model (for display, and
    for links given per copy: their ``seconds_per_expert``)."""
    return link.copy_time(bf16_expert_bytes())


def token_compute_seconds(refresh: bool = False) -> float:
    """One decode forward of the embedded model with every expert resident and no link (what the link is scaled to)."""
    return _measured_link(refresh)[1]


def _measured_link(refresh: bool) -> tuple[float, float]:
    """Per thread count: this process's value, else the one kept for this machine (``link_store``), else measured
    and kept; ``refresh`` measures and keeps it again (``specfit calibrate`` does)."""
    import torch

    from . import link_store

    key = torch.get_num_threads()
    entry = link_store.key(key, TARGET_DIR / "model.safetensors")
    if not refresh and key not in _link and (kept := link_store.read(entry)) is not None:
        _link[key] = kept
    if refresh or key not in _link:
        model, tokenizer = load(_num_experts(), drafter=False)
        ids = tokenizer("Question: A farmer has 12 cows and buys 5 more. How many cows does he have?\nAnswer:",
                        return_tensors="pt").input_ids
        compute = fastest_forward_seconds(model, ids)
        demand = model.config.num_hidden_layers * model.config.num_experts_per_tok
        _link[key] = (DEMAND_TO_COMPUTE * compute / demand, compute)
        link_store.write(entry, *_link[key])
    return _link[key]


def fastest_forward_seconds(model, ids, forwards: int = 40) -> float:
    """One decode forward after ``ids``, its compute alone: the sum over the forward's parts (each decoder layer, and
    the rest: embeddings, final norm, head) of that part's fastest time over ``forwards`` forwards. One part takes
    about a millisecond, so most of its runs fit between two moments another process takes the core, and its fastest
    run is its compute: a busy machine does not decide the figure (whole forwards, timed whole, read 3-5x slower
    with the other core busy; the fastest parts stayed within a few percent)."""
    import math
    import time

    import torch
    from transformers import DynamicCache

    from ..seam.layers import decoder_layers

    layers = list(decoder_layers(model))
    fastest = [math.inf] * (len(layers) + 1)  # each decoder layer's fastest run, then the rest of the forward's
    began, took = {}, [0.0] * len(layers)

    def before(i):
        return lambda module, args: began.__setitem__(i, time.perf_counter())

    def after(i):
        return lambda module, args, out: took.__setitem__(i, time.perf_counter() - began[i])

    hooks = [layer.register_forward_pre_hook(before(i)) for i, layer in enumerate(layers)]
    hooks += [layer.register_forward_hook(after(i)) for i, layer in enumerate(layers)]
    cache = DynamicCache(config=model.config)
    token = ids[:, -1:]
    try:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
            model(token, cache=cache, use_cache=True)  # warm-up
            cache.crop(-1)
            for _ in range(forwards):
                t0 = time.perf_counter()
                model(token, cache=cache, use_cache=True)
                whole = time.perf_counter() - t0
                cache.crop(-1)
                for i, seconds in enumerate(took):
                    fastest[i] = min(fastest[i], seconds)
                fastest[-1] = min(fastest[-1], max(0.0, whole - sum(took)))
    finally:
        for hook in hooks:
            hook.remove()
    return sum(fastest)


def _num_experts() -> int:
    import json

    config = json.loads((TARGET_DIR / "config.json").read_text())
    return config.get("num_experts") or config["num_local_experts"]
