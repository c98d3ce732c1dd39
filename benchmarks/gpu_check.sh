#!/usr/bin/env bash
# SpecFit's prepared GPU check: its three parts in one device call (or a part at once after another, on the warm
# machine), inside the 600 s a command may run, with start-up and a rerun of the part most likely to fail (part 3)
# inside 12 of the 15 device-minutes; one log, and a summary whose RESULT lines say in one place what passed, what
# failed and why.
#
# usage: bash benchmarks/gpu_check.sh [--dry-run] [--part 1|2|3] [--stages LIST] [OUT_DIR]
#
#   OUT_DIR     where the log (gpu_check.log, or gpu_check-partN.log with --part) and the JSON results go;
#               default: $OUT
#   --part      1: env, pytest, bandwidth, host-experts; 2: env, checkpoint, calibrate, decode; 3: env, users (default:
#               all three, one after the other in one call, env once)
#   --stages    comma-separated subset of: env,pytest,bandwidth,host-experts,checkpoint,calibrate,decode,fp8,users (env always
#               runs; calibrate, decode and fp8 need checkpoint). Default: all but fp8, which is optional (FP8=1 adds it)
#   --dry-run   print the settings and the plan: each stage's limit, each part's and both parts' seconds (their limits
#               plus a reserve), the device time with STARTUP seconds of start-up, and the margin left in PLAN_LIMIT
#               (720 s: 12 device-minutes) for one rerun of part 3 at once on the warm machine (and in DEVICE_LIMIT
#               after a fresh start); exits 1 if the call is over COMMAND_LIMIT or the call and its rerun are over
#               PLAN_LIMIT; runs nothing
#   -h, --help  this text
#
# Stages, each under its own time limit (and all under the call's budget):
#   env           package path without network: carried wheels from .whl/ (bash benchmarks/gpu_wheels.sh, run
#                 beforehand where PyPI is reachable) + specfit; FAILS unless every package the run imports is there
#                 (REQUIRED) and the torch found has what SpecFit calls (>= 2.8, a grouped matmul); versions
#                 (transformers >= 5.24), nvidia-smi. If it fails, only the bandwidth stage (torch alone) still runs
#   pytest        SPECFIT_REQUIRE_CUDA=1 pytest -m cuda tests/test_cuda.py tests/test_cuda_lane.py: FAILS unless tests ran
#                 and none skipped
#   bandwidth     benchmarks/gpu_stages.py bandwidth: H2D time of one real-size expert (9,437,184 bytes, bf16) from an
#                 arena pinned by ExpertStore (cudaHostRegister), from a pinned buffer, and from pageable memory, through
#                 the runtime's copy streams; the PCIe generation read while copies run. Every row is measured, then the
#                 stage FAILS unless both pinned rows are page-locked, reach the floor (MIN_H2D_GBPS, else 35 GB/s on
#                 compute capability >= 9.0: an H200 on PCIe 5 gives 50-55) and hand the host back before the copy
#                 lands (issue < half the copy time)
#   host-experts  benchmarks/host_expert_check.py: host ms per Qwen3-30B-A3B expert at 1, 8 and 32 tokens on this
#                 machine's CPU (all cores, bf16 as stored and FP8 dequantized per use) against the measured copy
#                 (figures, issue 36)
#   checkpoint    a synthetic checkpoint with the real Qwen3-30B-A3B per-layer shapes but LAYERS of its 48 layers,
#                 random weights, + a random EAGLE-3 drafter; written under WORK on local disk and deleted at the end
#                 (KEEP=1 keeps it)
#   calibrate     specfit calibrate with SLOTS slots, once (one profile prices every slot count and cache mode), no
#                 plot, --lane-seconds 25 (the host-lane round skipped, said why, when the lane's measured speed says
#                 it would take longer), --force: the fit's verdict (good or poor, with the gate's reasons) is a RESULT figure, and
#                 decode gets the profile either way; FAILS only if calibrate does not finish
#   decode        benchmarks/decode_check.py --reference: the correctness gate (benchmarks/decode_gate.py) FAILS unless
#                 the slot cache (grouped matmuls over SLOTS slots) with the reference's routes replayed gives the
#                 all-resident reference's experts outputs and logits within bf16 tolerance (prefill and a greedy
#                 decode; the router's own disagreements counted apart), the first MoE layer matches transformers' own
#                 experts forward on the stored weights, and AR's, EAGLE-3's and SpecFit's greedy output teacher-forced
#                 through the reference disagrees nowhere its margin is clearly above the step's numeric gap; then
#                 AR, EAGLE-3 and SpecFit (the route source "auto" resolves to, named in the row; the calibrated
#                 profile), each from empty slots, tok/s wall clock, and one more decode per mode under
#                 torch.cuda.set_sync_debug_mode("warn") (stream synchronizes included) plus the host waits it does not
#                 report (event waits, device synchronizes): host syncs per cycle; --require-pinned: FAILS if any expert copy came from pageable
#                 memory
#   fp8           (optional) the synthetic checkpoint's experts quantized block-wise to FP8 (e4m3, 128x128 float32
#                 scales, as Qwen3-30B-A3B-FP8), then decode_check.py --reference on it (AR and SpecFit): FP8 experts
#                 dequantized on the device at real shapes, on any compute capability
#   users         benchmarks/gpu_stages.py users: what users run, on the embedded model (fp32, its tokenizer):
#                 generate() on 2 left-padded rows and one row per assistant, host ids, tokens against plain decoding;
#                 `specfit serve` through the openai client, questions alone (plain) then at once (a batch) and one
#                 streamed, answers against the plain ones; FAILS on any difference
# Stages print figures as soon as they have them (decode: a row per mode; RESULT lines), so a run cut short by its
# time limit still yields numbers.
#
# Environment: LAYERS (6), SLOTS (48), WORK (/tmp/specfit-gpu-check), FP8_BLOCK (128; the tiny preset: 16), STARTUP seconds (150: a fresh machine's start,
# "a minute or more" by the device README, plus the working tree's transfer and the close), COMMAND_LIMIT (600: one
# device call), DEVICE_LIMIT (900: the session's device seconds), PYTHON (python3), KEEP (0), FP8 (0), CAL_ARGS (extra
# calibrate arguments), DECODE_PROMPTS (1), DECODE_TOKENS (16), USERS_TOKENS (16), REQUIRED (the modules the env stage requires),
# MIN_H2D_GBPS (the pinned rows' bandwidth floor; default by the GPU: 35 GB/s at compute capability >= 9.0, else 20, the
# paper's A100 over PCIe 4.0 reached 23.1), PLAN_LIMIT (720: the plan's device seconds with the rerun), LIMIT_SCALE
# (stage limits x this; 2 with ALLOW_CPU=1). To exercise the plumbing on a CPU machine (one thread: several threads on
# a busy 2-core machine made tiny decodes ~70x slower): OMP_NUM_THREADS=1 ALLOW_CPU=1 PRESET=tiny LAYERS=4 SLOTS=12
# DECODE_PROMPTS=1 DECODE_TOKENS=8 bash benchmarks/gpu_check.sh --part 2 DIR (FP8=1 FP8_BLOCK=16: the fp8 stage too).
# STANDIN=1 with it: every CUDA-only branch of the runtime on the CPU stand-in (SPECFIT_CUDA_STANDIN=1: cold="auto",
# the threaded host lane, copy streams and events, pinned staging, registered arenas; --require-pinned), under the
# device's own limits x the measured speed factor (LIMIT_SCALE, printed; tests/test_gpu_check_standin.py)
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

ALL_STAGES="env pytest bandwidth host-experts checkpoint calibrate decode fp8 users"
PART1="env pytest bandwidth host-experts" PART2="env checkpoint calibrate decode fp8" PART3="env users"
DEFAULT_STAGES="env,pytest,bandwidth,host-experts,checkpoint,calibrate,decode,users"
[ "${FP8:-0}" = 1 ] && DEFAULT_STAGES+=",fp8"
OUTDIR="" DRY=0 STAGES="$DEFAULT_STAGES" PART=""
while [ $# -gt 0 ]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY=1; shift ;;
        --part) [ $# -ge 2 ] || { echo "gpu_check.sh: --part needs 1, 2 or 3" >&2; exit 2; }; PART="$2"; shift 2 ;;
        --part=*) PART="${1#*=}"; shift ;;
        --stages) [ $# -ge 2 ] || { echo "gpu_check.sh: --stages needs a value" >&2; exit 2; }; STAGES="$2"; shift 2 ;;
        --stages=*) STAGES="${1#*=}"; shift ;;
        --) shift; [ $# -gt 0 ] && { OUTDIR="$1"; shift; } ;;
        -*) echo "gpu_check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [ -z "$OUTDIR" ] || { echo "gpu_check.sh: one output folder only (got $OUTDIR and $1)" >&2; exit 2; }
           OUTDIR="$1"; shift ;;
    esac
done
[ $# -eq 0 ] || { echo "gpu_check.sh: unexpected arguments: $*" >&2; exit 2; }
OUTDIR="${OUTDIR:-${OUT:-}}"
[ -n "$OUTDIR" ] || { echo "gpu_check.sh: no output folder: pass one, or set OUT" >&2; usage >&2; exit 2; }
for s in ${STAGES//,/ }; do
    [[ " $ALL_STAGES " == *" $s "* ]] || { echo "gpu_check.sh: unknown stage '$s' (stages: $ALL_STAGES)" >&2; exit 2; }
done
case "$PART" in
    "") PARTS="$PART1 ${PART2#env } ${PART3#env }" ;;
    1) PARTS="$PART1" ;;
    2) PARTS="$PART2" ;;
    3) PARTS="$PART3" ;;
    *) echo "gpu_check.sh: --part must be 1, 2 or 3, got '$PART'" >&2; exit 2 ;;
esac
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || { echo "gpu_check.sh: cannot create $OUTDIR" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 2
LOG="$OUTDIR/gpu_check${PART:+-part$PART}.log"

PRESET=${PRESET:-qwen3-30b-a3b}
LAYERS=${LAYERS:-6}
SLOTS=${SLOTS:-48}
WORK=${WORK:-/tmp/specfit-gpu-check}
STARTUP=${STARTUP:-150}
COMMAND_LIMIT=${COMMAND_LIMIT:-600}
DEVICE_LIMIT=${DEVICE_LIMIT:-900}
PLAN_LIMIT=${PLAN_LIMIT:-720}  # the plan (start-up, the call, a rerun of part 3) within 12 of the 15 device-minutes
# every module the run imports beyond torch (specfit's own needs, the CUDA tests', calibrate's and decode's)
export REQUIRED=${REQUIRED:-transformers accelerate safetensors huggingface_hub tokenizers numpy scipy regex tqdm platformdirs packaging pytest}
PY=${PYTHON:-python3}
KEEP=${KEEP:-0}
CAL_ARGS=${CAL_ARGS:-}
DECODE_PROMPTS=${DECODE_PROMPTS:-1}
DECODE_TOKENS=${DECODE_TOKENS:-16}
USERS_TOKENS=${USERS_TOKENS:-16}
[ -n "${MIN_H2D_GBPS:-}" ] && export MIN_H2D_GBPS  # else the floor is chosen by the GPU (gpu_stages.py)
FP8_BLOCK=${FP8_BLOCK:-128}
SITE="$WORK/site"
# seconds per stage. pytest: the CUDA tests took 40-80 s by review 4's estimate; calibrate: load and pin 6 real
# layers, ~280 probe cycles (a link round and a host-lane round after the planning round), the fit, bootstrap (35-55 s
# estimated on the device; no plot)
# users: two loads of the embedded model (this process's, the server's), 8 generate() calls and 9 requests of 16 tokens
declare -A BUDGET=([env]=30 [pytest]=100 [bandwidth]=25 [host-experts]=30 [checkpoint]=45 [calibrate]=70 [decode]=60
                   [fp8]=90 [users]=75)
RESERVE=10  # seconds kept for cleanup and the summary
# a CPU plumbing run (ALLOW_CPU=1) on a shared machine is not the device: its stages get LIMIT_SCALE x their limits
# (default 2 there, 1 elsewhere); the plan (--dry-run) is always the device's
LIMIT_SCALE_GIVEN=${LIMIT_SCALE:-}
LIMIT_SCALE=${LIMIT_SCALE:-$([ "${ALLOW_CPU:-0}" = 1 ] && [ "${STANDIN:-0}" != 1 ] && echo 2 || echo 1)}

minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

wanted() { [[ ",$STAGES," == *",$1,"* ]] && [[ " $PARTS " == *" $1 "* ]]; }

chosen() {  # stages... -> those of them this run takes (env always)
    local s out=()
    for s in "$@"; do
        if [ "$s" = env ] || [[ ",$STAGES," == *",$s,"* ]]; then out+=("$s"); fi
    done
    echo "${out[*]}"
}

estimate() {  # stages... -> seconds: the limits of those wanted (env always) plus the reserve
    local total=$RESERVE s
    for s in "$@"; do
        if [ "$s" = env ] || [[ ",$STAGES," == *",$s,"* ]]; then total=$((total + BUDGET[$s])); fi
    done
    echo "$total"
}
# STANDIN=1 (with ALLOW_CPU=1): the CPU run takes the CUDA runtime's flow on the stand-in (src/specfit/offload/
# standin.py), under the device's own stage limits scaled only by the measured CPU/GPU speed factor
# (benchmarks/speed_factor.py: max(1, this CPU's decode cycle / the device's)), printed in the log and the summary
SPEED_NOTE=""
if [ "${STANDIN:-0}" = 1 ]; then
    [ "${ALLOW_CPU:-0}" = 1 ] || { echo "gpu_check.sh: STANDIN=1 is a CPU run on the CUDA stand-in: set ALLOW_CPU=1" >&2; exit 2; }
    export SPECFIT_CUDA_STANDIN=1
    if [ "$DRY" != 1 ] && [ -z "${LIMIT_SCALE_GIVEN:-}" ]; then
        SPEED_OUT=$(PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 "$PY" benchmarks/speed_factor.py 2>&1) \
            || { echo "$SPEED_OUT" >&2; echo "gpu_check.sh: the speed factor could not be measured" >&2; exit 2; }
        LIMIT_SCALE=$(tail -n 1 <<<"$SPEED_OUT") SPEED_NOTE=$(grep -m1 '^RESULT speed factor' <<<"$SPEED_OUT")
    fi
fi
scaled() { awk -v b="$1" -v s="$LIMIT_SCALE" 'BEGIN { printf "%d", b * s + 0.999 }'; }  # seconds x LIMIT_SCALE
TOTAL_BUDGET=${TOTAL_BUDGET:-$(scaled "$(estimate $PARTS)")}
NAMES=() RESULTS=() SECONDS_USED=() WHY=()

export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export SPECFIT_CACHE="$WORK/specfit-cache"  # profiles go to OUT_DIR explicitly; keep the user cache clean

record() {  # name status seconds [why]
    NAMES+=("$1") RESULTS+=("$2") SECONDS_USED+=("$3") WHY+=("${4:-}")
    echo "=== [$1] $2 (${3}s)${4:+: $4}"
}

why() {  # stage -> the first FAIL line its output printed, else its last line
    local out="$TMPD/$1.out" line
    line=$(grep -m1 -E '^(FAIL|RESULT [^:]*: FAIL)' "$out" 2>/dev/null)
    [ -n "$line" ] || line="last line: $(grep -v '^[[:space:]]*$' "$out" 2>/dev/null | tail -n 1)"
    echo "${line:0:600}"
}

# run_stage NAME BUDGET CMD...: CMD under `timeout`, capped by what is left of TOTAL_BUDGET
run_stage() {
    local name=$1 budget; budget=$(scaled "$2"); shift 2
    local left=$((DEADLINE - $(date +%s) - RESERVE))
    local limit=$((budget < left ? budget : left))
    if [ "$limit" -lt 5 ]; then record "$name" SKIPPED 0 "the call's budget was spent"; return 1; fi
    echo
    echo "=== [$name] limit ${limit}s: $*"
    local t0; t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$TMPD/$name.out"
    local rc=${PIPESTATUS[0]}
    local dt=$(($(date +%s) - t0))
    case $rc in
        0) record "$name" PASS "$dt" ;;
        124|137) record "$name" "TIMEOUT (limit ${limit}s)" "$dt" "$(why "$name")" ;;
        *) record "$name" "FAIL (exit $rc)" "$dt" "$(why "$name")" ;;
    esac
    return "$rc"
}

stage_env() {
    echo "python: $(command -v "$PY") ($("$PY" --version 2>&1))"
    mkdir -p "$SITE"
    if compgen -G ".whl/*.whl" >/dev/null; then
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE/deps" .whl/*.whl || { echo "FAIL: installing the carried wheels from .whl/"; return 1; }
        echo "carried wheels installed into $SITE/deps: $(cd .whl && echo *.whl)"
    else
        echo "no .whl/ folder: using the image's packages (bash benchmarks/gpu_wheels.sh beforehand, carry .whl)"
    fi
    # specfit itself: built from pyproject.toml without network; else a copy of src/specfit (+ calibration/ data)
    if timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
        --target "$SITE/pkg" . >"$TMPD/pip-specfit.log" 2>&1; then
        echo "specfit built from pyproject.toml into $SITE/pkg"
    else
        echo "pip could not build specfit offline (last lines below); using a copy of src/specfit"
        tail -n 5 "$TMPD/pip-specfit.log"
        rm -rf "$SITE/pkg" && mkdir -p "$SITE/pkg" && cp -r src/specfit "$SITE/pkg/"
        if [ -d calibration ] && [ ! -d src/specfit/calibration ]; then cp -r calibration "$SITE/pkg/specfit/"; fi
    fi
    export PYTHONPATH="$SITE/pkg:$SITE/deps${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" - <<'EOF' || return 1
import importlib, os, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import transformers  # runs transformers' own import-time dependency version checks
except Exception as e:
    sys.exit(f"FAIL: import transformers: {type(e).__name__}: {e}")
missing = []
for name in os.environ["REQUIRED"].split():
    try:
        mod = importlib.import_module(name)
        print(f"  {name:16s} {str(getattr(mod, '__version__', '?')):12s} {mod.__file__}")
    except Exception as e:
        print(f"  {name:16s} MISSING ({type(e).__name__}: {e})")
        missing.append(name)
if missing:
    sys.exit(f"FAIL: missing on this machine: {', '.join(missing)}. Run `bash benchmarks/gpu_wheels.sh` where PyPI "
             f"is reachable (it fetches the wheels the image lacks) and carry .whl to this machine.")
from packaging.version import Version
base = Version(torch.__version__.split("+")[0])
if base < Version("2.8"):
    sys.exit(f"FAIL: torch {torch.__version__} is too old: SpecFit needs >= 2.8 (pyproject.toml: "
             f"torch.compiler.disable(reason=) at import)")
if getattr(torch.nn.functional, "grouped_mm", None) is None and getattr(torch, "_grouped_mm", None) is None:
    sys.exit(f"FAIL: torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm (specfit/seam/experts.py)")
print(f"torch {torch.__version__}: >= 2.8, grouped matmul as "
      f"{'F.grouped_mm' if getattr(torch.nn.functional, 'grouped_mm', None) else 'torch._grouped_mm'}"
      f"{'' if base.release[:2] == (2, 13) else ' (not the 2.13 the CPU tests run on: the image has its own)'}")
if Version(transformers.__version__) < Version("5.24"):
    sys.exit(f"FAIL: transformers {transformers.__version__} is too old: SpecFit needs >= 5.24. Run "
             f"`bash benchmarks/gpu_wheels.sh` where PyPI is reachable and carry .whl to this machine.")
if not torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1":
    sys.exit("FAIL: torch.cuda.is_available() is False")
import specfit, specfit.evaluation.calibrate, specfit.offload.loader, specfit.patch
print(f"specfit {specfit.__version__} from {specfit.__file__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    device = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}"
else:
    device = "no GPU (ALLOW_CPU=1)"
print(f"RESULT env: torch {torch.__version__}, transformers {transformers.__version__}, {device}")
EOF
    command -v nvidia-smi >/dev/null || { echo "nvidia-smi: not found"; return 0; }
    nvidia-smi || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,clocks.max.sm \
        --format=csv || true
    echo "cores: $(nproc); memory: $(free -g | awk '/Mem:/ {print $2 " GiB total, " $7 " GiB available"}');" \
         "memlock: $(ulimit -l); disk at $WORK: $(df -h --output=avail "$WORK" | tail -n1 | tr -d ' ') free"
}


stage_checkpoint() {
    local need_mb=$((LAYERS * 1300 + 1800)) avail_mb  # qwen3-30b-a3b: 1.21 GB of experts per layer, 1.6 GB more
    avail_mb=$(df -Pm "$WORK" | awk 'NR==2 {print $4}')
    echo "checkpoint: preset $PRESET, $LAYERS layers (qwen3-30b-a3b: the real shapes, $LAYERS of 48 layers," \
         "needs ~${need_mb} MB); ${avail_mb} MB free at $WORK"
    if [ "$PRESET" = qwen3-30b-a3b ] && [ "$avail_mb" -le "$need_mb" ]; then
        echo "FAIL: not enough disk at $WORK (set LAYERS lower)"
        return 1
    fi
    # one OpenMP thread per generator thread: nproc generators x nproc OpenMP threads would oversubscribe the cores
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" benchmarks/synthetic_checkpoint.py "$WORK/ckpt" --preset "$PRESET" \
        --layers "$LAYERS" --drafter-out "$WORK/drafter" --workers "$(nproc)" || return 1
    echo "RESULT checkpoint: $(du -sb "$WORK/ckpt" | cut -f1) bytes, preset $PRESET, $LAYERS layers"
}

calibrate_cmd() {  # -> CMD
    # --force: the fit's verdict is a figure here (print_fit), and decode gets the profile either way. On CUDA the
    # rounds are 1 + repeats x (1 link + 1 host lane): with --repeats 1, 3 rounds of 2 prompts x ~47 cycles (a random
    # drafter accepts ~nothing) = ~280 cycles, ~95 of them with every cold expert computed by the host lane (~6 layers
    # x 32 experts per verify at ~0.3-0.5 ms each on 16 threads): 35-55 s with load, pinning and the fit (review 5;
    # --repeats 2 made 470 cycles, 45-75 s against the 70 s limit)
    CMD=("$PY" -m specfit.cli calibrate --model "$WORK/ckpt" --drafter "$WORK/drafter" --slots "$SLOTS"
         --cache-mode cached --prompts random --num-prompts 2 --probes 48 --max-new-tokens 48 --repeats 1
         --dtype bfloat16 --out "$OUTDIR/profile-cached.json" --plot none --lane-seconds 25 --force)
    read -r -a extra <<<"$CAL_ARGS"
    CMD+=("${extra[@]}")
}

decode_cmd() {  # -> CMD
    CMD=("$PY" benchmarks/decode_check.py --model "$WORK/ckpt" --drafter "$WORK/drafter" --slots "$SLOTS")
    if [ -f "$OUTDIR/profile-cached.json" ] || [ "$DRY" = 1 ]; then CMD+=(--profile "$OUTDIR/profile-cached.json"); fi
    CMD+=(--prompts "$DECODE_PROMPTS" --prompt-len 32 --new-tokens "$DECODE_TOKENS" --dtype bfloat16
          --json "$OUTDIR/decode.json" --reference)
    if [ "${ALLOW_CPU:-0}" != 1 ]; then CMD+=(--require-pinned --require-grouped)
    elif [ "${STANDIN:-0}" = 1 ]; then CMD+=(--require-pinned); fi  # the stand-in registers the arenas as CUDA does
}

stage_fp8() {  # the synthetic checkpoint's FP8 twin (same random weights, quantized), decoded with the gate
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" benchmarks/synthetic_checkpoint.py "$WORK/ckpt-fp8" --preset "$PRESET" \
        --layers "$LAYERS" --fp8-block "$FP8_BLOCK" --workers "$(nproc)" || return 1
    fp8_cmd
    "${CMD[@]}"
}

fp8_cmd() {  # -> CMD: AR and SpecFit on the FP8 checkpoint (gathered: FP8 rows are dequantized per use)
    CMD=("$PY" benchmarks/decode_check.py --model "$WORK/ckpt-fp8" --drafter "$WORK/drafter" --slots "$SLOTS"
         --modes ar,specfit --prompts 1 --prompt-len 32 --new-tokens "$DECODE_TOKENS" --dtype bfloat16
         --json "$OUTDIR/decode-fp8.json" --reference)
    if [ -f "$OUTDIR/profile-cached.json" ] || [ "$DRY" = 1 ]; then CMD+=(--profile "$OUTDIR/profile-cached.json"); fi
    if [ "${ALLOW_CPU:-0}" != 1 ]; then CMD+=(--require-pinned); fi
}

print_fit() {  # the calibrated profile's figures and its verdict (a figure, not the stage's status)
    "$PY" - "$OUTDIR/profile-cached.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
beta, r2, n = d["beta"] * 1e3, d.get("r2") or 0.0, d.get("n_records")
q = d.get("quality") or {}
held = q.get("heldout_r2")
verdict = q.get("verdict", "unassessed")
if verdict == "poor":
    verdict = "POOR (" + "; ".join(q.get("reasons") or []) + ")"
link = max((d.get("probes") or {}).get("link_seconds") or [0.0])
copy = (d.get("copy_overhead_s", 0.0) + d.get("link_share", 1.0) * link) * 1e3
paper = (d.get("paper") or {}).get("beta")
print(f"RESULT profile: compute {beta:.4f} ms per expert, copy {copy:.4f} ms per expert (the link's own "
      f"{link * 1e3:.4f} ms, measured from the pinned bandwidth), R^2 {r2:.3f} (held out "
      f"{'n/a' if held is None else f'{held:.3f}'}) over {n} records (probe configurations x link and lane settings); the paper's demand-only beta here "
      f"{'n/a' if paper is None else f'{paper * 1e3:.4f}'} ms (paper, A100 over PCIe 4.0: 0.211 ms)")
print(f"RESULT calibration verdict: {verdict}; the profile goes to decode either way")
EOF
}

print_decode() {  # from decode.json, which decode_check rewrites after each mode: partial after a timeout
    [ -f "$OUTDIR/decode.json" ] || return 0
    "$PY" - "$OUTDIR/decode.json" <<'EOF'
import json, sys
names = {"ar": "AR", "eagle3": "EAGLE-3", "specfit": "SpecFit"}
for mode, x in json.load(open(sys.argv[1]))["results"].items():
    tps, cpt, npc = x["tokens_per_second"], x["copies_per_token"], x["nodes_per_cycle"]
    tpc, ms, gbps = x["tokens_per_cycle"], x["seconds_per_cycle"] * 1e3, x.get("copy_bandwidth", 0) / 1e9
    name = names.get(mode, mode) + (f" ({x['route_source']} routes)" if x.get("route_source") else "")
    print(f"RESULT decode {name}: {tps:.2f} tok/s (wall clock), {cpt:.1f} copies/token, {npc:.2f} nodes/cycle, "
          f"{tpc:.2f} tokens/cycle, {ms:.1f} ms/cycle, copies at {gbps:.1f} GB/s, "
          f"{x.get('pageable_copies', '?')} pageable copies, {x.get('syncs_per_cycle', float('nan')):.1f} host syncs/cycle "
          f"({x.get('sync_counter', '?')})")
EOF
}

stage_pytest() {  # fails unless CUDA tests ran and none was skipped (an all-skipped run would otherwise pass)
    local out="$TMPD/pytest-raw.txt" rc summary
    SPECFIT_REQUIRE_CUDA=1 "$PY" -m pytest -m cuda tests/test_cuda.py tests/test_cuda_lane.py -q -rs -p no:cacheprovider 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    summary=$(grep -E '^=* *[0-9]+ (passed|failed|skipped|errors?|deselected)' "$out" | tail -n 1)
    echo "RESULT pytest: ${summary:-no summary line}"
    [ "$rc" -eq 0 ] || return "$rc"
    if grep -Eq '[0-9]+ skipped' <<<"$summary" || ! grep -Eq '(^|[^0-9])[1-9][0-9]* passed' <<<"$summary"; then
        echo "FAIL: the CUDA tests did not all run (${summary:-no summary}): a GPU check must not pass on skips"
        return 1
    fi
}

cleanup() {
    if [ "$KEEP" != 1 ] && [ -f "$WORK/.specfit-gpu-check" ]; then rm -rf "$WORK"; fi
    rm -rf "$TMPD"
}

plan() {  # the dry run's plan: seconds per stage, per part, for one call, and the rerun of part 3; 1 if over
    local p1 p2 p3 one call rerun warm cold over=0
    p1=$(estimate $PART1) p2=$(estimate $PART2) p3=$(estimate $PART3)
    # the rerun: part 3, the part most likely to fail: what users run (batches, the server, the openai client) has
    # never run on a GPU, nor been read by an outside reading; parts 1 and 2 have been read seven times
    rerun=$p3
    case "$PART" in 1) one=$p1 ;; 2) one=$p2 ;; 3) one=$p3 ;; *) one=$(estimate $PART1 ${PART2#env } ${PART3#env }) ;; esac
    call=$((one + STARTUP))
    warm=$((call + rerun)) cold=$((call + rerun + STARTUP))
    echo "plan (seconds; each part's and each call's estimate is the sum of its stage limits plus ${RESERVE}s of reserve;" \
         "a fresh machine's start-up priced at ${STARTUP}s):"
    echo "  part 1 ($(chosen $PART1)): ${p1}s; part 2 ($(chosen $PART2)): ${p2}s; part 3 ($(chosen $PART3)): ${p3}s"
    echo "  this call (part ${PART:-1+2+3}): ${one}s of the ${COMMAND_LIMIT}s a command may run:" \
         "$([ "$one" -le "$COMMAND_LIMIT" ] && echo fits || echo OVER); with start-up ${call}s" \
         "($(minutes "$call") device-minutes); run it with timeout_s $COMMAND_LIMIT"
    echo "  with one rerun of part 3 (the part most likely to fail, ${rerun}s) at once on the warm machine: ${warm}s" \
         "($(minutes "$warm") device-minutes) of the plan's ${PLAN_LIMIT}s, margin $((PLAN_LIMIT - warm))s:" \
         "$([ "$warm" -le "$PLAN_LIMIT" ] && echo fits || echo 'OVER: leave a stage to the next run');" \
         "after a fresh start ${cold}s ($(minutes "$cold") device-minutes) of the ${DEVICE_LIMIT}s:" \
         "$([ "$cold" -le "$DEVICE_LIMIT" ] && echo fits || echo OVER)"
    echo "  a rerun of part 1 (${p1}s) or part 2 (${p2}s) at once instead: $((call + p1))s or $((call + p2))s of the" \
         "${DEVICE_LIMIT}s"
    [ "$one" -le "$COMMAND_LIMIT" ] && [ "$warm" -le "$PLAN_LIMIT" ] || over=1
    [ -n "$PART" ] && echo "  (a part alone: run the others at once after it, inside the warm window: no second start-up)"
    echo "dry run: the stages (limits in seconds)"
    for s in $ALL_STAGES; do
        wanted "$s" || [ "$s" = env ] || continue
        case $s in
            env) echo "  env ${BUDGET[env]}: install .whl/*.whl into $SITE/deps, build specfit into $SITE/pkg, versions, nvidia-smi" ;;
            pytest) echo "  pytest ${BUDGET[pytest]}: SPECFIT_REQUIRE_CUDA=1 pytest -m cuda tests/test_cuda.py tests/test_cuda_lane.py, no skips" ;;
            bandwidth) echo "  bandwidth ${BUDGET[bandwidth]}: $PY benchmarks/gpu_stages.py bandwidth: H2D of one 9,437,184-byte expert, registered / pinned / pageable; floor ${MIN_H2D_GBPS:-by the GPU (35 GB/s at sm_90+)}" ;;
            host-experts) echo "  host-experts ${BUDGET[host-experts]}: $PY benchmarks/host_expert_check.py --json $OUTDIR/host_experts.json" ;;
            checkpoint) echo "  checkpoint ${BUDGET[checkpoint]}: benchmarks/synthetic_checkpoint.py $WORK/ckpt --preset $PRESET --layers $LAYERS --drafter-out $WORK/drafter" ;;
            calibrate) calibrate_cmd; echo "  calibrate ${BUDGET[calibrate]}: ${CMD[*]}" ;;
            decode) decode_cmd; echo "  decode ${BUDGET[decode]}: ${CMD[*]}" ;;
            fp8) fp8_cmd; echo "  fp8 ${BUDGET[fp8]}: benchmarks/synthetic_checkpoint.py $WORK/ckpt-fp8 --preset $PRESET --layers $LAYERS --fp8-block $FP8_BLOCK; then ${CMD[*]}" ;;
            users) echo "  users ${BUDGET[users]}: $PY benchmarks/gpu_stages.py users --tokens $USERS_TOKENS --log $OUTDIR/serve.log" ;;
        esac
    done
    return $over
}

main() {
    echo "SpecFit GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), host ${HOSTNAME:-$(uname -n)}, repo $(pwd)"
    echo "settings: PRESET=$PRESET LAYERS=$LAYERS SLOTS=$SLOTS WORK=$WORK part=${PART:-all} TOTAL_BUDGET=${TOTAL_BUDGET}s" \
         "stages=$STAGES log=$LOG${LIMIT_SCALE:+ LIMIT_SCALE=$LIMIT_SCALE}"
    if [ "$DRY" = 1 ]; then plan; return; fi
    if [ -n "$SPEED_NOTE" ]; then echo "$SPEED_NOTE" | tee "$TMPD/speed.out"; fi
    mkdir -p "$WORK" && touch "$WORK/.specfit-gpu-check"
    export -f stage_env && export PY SITE TMPD WORK
    if timeout --kill-after=10 "${BUDGET[env]}" bash -c stage_env 2>&1 | tee "$TMPD/env.out"; \
            [ "${PIPESTATUS[0]}" -eq 0 ]; then
        record env PASS $(($(date +%s) - START))
        export PYTHONPATH="$SITE/pkg:$SITE/deps${PYTHONPATH:+:$PYTHONPATH}"  # the pipe ran stage_env in a subshell
    else
        record env FAIL $(($(date +%s) - START)) "$(why env)"
        echo "the environment is not usable: only the bandwidth stage (torch alone) still runs"
        if wanted bandwidth; then run_stage bandwidth "${BUDGET[bandwidth]}" "$PY" benchmarks/gpu_stages.py bandwidth; fi
        return 1
    fi
    if wanted pytest; then
        export -f stage_pytest && export PY TMPD
        run_stage pytest "${BUDGET[pytest]}" bash -c stage_pytest
    fi
    if wanted bandwidth; then run_stage bandwidth "${BUDGET[bandwidth]}" "$PY" benchmarks/gpu_stages.py bandwidth; fi
    if wanted host-experts; then
        run_stage host-experts "${BUDGET[host-experts]}" "$PY" benchmarks/host_expert_check.py \
            --json "$OUTDIR/host_experts.json"
    fi
    local have_ckpt=0
    if wanted checkpoint; then
        export -f stage_checkpoint && export PY LAYERS WORK PRESET
        run_stage checkpoint "${BUDGET[checkpoint]}" bash -c stage_checkpoint && have_ckpt=1
    fi
    if wanted calibrate; then  # once: one profile prices every slot count and cache mode
        if [ $have_ckpt = 1 ]; then
            calibrate_cmd  # tqdm progress every 10 s, the load line at once
            run_stage calibrate "${BUDGET[calibrate]}" env -u TQDM_DISABLE TQDM_MININTERVAL=10 "${CMD[@]}" \
                && print_fit | tee -a "$TMPD/summary.out"
        else
            record calibrate "SKIPPED" 0 "no checkpoint"
        fi
    fi
    if wanted decode; then
        if [ $have_ckpt = 1 ]; then
            [ -f "$OUTDIR/profile-cached.json" ] || echo "note: no calibrated profile: SpecFit uses its default cost model"
            decode_cmd
            run_stage decode "${BUDGET[decode]}" "${CMD[@]}"
            print_decode | tee -a "$TMPD/summary.out"  # the modes done so far, even after a timeout
        else
            record decode "SKIPPED" 0 "no checkpoint"
        fi
    fi
    if wanted fp8; then  # optional: FP8 experts dequantized on the device at the real shapes
        if [ $have_ckpt = 1 ]; then
            export -f stage_fp8 fp8_cmd && export PY LAYERS WORK PRESET FP8_BLOCK SLOTS DECODE_TOKENS OUTDIR DRY
            run_stage fp8 "${BUDGET[fp8]}" bash -c stage_fp8
        else
            record fp8 "SKIPPED" 0 "no checkpoint (its drafter)"
        fi
    fi
    if wanted users; then
        run_stage users "${BUDGET[users]}" "$PY" benchmarks/gpu_stages.py users --tokens "$USERS_TOKENS" \
            --log "$OUTDIR/serve.log"
    fi
}

summary() {  # what passed, what failed and why, in one place
    local passed=0 i failed=()
    echo
    echo "================================ SUMMARY ================================"
    echo "SpecFit GPU check, part ${PART:-1+2+3}: $PRESET with $LAYERS layers (the real per-layer shapes, $LAYERS of" \
         "48 layers, for qwen3-30b-a3b), SLOTS=$SLOTS; $(($(date +%s) - START))s"
    for i in "${!NAMES[@]}"; do
        if [ "${RESULTS[$i]}" = PASS ]; then
            passed=$((passed + 1))
            echo "RESULT stage ${NAMES[$i]}: PASS (${SECONDS_USED[$i]}s)"
        else
            echo "RESULT stage ${NAMES[$i]}: ${RESULTS[$i]} (${SECONDS_USED[$i]}s): ${WHY[$i]}"
            failed+=("${NAMES[$i]}")
        fi
    done
    cat "$TMPD"/*.out 2>/dev/null | grep -h '^RESULT' | grep -v '^RESULT stage ' | sed 's/^RESULT /  /' | awk '!seen[$0]++'
    if [ "$passed" -eq "${#NAMES[@]}" ]; then
        echo "RESULT check: PASS: all ${#NAMES[@]} stages passed; log: $LOG"
    else
        echo "RESULT check: FAIL: $passed of ${#NAMES[@]} stages passed; not passed: ${failed[*]} (reasons in the" \
             "RESULT stage lines above); log: $LOG"
    fi
    [ "$passed" -eq "${#NAMES[@]}" ]
}

TMPD=$(mktemp -d)
START=$(date +%s)
DEADLINE=$((START + TOTAL_BUDGET))
trap cleanup EXIT
{
    main
    rc=$?
    if [ "$DRY" = 1 ]; then exit $rc; fi
    summary && [ $rc -eq 0 ]
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
