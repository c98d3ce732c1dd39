#!/usr/bin/env bash
# Re-measure the reference cost profiles shipped for the embedded model (CPU, 1 thread): the slot counts that
# `specfit bench` sweeps (24 / 12 / 6 of 64, and none = cleared before every forward), without and with the
# emulated host link that the demo and the bench use. Run from the repository root on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
LINK_MS=$(python -c "from specfit.evaluation.harness import EMBEDDED_LINK_S; print(EMBEDDED_LINK_S * 1e3)")
for regime in nolink link; do
  extra=(); [ "$regime" = link ] && extra=(--link-ms "$LINK_MS")
  for slots in 24 12 6; do
    specfit calibrate --slots "$slots" --threads 1 "${extra[@]}" --out "calibration/embedded-slots${slots}-cached-${regime}.json"
  done
  specfit calibrate --slots 64 --cache-mode cleared --threads 1 "${extra[@]}" --out "calibration/embedded-cleared-${regime}.json"
done
rm -f calibration/embedded-*.png
