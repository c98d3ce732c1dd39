"""The one place that chooses the seam between transformers' serving stack and SpecFit's engine, by the installed
release: ``seam_524`` (5.24: handlers over a generation manager, the model in this process) or ``seam_525`` (5.25:
handlers over an engine client, an in-process engine in place of the model's process). On any other release, or one
missing a name its seam needs, importing this module raises an ImportError that names the installed version and the
pip command."""

from __future__ import annotations

from importlib import import_module

import transformers

from .releases import SUPPORTED, minor, unsupported


def select(version: str):
    name = SUPPORTED.get(minor(version))
    if name is None:
        raise unsupported(version)
    module = import_module(f"{__package__}.{name}")
    module.require()  # its release's names, imported now
    return module


SEAM = select(transformers.__version__)
