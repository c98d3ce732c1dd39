"""The CPU/GPU speed factor for a CPU run of the GPU check on the CUDA stand-in (``SPECFIT_CUDA_STANDIN=1``).

The device's stage limits (``benchmarks/gpu_check.sh``) were sized on the device's decode cycle at the check's real
shapes: 40-70 ms per cycle (review 5's estimate from the calibrate and decode stages; ``DEVICE_CYCLE_MS`` takes the
midpoint, 55 ms). A CPU run of part 2 decodes the ``tiny`` preset on the stand-in instead. This script measures that
CPU's decode cycle (the median of timed one-token forwards of the preset, enabled on the stand-in, its slots cycling:
warm copies, misses, the host lane) and prints

    factor = CPU ms per cycle / DEVICE_CYCLE_MS

and the scale the check applies to every stage limit: max(1, factor) (a CPU faster per cycle than the device keeps
the device's own limits; a slower one gets them stretched by exactly its measured slowness, never more). The last line
printed is the scale alone, for the script to read.

    SPECFIT_CUDA_STANDIN=1 python benchmarks/speed_factor.py [--preset tiny] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

DEVICE_CYCLE_MS = 55.0  # the device's decode cycle at the check's real shapes (review 5: 40-70 ms)


def measure(preset: str = "tiny", dtype: str = "bfloat16", forwards: int = 24) -> float:
    """Median milliseconds of a one-token forward of ``preset`` (random weights) enabled on the stand-in, 12 slots."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import synthetic_checkpoint as sc

    import specfit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{k: v for k, v in sc.PRESETS[preset].items() if k != "draft_vocab_size"})
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).eval()
    model = specfit.enable(model, cache_slots=12)
    ids = torch.randint(2, config.vocab_size, (1, forwards + 4), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)  # the stand-in's device (a GPU's, on CUDA): a forward takes its inputs there
    times = []
    with torch.no_grad():
        for i in range(ids.shape[1]):
            t0 = time.perf_counter()
            model(ids[:, i:i + 1])  # each a new token: its own routes, so the slots cycle
            times.append(time.perf_counter() - t0)
    return statistics.median(times[4:]) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if os.environ.get("SPECFIT_CUDA_STANDIN") != "1":
        print("FAIL: the speed factor is for a run on the CUDA stand-in: set SPECFIT_CUDA_STANDIN=1")
        return 2
    cpu_ms = measure(args.preset, args.dtype)
    factor = cpu_ms / DEVICE_CYCLE_MS
    scale = max(1.0, factor)
    print(f"RESULT speed factor: {factor:.3f} (this CPU's decode cycle on the stand-in, {args.preset} preset, "
          f"{cpu_ms:.2f} ms, over the device's {DEVICE_CYCLE_MS:g} ms at real shapes); stage limits x {scale:.3f}")
    print(f"{scale:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
