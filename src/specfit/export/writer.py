"""Writes an exported folder: the target's files (its weights hard-linked where the file system allows, else copied),
the drafter's, ``custom_generate/`` (the template's ``generate.py``, a ``requirements.txt`` naming specfit, the
settings file) and a model card. The folder is written beside OUT under a scratch name and renamed to OUT at the
end, so a failure leaves no half-written OUT behind.

Only weight files are linked: a hard link shares the file with the source, and weights are never edited in place,
while a config or tokenizer file in OUT may be, which must not change the source's."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from . import settings as export_settings
from .card import card

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TEMPLATE = ("generate.py",)  # the files of the template folder, copied into OUT/custom_generate
SKIPPED = ("README.md",)  # the source's card: OUT gets its own (card.py), which points to the base model


@dataclass(frozen=True)
class Written:
    """One file of the export: its path inside OUT, its size, and how it got there ('linked' or 'copied'), with why a
    weight file could not be linked."""

    name: str
    size: int
    how: str
    why: str = ""


def is_weights(path: Path) -> bool:
    return path.name.endswith(WEIGHT_SUFFIXES)


def place(source: Path, target: Path) -> Written:
    """``source`` at ``target``: a weight file hard-linked (copied where the file system refuses a link: another
    file system, links not allowed), any other file copied."""
    size = source.stat().st_size
    if is_weights(source):
        try:
            os.link(source, target)
            return Written(target.name, size, "linked")
        except OSError as err:
            why = {errno.EXDEV: "another file system"}.get(err.errno, err.strerror or type(err).__name__)
            shutil.copyfile(source, target)
            return Written(target.name, size, "copied", why)
    shutil.copyfile(source, target)
    return Written(target.name, size, "copied")


def requirements() -> str:
    """``custom_generate/requirements.txt``: transformers checks it when the folder loads (it installs nothing)."""
    from .. import __version__

    return f"specfit>={__version__}\n"


def template_text(name: str) -> str:
    return (files("specfit.export") / "custom_generate" / name).read_text(encoding="utf-8")


def export_folder(out: Path, model_dir: Path, drafter_dir: Path | None, settings: dict) -> list[Written]:
    """Write the folder ``out`` (absent or empty: checked before) from the checkpoint folder ``model_dir`` and the
    drafter folder ``drafter_dir`` (None: none) with ``settings`` (``settings.build``); returns what was written."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        written = [place(f, scratch / f.name) for f in sorted(model_dir.iterdir())
                   if f.is_file() and f.name not in SKIPPED]
        if drafter_dir is not None:
            (scratch / export_settings.DRAFTER_DIR).mkdir()
            for f in sorted(drafter_dir.iterdir()):
                if f.is_file():
                    done = place(f, scratch / export_settings.DRAFTER_DIR / f.name)
                    written.append(Written(f"{export_settings.DRAFTER_DIR}/{f.name}", done.size, done.how, done.why))
        code = scratch / "custom_generate"
        code.mkdir()
        for name in TEMPLATE:
            (code / name).write_text(template_text(name), encoding="utf-8")
        (code / "requirements.txt").write_text(requirements())
        export_settings.write(scratch, settings)
        (scratch / "README.md").write_text(card(settings, model_dir), encoding="utf-8")
        scratch.chmod(0o777 & ~_umask())  # mkdtemp made it private; OUT is an ordinary folder
        if out.is_dir():
            out.rmdir()  # empty (checked before): replaced by the finished folder
        scratch.rename(out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def summary(written: list[Written]) -> list[str]:
    """Lines saying which weight files were linked to the source and which copied (and why)."""
    lines = []
    for w in written:
        if not is_weights(Path(w.name)):
            continue
        size = f"{w.size / 2**20:.1f} MiB"
        if w.how == "linked":
            lines.append(f"  {w.name} ({size}): hard-linked, no copy (shares the file with the source)")
        else:
            lines.append(f"  {w.name} ({size}): copied (a hard link was refused: {w.why})")
    copied = sum(w.size for w in written if w.how == "copied")
    lines.append(f"  other files copied: {sum(1 for w in written if not is_weights(Path(w.name)))}; "
                 f"{copied / 2**20:.1f} MiB written in all")
    return lines
