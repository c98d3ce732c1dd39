#!/usr/bin/env bash
# Re-measure the reference cost profiles shipped for the embedded model and its FP8 variant (CPU, 1 thread). One profile per machine and
# model prices every slot count, cache mode and link (cost model version 3): the probes run at the default 24 of 64
# slots, their replays alternate between no link and the embedded model's structural default link (a token's expert
# copies cost 1.4x its compute, measured here), so a copy's overhead and the share of the link's time it waits for
# are measured apart; then host-lane rounds compute every cold expert on the structural default host lane (2.5x the
# link's bandwidth) and on the same lane at half its bandwidth, so a host expert's overhead and share are measured
# apart too. Run from the repository root on an otherwise idle machine.
# A fit that fails calibrate's quality gate is not written (the old profile stays) and the script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
specfit calibrate --threads 1 --out calibration/embedded.json "$@"
specfit calibrate --fp8 --threads 1 --out calibration/embedded-fp8.json "$@"  # the FP8 variant: a model of its own
rm -f calibration/embedded*.png calibration/embedded*.rejected
