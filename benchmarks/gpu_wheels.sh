#!/usr/bin/env bash
# Fetch, on a machine with PyPI access, the wheels the GPU machine's image lacks, into .whl/ at the repository root.
#
#   bash benchmarks/gpu_wheels.sh            # then carry ".whl" to the device and run benchmarks/gpu_check.sh there
#
# The GPU image (Python 3.12, torch 2.11+cu130) ships transformers 5.17; SpecFit needs >= 5.24. Against the image's
# versions, transformers 5.24.0 needs nothing else new except, possibly, regex >= 2025.10.22 (its import-time version
# check; the image's regex version is not recorded), so regex is carried too, and platformdirs (SpecFit's cache
# folder; not in the image's package list). huggingface-hub (image 1.33.0, needs
# >= 1.31), tokenizers (0.23.2, needs 0.23.x), safetensors (0.8.0), accelerate (1.15.0), numpy, pyyaml, tqdm, typer
# and packaging are there. One version of each, --no-deps; .whl/ is added to .git/info/exclude so it is never
# committed. Override the versions with TRANSFORMERS_VERSION / REGEX_VERSION, the interpreter with PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-5.24.0}
REGEX_VERSION=${REGEX_VERSION:-2026.11.19}
PLATFORMDIRS_VERSION=${PLATFORMDIRS_VERSION:-4.14.9}
DEST=.whl
LIMIT_MB=48  # the device call carries at most 64 MiB: wheels + the working tree

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
"$PYTHON" -m pip --version >/dev/null 2>&1 || { echo "gpu_wheels.sh: $PYTHON has no pip; set PYTHON=..." >&2; exit 1; }

if [ -d .git ] && ! grep -qxF '/.whl/' .git/info/exclude 2>/dev/null; then
    mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude
fi
rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" \
    "transformers==$TRANSFORMERS_VERSION" "regex==$REGEX_VERSION" "platformdirs==$PLATFORMDIRS_VERSION"

ls -l "$DEST"
total=$(du -cb "$DEST"/*.whl | tail -n1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard 2>/dev/null | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "wheels: $(ls "$DEST" | wc -l) files, $(mib "$total"); with the working tree that travels ($(mib "${tree:-0}")):" \
     "$(mib $((total + ${tree:-0}))) of the 64 MiB a device call carries"
if [ "$total" -gt $((LIMIT_MB * 1024 * 1024)) ]; then
    echo "gpu_wheels.sh: the wheels exceed ${LIMIT_MB} MiB; the device call carries 64 MiB in all" >&2
    exit 1
fi
