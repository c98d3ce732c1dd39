"""Calibration data shipped with SpecFit: the probe definition (``probes.json``), reference profiles for the
embedded model, and the paper's published coefficients (``paper_reference.json``, reference points only).

``PROBES`` is the probe definition, read here (json only, no torch) so that ``specfit calibrate`` shows and checks
its defaults before anything heavy is imported."""

import json
from importlib.resources import files

PROBES = json.loads(files(__name__).joinpath("probes.json").read_text())
# the least each count of `specfit calibrate` may be: probes for a 5-fold cross-validation whose every fit has a record
# more than it has coefficients (up to 8 intercepts at the default max_nodes 7, and two slopes), even on one link (a
# GPU, or a CPU without an emulated link; evaluation/probes.py checks the exact count for the links at hand); bootstrap refits for percentile intervals (selection/fit_quality.py refuses
# fewer); tokens per prompt for at least one cycle after the warm-up cycles
LEAST = {"probes": 13, "repeats": 1, "bootstrap": 20, "num_prompts": 1,
         "max_new_tokens": PROBES["warmup_cycles"] + 1}
