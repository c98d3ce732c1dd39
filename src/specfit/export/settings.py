"""The SpecFit settings an exported folder carries (``custom_generate/specfit.json``): what ``specfit.enable`` is given
when the folder's ``generate`` first runs, and the assistant it decodes with. Pure Python: JSON in, JSON out.

The file is small and meant to be read (and edited) by hand, so reading it checks every key: an unknown key, a
missing one or a value of the wrong kind is refused naming the file, the key and what would be right. The values'
own rules (a slot count against the model's experts, a policy's name, ...) are ``specfit.enable``'s, checked when it
runs, before it touches the model.
"""

from __future__ import annotations

import json
from pathlib import Path

SETTINGS_FILE = "custom_generate/specfit.json"
DRAFTER_DIR = "drafter"  # the drafter's folder inside an exported folder
FORMAT, VERSION = "specfit-export", 1
ASSISTANTS = ("specfit", "eagle3", "none")  # "none": plain decoding, the experts still offloaded
DECODING = ("depth", "max_nodes", "topk")  # the decoding options the command takes (``DecodingOptions``)

# key -> (the kinds it takes, what it means): written by ``build``, checked by ``check``
KEYS = {
    "format": ((str,), f"{FORMAT!r}"),
    "version": ((int,), f"{VERSION}"),
    "specfit": ((str,), "the specfit version that wrote the folder"),
    "cache_slots": ((int,), "expert slots per MoE layer on the device"),
    "cache_mode": ((str,), "'cached' or 'cleared'"),
    "cache_policy": ((str,), "which expert a miss evicts, e.g. 'forecast'"),
    "cold": ((str, type(None)), "'copy', 'host', 'auto' or null (SpecFit's default for the device)"),
    "link_ms": ((int, float, type(None)), "an emulated link's milliseconds per expert copy (CPU only) or null"),
    "assistant": ((str,), f"one of {', '.join(ASSISTANTS)}"),
    "drafter": ((str, type(None)), f"the drafter's folder inside this one ({DRAFTER_DIR!r}) or null"),
    "decoding": ((dict,), f"decoding options, of {', '.join(DECODING)}"),
    "embedded": ((bool,), "whether the folder holds SpecFit's embedded model (its cost profile is used)"),
    "source": ((str,), "the model the folder was exported from (a folder's name, or a Hub id)"),
    "base_model": ((str, type(None)), "the Hub id of the model, for the card's base_model, or null"),
}


def build(*, cache_slots: int, cache_mode: str, cache_policy: str, cold: str | None, link_ms: float | None,
          assistant: str, drafter: bool, decoding: dict, embedded: bool, source: str,
          base_model: str | None = None) -> dict:
    """The settings of a folder being exported (checked as ``read`` checks them)."""
    from .. import __version__

    settings = dict(format=FORMAT, version=VERSION, specfit=__version__, cache_slots=cache_slots,
                    cache_mode=cache_mode, cache_policy=cache_policy, cold=cold,
                    link_ms=None if not link_ms else float(link_ms), assistant=assistant,
                    drafter=DRAFTER_DIR if drafter else None,
                    decoding={k: v for k, v in decoding.items() if v is not None}, embedded=embedded, source=source,
                    base_model=base_model)
    check(settings, "the export's settings")
    return settings


def write(folder: Path, settings: dict) -> Path:
    path = folder / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")
    return path


def read(path: Path) -> dict:
    """The settings in ``path`` (a folder's ``custom_generate/specfit.json``), checked."""
    try:
        settings = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or err}); export the folder again with "
                         f"`specfit export OUT`") from None
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err}); export the folder again with `specfit export OUT`") from None
    check(settings, str(path))
    return settings


def check(settings, where: str) -> None:
    """Every key of ``settings`` present, known and of its kind; ``where`` names the file in the refusal."""
    again = "export the folder again with `specfit export OUT`, or correct the file"
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: holds {type(settings).__name__}, not a JSON object of SpecFit settings; {again}")
    if settings.get("format") != FORMAT:
        raise ValueError(f"{where}: format {settings.get('format')!r}, expected {FORMAT!r} (not a file "
                         f"`specfit export` wrote); {again}")
    if settings.get("version") != VERSION:
        raise ValueError(f"{where}: version {settings.get('version')!r}; this specfit reads version {VERSION}: "
                         f"{again} (or install the specfit it names: {settings.get('specfit')!r})")
    unknown = sorted(set(settings) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                         f"the keys are {', '.join(KEYS)}")
    for key, (kinds, meaning) in KEYS.items():
        if key not in settings:
            raise ValueError(f"{where}: no {key!r} ({meaning}); {again}")
        value = settings[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"{where}: {key!r} is {value!r}; it takes {meaning}")
    if settings["assistant"] not in ASSISTANTS:
        raise ValueError(f"{where}: 'assistant' is {settings['assistant']!r}; it takes one of {', '.join(ASSISTANTS)}")
    if settings["assistant"] != "none" and settings["drafter"] is None:
        raise ValueError(f"{where}: 'assistant' {settings['assistant']!r} needs a drafter, and 'drafter' is null; "
                         f"{again} with its --drafter, or set 'assistant' to 'none'")
    wrong = sorted(set(settings["decoding"]) - set(DECODING))
    if wrong:
        raise ValueError(f"{where}: 'decoding' has {', '.join(map(repr, wrong))}; it takes {', '.join(DECODING)}")


def enable_kwargs(settings: dict, folder: Path) -> dict:
    """What ``specfit.enable`` is given for ``settings`` of the folder at ``folder`` (the emulated link in seconds
    per copy; the drafter's folder as a path)."""
    kwargs = dict(cache_slots=settings["cache_slots"], cache_mode=settings["cache_mode"],
                  cache_policy=settings["cache_policy"], **settings["decoding"])
    if settings["cold"] is not None:
        kwargs["cold"] = settings["cold"]
    if settings["link_ms"]:
        kwargs["link"] = settings["link_ms"] / 1e3
    if settings["drafter"] is not None:
        kwargs["drafter"] = str(folder / settings["drafter"])
    return kwargs


def assistant(settings: dict) -> str | None:
    """The assistant ``generate()`` runs when the call names none (None: plain decoding)."""
    return None if settings["assistant"] == "none" else settings["assistant"]
