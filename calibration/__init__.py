"""Calibration data shipped with SpecFit: the probe definition (``probes.json``), reference profiles for the
embedded model, and the paper's published coefficients (``paper_reference.json``, reference points only)."""
