"""The ``generate`` an exported folder's ``custom_generate/generate.py`` calls: transformers installs it as
``model.generate`` when the folder loads with ``trust_remote_code=True`` (``functools.partial(generate, model=model)``:
the call's arguments arrive as they were given to ``model.generate``, plus ``model=``).

At the first call SpecFit is enabled on the model the stock loader placed, on its device, with the folder's settings
(``settings.py``): the experts move to SpecFit's host store, the drafter is loaded, and ``model.specfit`` (with its
``stats``) exists from then on. Each call then runs SpecFit's ``generate()`` with the folder's assistant unless the
call names one (``assistant=None`` or ``"none"``: transformers' own decoding, the experts still offloaded; by keyword,
or as a field of the generation config passed, as a served request's ``generation_config`` JSON sets it). It takes every
argument ``generate()`` takes, the ones stock ``transformers serve`` passes included (``streamer``,
``stopping_criteria``, ``tokenizer``, a ``generation_config``, sampling settings); what SpecFit cannot do is refused
before any work, naming what to pass instead.

``SPECFIT_STATS_LOG=FILE`` appends one JSON line per call to FILE (the method it ran and the call's counters): stock
``transformers serve`` runs the model in a process of its own and has no route for SpecFit's counters.
"""

from __future__ import annotations

import json
import os
import threading
import weakref

from . import settings as export_settings
from .location import exported_folder, model_source
from .streamer import TokenByToken

STATS_LOG = "SPECFIT_STATS_LOG"
_UNSET = object()
_enabling = threading.Lock()  # two threads' first calls enable once
_folders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (folder, settings), read once


def generate(*args, model, **kwargs):
    """``model.generate(*args, **kwargs)`` with SpecFit, enabled at the first call (see the module docstring)."""
    folder, settings = _settings_of(model)
    named_assistant = kwargs.pop("assistant", _UNSET)
    if named_assistant is _UNSET:  # a generation config's own field (transformers serve 5.24 builds one per request)
        named_assistant = getattr(_passed_config(args, kwargs), "assistant", _UNSET)
    assistant = export_settings.assistant(settings) if named_assistant is _UNSET else named_assistant
    if assistant == "none":  # as the command line spells plain decoding (a request's JSON: 5.25 drops nulls)
        assistant = None
    if assistant is not None and named_assistant is _UNSET:
        _check_method(model, args, kwargs, settings, folder)
    if getattr(model, "specfit", None) is None:
        with _enabling:
            if getattr(model, "specfit", None) is None:
                _enable(model, folder, settings)
    if kwargs.get("streamer") is not None:
        kwargs["streamer"] = TokenByToken(kwargs["streamer"])
    out = type(model).generate(model, *args, assistant=assistant, **kwargs)  # the class's: SpecFit's strategy
    _log(model)
    return out


def _passed_config(args, kwargs):
    """The generation config the call was given (by keyword or in its place among the positional arguments)."""
    from ..decoding.loop import generate_arguments

    return generate_arguments(args, kwargs).get("generation_config")


def _settings_of(model):
    """The folder and settings of ``model``, read at its first call and kept for the model's life (a relative
    folder keeps working after the working directory changes)."""
    known = _folders.get(model)
    if known is None:
        folder = exported_folder(model)
        known = _folders[model] = (folder, export_settings.read(folder / export_settings.SETTINGS_FILE))
    return known


def _check_method(model, args, kwargs, settings, folder) -> None:
    """Before any work: the call must decode greedily or by sampling, the only methods an assistant runs. Another
    method (beam search, contrastive search, prompt lookup, ``assistant_model=``, a ``custom_generate`` of its own)
    is refused, naming ``assistant=None``, which runs it without SpecFit's assistant."""
    from ..decoding.loop import generate_arguments
    from ..decoding.strategy import transformers_method

    named = generate_arguments(args, kwargs)
    method = transformers_method(model, named)
    if method != "ar":
        raise ValueError(f"this model decodes with SpecFit's {settings['assistant']!r} assistant (set in "
                         f"{folder / export_settings.SETTINGS_FILE}), which runs greedy or sampling decoding only; "
                         f"these generate() arguments ask for transformers' {method.replace('_', ' ')}: pass "
                         f"assistant=None to run it without the assistant (the experts stay offloaded)")


def _enable(model, folder, settings) -> None:
    """SpecFit on the model as the stock loader placed it: on its device, every weight in memory there."""
    from .. import embedded
    from ..enable_checks import _cold_mode
    from ..patch import enable

    devices = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()})
    if len(devices) > 1:
        raise ValueError(f"the model was loaded over {devices} (device_map={devices!r}); SpecFit runs every weight "
                         f"but the routed experts on one device: load the folder with device_map='cuda' (or 'cpu', "
                         f"or one device)")
    device = model.get_input_embeddings().weight.device
    if settings["link_ms"] and device.type != "cpu":
        raise ValueError(f"{folder / export_settings.SETTINGS_FILE}: 'link_ms' {settings['link_ms']} emulates a host "
                         f"link for CPU studies, and the model is on {device}, where the copies are real: set it to "
                         f"null, or export the folder again without --link-ms")
    try:
        _cold_mode(settings["cold"], None, device, None)
    except ValueError as err:  # 'host' or 'auto' on a CPU: the folder cannot give it an emulated host lane
        raise ValueError(f"{folder / export_settings.SETTINGS_FILE}: 'cold' {settings['cold']!r} cannot run on "
                         f"{device} ({str(err).split(':')[0]}): set it to 'copy' or null, or load the model on "
                         f"CUDA, where the host CPU computes cold experts") from None
    named = model.config._name_or_path
    if settings["embedded"]:  # named as specfit.embedded.load names it, so its cost profiles are found
        model.config._name_or_path = embedded.MODEL_ID
    try:
        enable(model, **export_settings.enable_kwargs(settings, folder))
    except BaseException:
        model.config._name_or_path = named
        raise
    if settings["embedded"]:
        model.specfit.calibrate_command = embedded.calibrate_command(False, model.get_input_embeddings().weight.dtype)


def _log(model) -> None:
    """One JSON line per call in ``$SPECFIT_STATS_LOG`` (when set): the method and the call's counters."""
    path = os.environ.get(STATS_LOG)
    if not path:
        return
    stats = model.specfit.stats
    line = dict(source=model_source(model), method=stats.last_method, **stats.last_generate.as_dict())
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, default=str) + "\n")
