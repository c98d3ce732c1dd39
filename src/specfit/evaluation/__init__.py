"""Measuring on this machine: datasets, the side-by-side harness, ``specfit demo``, ``specfit bench`` and
``specfit calibrate``. The top layer, beside ``training`` and ``embedded``."""
