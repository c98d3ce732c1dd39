"""Where the exported folder of a loaded model is: transformers copies ``custom_generate/generate.py`` into its
modules cache and runs it from there, so the folder (its settings file and drafter) is found from the model itself,
``model.name_or_path``: a local folder as given to ``from_pretrained``, or a Hub repo id, whose settings file and
drafter are fetched through ``huggingface_hub`` (its cache; offline with ``HF_HUB_OFFLINE=1``) at the revision the
model's files came from."""

from __future__ import annotations

import re
from pathlib import Path

from .settings import DRAFTER_DIR, SETTINGS_FILE

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LOAD = "AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True) on a folder `specfit export` wrote"


def model_source(model) -> str:
    """The folder or Hub id ``model`` was loaded from, as ``from_pretrained`` was given it."""
    return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")


def exported_folder(model) -> Path:
    """The local folder holding the settings file (and drafter) of the exported folder ``model`` was loaded from."""
    source = model_source(model)
    path = Path(source).expanduser() if source else None
    if path is not None and path.is_dir():
        if not (path / SETTINGS_FILE).is_file():
            raise ValueError(f"this generate() is SpecFit's (an exported folder's custom_generate), but {source!r}, "
                             f"where the model was loaded from, holds no {SETTINGS_FILE}: load it with {LOAD}")
        return path.resolve()
    if not HUB_ID.match(source):
        raise ValueError(f"this generate() is SpecFit's (an exported folder's custom_generate), but the model's "
                         f"source {source!r} is neither a folder nor a Hub repo id, so its SpecFit settings cannot be "
                         f"found: load it with {LOAD}")
    from huggingface_hub import snapshot_download

    revision = getattr(model.config, "_commit_hash", None)
    try:
        local = Path(snapshot_download(source, revision=revision, allow_patterns=[SETTINGS_FILE, f"{DRAFTER_DIR}/*"]))
    except Exception as err:  # offline and not cached, no such repo, no network: what and what to do
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"the Hub repo {source!r} (revision {revision or 'main'}): its {SETTINGS_FILE} and "
                         f"{DRAFTER_DIR}/ could not be fetched ({type(err).__name__}: {first}); check the network, "
                         f"or download the repo and load its folder") from None
    if not (local / SETTINGS_FILE).is_file():
        raise ValueError(f"the Hub repo {source!r} holds no {SETTINGS_FILE}: it is not a folder `specfit export` "
                         f"wrote (push the whole exported folder: docs/export.md)")
    return local
