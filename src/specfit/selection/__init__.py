"""Stage 3, selection: the SpecFit rule (exact subtree search, pure), the cost model and its profiles, and where the
routes of draft nodes come from (the oracle, the target's gates, a trained predictor). Depends on ``seam``,
``offload`` and ``drafting``."""
