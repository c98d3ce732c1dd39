"""Which cost profile a model uses, and at what price per copy: the one given to ``enable``, this machine's calibrated
profile in the user cache, or a reference profile shipped in ``calibration/``; the names (device, model) a profile
is filed under; and the link's own time per expert copy that prices its copies (``link_seconds``), with the host
lane's own time per expert that prices host experts (``price``).

One profile per machine and model: it carries over to any slot count, cache mode and link, because those change
only how often an expert misses (the selector reads that from the live slot cache) and what the link takes per copy
(read from the link at hand), not what computing or copying an expert costs."""

from __future__ import annotations

import json
import platform
import warnings
from functools import lru_cache
from importlib.resources import as_file, files
from pathlib import Path

import torch

from .cost_model import CostModel
from .profile_files import FORMAT, TOKENIZER_FILES, ProfileError, profile_path
from .fit_quality import REMEDY, REMEDY_PYTHON


def device_name(runtime) -> str:
    """Names the machine a cost profile belongs to: the GPU's name, or the CPU's model (a link is not part of it:
    one profile prices every link)."""
    if runtime.device.type == "cuda":
        return torch.cuda.get_device_name(runtime.device)
    return f"cpu-{_cpu_model()}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_id(model) -> str:
    """The model's name: its hub id, a local folder's name, or (built in code) its class name."""
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")
    if not name:
        return type(model).__name__
    path = Path(name)
    return path.name if path.is_absolute() or path.exists() else name


def model_key(model) -> str:
    """What a profile is filed under: the model's name and the shape that sets its costs (MoE layers, experts, top-k,
    hidden size, the dtype it computes in), so two sizes of one class never share a profile. (How the experts are
    stored, e.g. FP8, changes the bytes a copy moves, which the link's time per copy reads; an FP8 checkpoint has a
    name of its own.)

    e.g. ``'Qwen/Qwen3-30B-A3B [48x128e top8 h2048 bfloat16]'``"""
    from ..seam import layers as hf_layers

    runtime = model.specfit
    store = runtime.store
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    top_k = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_k", "top_k", "num_experts_per_token")
                  if isinstance(getattr(text, k, None), int)), "?")
    dtype = str(hf_layers.compute_dtype(model)).replace("torch.", "")
    return f"{model_id(model)} [{len(store.arenas)}x{store.num_experts}e top{top_k} h{store.hidden} {dtype}]"


def profile_key(model) -> dict:
    """``profile_path(**profile_key(model))`` is where this machine's profile for the model lives."""
    return dict(device_name=device_name(model.specfit), model_key=model_key(model))


def link_seconds(runtime) -> float:
    """The link's own time for one expert copy (the stored bytes of one expert): an emulated link's set time for
    those bytes; on CUDA, the bytes over the pinned host-to-device bandwidth (measured once, in ``runtime``); 0 for
    a memcpy on a CPU with no emulated link (its cost is the profile's ``copy_overhead``)."""
    return runtime.copy_seconds()


PYTHON_CALL = "`specfit.calibrate(model, prompts)`"


def calibrate_command(model) -> str:
    """The call that fits this machine's profile for ``model``, as it works for it: what the code that loaded it
    recorded (``model.specfit.calibrate_command``: ``specfit.embedded.load``'s, with its ``--fp8`` and ``--dtype``),
    else the command line for a checkpoint folder or hub id (with the drafter's folder, the dtype the profile is
    filed under, and ``--device cpu`` where CUDA would be the default), else the Python call for a model built in
    code."""
    runtime = model.specfit
    hint = getattr(runtime, "calibrate_command", None)
    if hint:
        return f"`{hint}`"
    source = str(getattr(model.config, "_name_or_path", "") or "")
    if source and (Path(source).is_dir() or ("/" in source and not Path(source).is_absolute())):
        from ..seam import layers as hf_layers

        drafter = getattr(runtime.drafter, "name_or_path", None)
        dtype = str(hf_layers.compute_dtype(model)).replace("torch.", "")
        cpu = runtime.device.type == "cpu" and torch.cuda.is_available()
        untokenized = Path(source).is_dir() and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES)
        return (f"`specfit calibrate --model {source}{f' --drafter {drafter}' if drafter else ''} --dtype {dtype}"
                f"{' --device cpu' if cpu else ''}{' --prompts random' if untokenized else ''}`")
    return f"{PYTHON_CALL} (Python: this model was built in code, so the command line cannot load it)"


def remedy(model) -> str:
    """What to do about a poor fit, in the words of the call ``calibrate_command`` names: flags or keywords."""
    return REMEDY_PYTHON if calibrate_command(model).startswith(PYTHON_CALL) else REMEDY


def resolve_cost_model(model) -> CostModel:
    """The cost model SpecFit's selector uses, priced for this model's link: the one given to ``enable``, else a
    calibrated profile (``find_profile``), else the documented default, with a loud warning. ``cost="paper"`` takes
    the profile's demand-only fit."""
    runtime = model.specfit
    options = runtime.options
    found = find_profile(model)  # looked up at every call: a profile calibrated meanwhile is used from the next one
    if found is not None:
        return price(model, found, options.cost if options is not None else "cache-aware")
    runtime.cost_source = (None, "none: the default cost model (no profile for this device and model)")
    key = profile_key(model)  # not stored: a profile calibrated later in this process is found next time
    warnings.warn(
        f"no calibrated cost profile for device {key['device_name']!r}, model {key['model_key']!r} (looked for "
        f"{profile_path(**key)}): SpecFit uses the default cost model (the paper's A100 beta, copies not told "
        f"apart), which can pick poor subtrees here. Run {calibrate_command(model)} once on this machine.",
        RuntimeWarning, stacklevel=3)
    return CostModel.default(options.max_nodes if options is not None else 7)


def price(model, cost: CostModel, kind: str) -> CostModel:
    """``cost`` as the selector takes it for ``kind`` ("cache-aware" or "paper") on this model's link."""
    if kind == "paper":
        paper = cost.paper()
        _warn_if_other_setup(model, paper)
        return paper
    if not cost.prices_copies:
        warnings.warn(f"{_describe(cost)} prices demand only (a profile from before version 3, or a hand-made "
                      f"model), so cost='cache-aware' cannot tell resident experts from copies: SpecFit prices "
                      f"demand as the paper does. Run {calibrate_command(model)} to fit copies too.",
                      RuntimeWarning, stacklevel=4)
        _warn_if_other_setup(model, cost)
        return cost
    runtime = model.specfit
    if runtime.cold == "copy":
        return cost.priced(link_seconds(runtime))
    if not cost.prices_host:
        warnings.warn(f"{_describe(cost)} was fitted without a host lane (calibrated before host experts), so "
                      f"SpecFit prices each host expert (cold={runtime.cold!r}) at the lane's own time, with no "
                      f"fitted overhead or overlap. Run {calibrate_command(model)} to fit the host lane too.",
                      RuntimeWarning, stacklevel=4)
    return cost.priced(link_seconds(runtime), runtime.host_seconds(), runtime.cold)


def _warn_if_other_setup(model, cost: CostModel) -> None:
    """A demand-only model is valid only at the slot count and link it was fitted at: warn elsewhere."""
    runtime, meta = model.specfit, cost.meta
    here = {"slots": runtime.config.cache_slots, "link": runtime.link_label}
    other = {k: meta[k] for k in here if k in meta and meta[k] != here[k]}
    if other:
        shown = ", ".join(f"{k} {v!r} (here {here[k]!r})" for k, v in other.items())
        warnings.warn(f"the demand-only cost model (cost='paper') was fitted at {shown}; its beta hides that setup's "
                      f"hit rate, so it misprices this one. Use cost='cache-aware' (the default), which carries "
                      f"over, or refit the paper's model here with {calibrate_command(model)} run with these slots "
                      f"and link.", RuntimeWarning, stacklevel=5)


def checked_cost_model(model, cost) -> CostModel:
    """An explicit cost model (a ``CostModel`` or a profile path) checked against this model's setup: the profile
    must read cleanly and predict up to ``max_nodes``; a demand-only profile (version 1 or 2) records the slot count
    and cache mode it was fitted for, and must match them. Called by ``enable``/``configure``, so a bad profile
    fails there, not at the first ``generate``."""
    runtime = model.specfit
    loaded = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    where = cost if not isinstance(cost, CostModel) else "the CostModel given"
    if not loaded.prices_copies:
        for field, want in (("slots", runtime.config.cache_slots), ("cache_mode", runtime.config.cache_mode)):
            if field in loaded.meta and loaded.meta[field] != want:
                raise ProfileError(f"{where}: field {field!r} is {loaded.meta[field]!r}, expected {want!r} (this "
                                   f"demand-only profile was fitted for {field}={loaded.meta[field]!r}; this model "
                                   f"was enabled with {want!r}); run {calibrate_command(model)} for a profile that "
                                   f"prices any slot count")
    max_nodes = runtime.options.max_nodes if runtime.options is not None else 0
    if loaded.max_nodes < max_nodes:
        raise ProfileError(f"{where}: predicts up to {loaded.max_nodes} nodes but max_nodes is {max_nodes}; "
                           f"recalibrate ({calibrate_command(model)}) or lower max_nodes")
    return loaded


def check_profile_options(model, options) -> None:
    """Options that need a field of the cost profile SpecFit's selector will use, checked at ``enable``/``configure``
    against the profile found now (``find_profile``): ``max_nodes`` needs its intercepts up to that many nodes, and
    ``cost="paper"`` its demand-only fit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same warnings come when generate() uses the profile
            cost = find_profile(model)
    except ProfileError:
        return  # reported by generate(assistant="specfit"), the only use of a profile
    if cost is None:
        return
    where = _describe(cost)
    if options.cost == "paper":
        try:
            cost = cost.paper()
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if cost.max_nodes < options.max_nodes:
        raise ProfileError(f"{where} predicts up to {cost.max_nodes} nodes but max_nodes is {options.max_nodes}; "
                           f"recalibrate ({calibrate_command(model)}) or lower max_nodes")


def _describe(cost: CostModel) -> str:
    m = cost.meta
    if "model_id" not in m:
        return "the cost model given"
    return f"the cost profile for {m.get('model_key', m.get('model_id'))!r} (measured on {m.get('device')!r})"


def find_profile(model):
    """The explicit profile given to ``enable`` (checked against this setup), else this machine's calibrated profile
    in the user cache, else a reference profile shipped in ``calibration/`` for the same model (measured on another
    machine: a warning says so); None when there is none. A profile whose recorded fit quality is poor, or that was
    never assessed (version 1), is used with a warning (see ``warn_if_unreliable``). Unpriced: see ``price``."""
    runtime = model.specfit
    if runtime.cost_model is not None:
        cost = checked_cost_model(model, runtime.cost_model)
        warn_if_unreliable(cost, str(runtime.cost_model) if not isinstance(runtime.cost_model, CostModel)
                           else "in use by this model", model)
        known = getattr(runtime, "cost_source", None)
        if not (known and known[0] is runtime.cost_model):  # not one found here before: given to enable/configure
            runtime.cost_source = (runtime.cost_model, f"given to enable/configure ({_describe(cost)})")
        return cost
    key = profile_key(model)
    path = profile_path(**key)
    if path.is_file():
        found = _load_once(runtime, path)
        warn_if_unreliable(found, str(path), model)
        runtime.cost_source = (found, f"this machine's, calibrated {found.meta.get('date', '?')} ({path.name})")
        return found
    reference = reference_profile(key)
    if reference is not None and reference.meta.get("device") != key["device_name"]:
        warnings.warn(f"using the reference cost profile measured on {reference.meta.get('device')!r} for this "
                      f"{key['device_name']!r}; run {calibrate_command(model)} to fit this machine",
                      RuntimeWarning, stacklevel=4)
    if reference is not None:
        warn_if_unreliable(reference, f"shipped with specfit for {key['model_key']}", model)
        runtime.cost_source = (reference, f"the reference profile shipped with specfit, measured on "
                                          f"{reference.meta.get('device')!r}")
    return reference


def _load_once(runtime, path) -> CostModel:
    """The profile at ``path``, read again only when the file changed since this runtime last read it (a new
    calibration replaces it): generate() looks its profile up at every call without re-parsing it."""
    info = path.stat()
    stamp = (str(path), info.st_mtime_ns, info.st_size)
    cached = runtime.profile_read
    if cached is None or cached[0] != stamp:
        cached = runtime.profile_read = (stamp, CostModel.load(path))
    return cached[1]


def profile_source(model) -> str | None:
    """Where the profile SpecFit's cost model starts from came from (set where ``find_profile`` found it)."""
    known = getattr(model.specfit, "cost_source", None)
    return known[1] if known else None


def warn_if_unreliable(cost: CostModel, where: str, model=None) -> None:
    """Warn (RuntimeWarning) when a cost model's recorded calibration verdict is not "good": "poor" (installed with
    ``--force``) or "unassessed" (a version-1 profile). A model with no recorded quality (made by hand) is trusted."""
    quality = cost.quality
    if not quality or quality.get("verdict") == "good":
        return
    reasons = "; ".join(quality.get("reasons", [])) or "no reasons recorded"
    command = calibrate_command(model) if model is not None else "`specfit calibrate`"
    if quality.get("verdict") == "poor":
        text = (f"the cost profile {where} failed calibration's quality gate ({reasons}), so SpecFit may verify "
                f"poor subtrees. Recalibrate with {command}: {remedy(model) if model is not None else REMEDY}.")
    else:
        text = (f"the cost profile {where} was never checked for fit quality ({reasons}). Recalibrate with "
                f"{command} to fit and check it.")
    warnings.warn(text, RuntimeWarning, stacklevel=4)


def reference_profile(key: dict):
    """A profile shipped in ``calibration/`` (package ``specfit.calibration``) for the same model (name and shape),
    preferring one measured on this very device. Read once per process: the package's files do not change."""
    return _reference_profile(key["model_key"], key["device_name"])


@lru_cache(maxsize=None)
def _reference_profile(model_key: str, device_name: str):
    matches = []
    for entry in files("specfit.calibration").iterdir():
        if not entry.name.endswith(".json"):
            continue
        data = json.loads(entry.read_text())
        if data.get("format") != FORMAT or data.get("model_key") != model_key:
            continue
        matches.append((data.get("device") != device_name, entry.name, entry))
    if not matches:
        return None
    with as_file(min(matches)[2]) as path:
        return CostModel.load(path)
