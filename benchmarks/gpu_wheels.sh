#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, into .whl/ (then carry ".whl" to the device): a thin entry for
# `python3 tests/gpu/gpu_check.py --wheels`, which reads what to fetch from the wheels' own metadata.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tests/gpu/gpu_check.py --wheels "$@"
