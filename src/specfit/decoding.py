"""Decoding parts attached by ``enable``: the drafter, its target-feature capture, and the decoding options."""

from __future__ import annotations


def attach_decoding(model, drafter=None, **options) -> None:
    if options:
        raise TypeError(f"unknown SpecFit options: {sorted(options)}")
    model.specfit.drafter = drafter


def detach_decoding(model) -> None:
    model.specfit.drafter = None
