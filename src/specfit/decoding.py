"""Decoding parts that ``enable`` attaches: the drafter, the capture of its target features, the decoding options,
the route source and the cost model."""

from __future__ import annotations

import platform
import warnings
from dataclasses import dataclass, replace

import torch

from . import seam


@dataclass(frozen=True)
class DecodingOptions:
    """Draft pool and selection settings; defaults are the paper's."""

    topk: int = 2  # children per expanded node, and nodes expanded per level
    depth: int = 5  # deepest draft level
    pool_nodes: int = 18  # draft pool node budget
    max_nodes: int = 7  # draft nodes verified per cycle at most (EAGLE-3 verifies exactly this many)
    route_source: str = "oracle"  # where SpecFit's selector gets draft-node routes (see route_sources.py)
    prefetch: bool = False  # copy the current winner's (predicted) experts while the next level is drafted
    cost: str = "paper"  # "paper": beta per expert of demand; "cache-aware": resident experts cost nothing

    def __post_init__(self):
        from .route_sources import ROUTE_SOURCES

        if self.route_source not in ROUTE_SOURCES:
            raise ValueError(f"unknown route_source {self.route_source!r}; registered: {sorted(ROUTE_SOURCES)}")
        if self.cost not in ("paper", "cache-aware"):
            raise ValueError(f"cost must be 'paper' or 'cache-aware', got {self.cost!r}")
        for name in ("topk", "depth", "pool_nodes", "max_nodes"):
            value, low = getattr(self, name), 0 if name == "max_nodes" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {self.prefetch!r}")


class AuxCapture:
    """Forward hooks on the target's decoder layers that keep the outputs the drafter fuses (low, mid, high).
    ``paused()`` true: forwards leave the kept outputs alone (the route oracle's must not overwrite verified ones)."""

    def __init__(self, model, layer_ids, paused=lambda: False):
        layers = seam.decoder_layers(model)
        for i in layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(f"drafter aux layer id {i} is outside the target's {len(layers)} layers")
        self.paused = paused
        self.layer_ids = tuple(layer_ids)
        self.outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.handles = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(layer_ids)]

    def _hook(self, j):
        def hook(module, args, output):
            if not self.paused():
                self.outputs[j] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self) -> torch.Tensor:
        """[1, T, 3H] features of the last forward's tokens (low, mid, high)."""
        return torch.cat(self.outputs, dim=-1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def attach_decoding(model, drafter=None, cost_model=None, route_predictor=None, **options) -> None:
    runtime = model.specfit
    runtime.options = _checked(runtime, DecodingOptions(**options))
    runtime.cost_model = cost_model
    if drafter is not None:
        set_drafter(model, drafter)
    if route_predictor is not None:
        from .route_predictor import RoutePredictor

        runtime.route_predictor = route_predictor if isinstance(route_predictor, torch.nn.Module) else \
            RoutePredictor.load(route_predictor, model)


def _checked(runtime, options: DecodingOptions) -> DecodingOptions:
    """Options that depend on how the model was enabled."""
    if options.prefetch and runtime.config.cache_mode == "cleared":
        raise ValueError("prefetch=True needs cache_mode='cached': a cleared cache drops prefetched experts")
    return options


def set_drafter(model, drafter) -> None:
    """Attach an EAGLE-3 drafter (module, or checkpoint folder checked against the target at load)."""
    from .drafter_io import load_drafter

    runtime = model.specfit
    if runtime.aux_capture is not None:
        runtime.aux_capture.remove()
    if not isinstance(drafter, torch.nn.Module):
        from pathlib import Path

        from .route_predictor import CONFIG, RoutePredictor

        folder = Path(drafter)
        drafter = load_drafter(folder, target=model)
        if (folder / CONFIG).is_file():  # a route predictor saved beside the drafter
            runtime.route_predictor = RoutePredictor.load(folder, model)
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


def configure(model, **options) -> DecodingOptions:
    """Change decoding options on an enabled model, e.g. ``configure(model, max_nodes=5)``."""
    runtime = model.specfit
    runtime.options = _checked(runtime, replace(runtime.options, **options))
    return runtime.options


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
    from .cost_model import CostModel, profile_path

    warnings.warn(
        f"no calibrated cost profile for device {key['device_name']!r}, model {key['model_id']!r}, "
        f"{key['slots']} slots, cache mode {key['cache_mode']!r} (looked for {profile_path(**key)}): SpecFit uses "
        f"the default cost model (the paper's A100 beta), which can pick poor subtrees here. Run `specfit calibrate`.",
        RuntimeWarning, stacklevel=3)
    return CostModel.default(runtime.options.max_nodes)


def profile_key(model) -> dict:
    runtime = model.specfit
    return dict(device_name=device_name(runtime), model_id=model_id(model), slots=runtime.config.cache_slots,
                cache_mode=runtime.config.cache_mode)


def find_profile(model):
    """The explicit profile given to ``enable`` (checked against this setup), else this machine's calibrated profile
    in the user cache, else a reference profile shipped in ``calibration/`` for the same model, slots, cache mode and
    link (measured on another machine: a warning says so); None when there is none."""
    from .cost_model import CostModel, ProfileError, profile_path

    runtime = model.specfit
    cm = runtime.cost_model
    if isinstance(cm, CostModel):
        return cm
    if cm is not None:  # an explicit profile: the setup fields it records must match this model
        loaded = CostModel.load(cm)
        for field, want in (("slots", runtime.config.cache_slots), ("cache_mode", runtime.config.cache_mode)):
            if field in loaded.meta and loaded.meta[field] != want:
                raise ProfileError(f"{cm}: field {field!r} is {loaded.meta[field]!r}, expected {want!r}")
        return loaded
    key = profile_key(model)
    path = profile_path(**key)
    if path.is_file():
        return CostModel.load(path, expect={"slots": key["slots"], "cache_mode": key["cache_mode"]})
    reference = reference_profile(key, runtime.link_label)
    if reference is not None and reference.meta.get("device") != key["device_name"]:
        warnings.warn(f"using the reference cost profile measured on {reference.meta.get('device')!r} for this "
                      f"{key['device_name']!r}; run `specfit calibrate` to fit this machine", RuntimeWarning,
                      stacklevel=4)
    return reference


def model_id(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or
               type(model).__name__)


def reference_profile(key: dict, link_label: str):
    """A profile shipped in ``calibration/`` (package ``specfit.calibration``) for the same model, slots, cache mode
    and link, preferring one measured on this very device."""
    import json
    from importlib.resources import as_file, files

    from .cost_model import FORMAT, CostModel

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
