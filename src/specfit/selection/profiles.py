"""Which cost profile a model uses: the one given to ``enable``, this machine's calibrated profile in the user cache,
or a reference profile shipped in ``calibration/``; and the names (device, model) a profile is filed under."""

from __future__ import annotations

import json
import platform
import warnings
from importlib.resources import as_file, files

import torch

from .cost_model import FORMAT, CostModel, ProfileError, profile_path
from .fit_quality import REMEDY


def device_name(runtime) -> str:
    """Names the machine a cost profile belongs to; an emulated link is part of the name (it sets beta)."""
    if runtime.device.type == "cuda":
        name = torch.cuda.get_device_name(runtime.device)
    else:
        name = f"cpu-{_cpu_model()}"
    if runtime.config.link is not None:
        name += f" ({runtime.config.link.label})"
    return name


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resolve_cost_model(model):
    """The cost model for the selector: the one given to ``enable``, else a calibrated profile (see
    ``find_profile``), else the documented default, with a loud warning."""
    runtime = model.specfit
    found = find_profile(model)
    if found is not None:
        runtime.cost_model = found
        return found
    key = profile_key(model)  # not stored: a profile calibrated later in this process is found next time
    warnings.warn(
        f"no calibrated cost profile for device {key['device_name']!r}, model {key['model_id']!r}, "
        f"{key['slots']} slots, cache mode {key['cache_mode']!r} (looked for {profile_path(**key)}): SpecFit uses "
        f"the default cost model (the paper's A100 beta), which can pick poor subtrees here. Run `specfit calibrate`.",
        RuntimeWarning, stacklevel=3)
    return CostModel.default(runtime.options.max_nodes)


def checked_cost_model(model, cost) -> CostModel:
    """An explicit cost model (a ``CostModel`` or a profile path) checked against this model's setup: the profile
    must read cleanly, record this slot count and cache mode (when it records them) and predict up to ``max_nodes``.
    Called by ``enable``/``configure``, so a bad profile fails there, not at the first ``generate``."""
    runtime = model.specfit
    loaded = cost if isinstance(cost, CostModel) else CostModel.load(cost)
    where = cost if not isinstance(cost, CostModel) else "the CostModel given"
    for field, want in (("slots", runtime.config.cache_slots), ("cache_mode", runtime.config.cache_mode)):
        if field in loaded.meta and loaded.meta[field] != want:
            raise ProfileError(f"{where}: field {field!r} is {loaded.meta[field]!r}, expected {want!r} (this model "
                               f"was enabled with {field}={want!r}); use a profile calibrated for it")
    max_nodes = runtime.options.max_nodes if runtime.options is not None else 0
    if loaded.max_nodes < max_nodes:
        raise ProfileError(f"{where}: predicts up to {loaded.max_nodes} nodes but max_nodes is {max_nodes}; "
                           f"recalibrate or lower max_nodes")
    return loaded


def check_profile_options(model, options) -> None:
    """Options that need a field of the cost profile SpecFit's selector will use, checked at ``enable``/``configure``
    against the profile found now (``find_profile``): ``cost="cache-aware"`` needs the profile's fit on expert
    misses, ``max_nodes`` its intercepts up to that many nodes. Without any profile the default cost model serves
    ``cost="paper"`` (with a warning at generate), never ``"cache-aware"``."""
    aware = options.cost == "cache-aware"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same warnings come when generate() uses the profile
            cost = find_profile(model)
    except ProfileError:
        if aware:
            raise
        return  # reported by generate(assistant="specfit"), the only use of a profile
    if cost is None:
        if aware:
            key = profile_key(model)
            raise ValueError(f"cost='cache-aware' needs a cost profile fitted on expert misses, and there is none for "
                             f"device {key['device_name']!r}, model {key['model_id']!r}, {key['slots']} slots, cache "
                             f"mode {key['cache_mode']!r}: run `specfit calibrate --slots {key['slots']}` (it fits "
                             f"misses too), pass cost_model=PROFILE, or keep cost='paper'")
        return
    where = _describe(cost)
    if aware:
        try:
            cost = cost.cache_aware()
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if cost.max_nodes < options.max_nodes:
        raise ProfileError(f"{where} predicts up to {cost.max_nodes} nodes but max_nodes is {options.max_nodes}; "
                           f"recalibrate or lower max_nodes")


def _describe(cost: CostModel) -> str:
    m = cost.meta
    if "slots" not in m:
        return "the cost model given"
    return (f"the cost profile for {m.get('model_id')!r}, {m.get('slots')} slots, {m.get('cache_mode')}, "
            f"{m.get('link')} (measured on {m.get('device')!r})")


def profile_key(model) -> dict:
    runtime = model.specfit
    return dict(device_name=device_name(runtime), model_id=model_id(model), slots=runtime.config.cache_slots,
                cache_mode=runtime.config.cache_mode)


def find_profile(model):
    """The explicit profile given to ``enable`` (checked against this setup), else this machine's calibrated profile
    in the user cache, else a reference profile shipped in ``calibration/`` for the same model, slots, cache mode and
    link (measured on another machine: a warning says so); None when there is none. A profile whose recorded fit
    quality is poor, or that was never assessed (version 1), is used with a warning (see ``warn_if_unreliable``)."""
    runtime = model.specfit
    if runtime.cost_model is not None:
        cost = checked_cost_model(model, runtime.cost_model)
        warn_if_unreliable(cost, str(runtime.cost_model) if not isinstance(runtime.cost_model, CostModel)
                           else "in use by this model")
        return cost
    key = profile_key(model)
    path = profile_path(**key)
    if path.is_file():
        found = CostModel.load(path, expect={"slots": key["slots"], "cache_mode": key["cache_mode"]})
        warn_if_unreliable(found, str(path))
        return found
    reference = reference_profile(key, runtime.link_label)
    if reference is not None and reference.meta.get("device") != key["device_name"]:
        warnings.warn(f"using the reference cost profile measured on {reference.meta.get('device')!r} for this "
                      f"{key['device_name']!r}; run `specfit calibrate` to fit this machine", RuntimeWarning,
                      stacklevel=4)
    if reference is not None:
        warn_if_unreliable(reference, f"shipped with specfit for {key['model_id']}, {key['slots']} slots, "
                                      f"{key['cache_mode']}, {runtime.link_label}")
    return reference


def warn_if_unreliable(cost: CostModel, where: str) -> None:
    """Warn (RuntimeWarning) when a cost model's recorded calibration verdict is not "good": "poor" (installed with
    ``--force``) or "unassessed" (a version-1 profile). A model with no recorded quality (made by hand) is trusted."""
    quality = cost.quality
    if not quality or quality.get("verdict") == "good":
        return
    reasons = "; ".join(quality.get("reasons", [])) or "no reasons recorded"
    if quality.get("verdict") == "poor":
        text = (f"the cost profile {where} failed calibration's quality gate ({reasons}), so SpecFit may verify "
                f"poor subtrees. Recalibrate: {REMEDY}.")
    else:
        text = (f"the cost profile {where} was never checked for fit quality ({reasons}). Recalibrate with "
                f"`specfit calibrate` to fit and check it.")
    warnings.warn(text, RuntimeWarning, stacklevel=4)


def model_id(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or
               type(model).__name__)


def reference_profile(key: dict, link_label: str):
    """A profile shipped in ``calibration/`` (package ``specfit.calibration``) for the same model, slots, cache mode
    and link, preferring one measured on this very device."""
    matches = []
    for entry in files("specfit.calibration").iterdir():
        if not entry.name.endswith(".json"):
            continue
        data = json.loads(entry.read_text())
        if data.get("format") != FORMAT:
            continue
        if (data.get("model_id"), data.get("slots"), data.get("cache_mode"), data.get("link")) == \
                (key["model_id"], key["slots"], key["cache_mode"], link_label):
            matches.append((data.get("device") != key["device_name"], entry.name, entry))
    if not matches:
        return None
    with as_file(min(matches)[2]) as path:
        return CostModel.load(path)
