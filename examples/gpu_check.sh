#!/usr/bin/env bash
# The device check, prepared for the first GPU machine that comes: examples/gpu_check.sh OUT_DIR
#
# Runs from the repository root on a machine with no network (the packages it needs are the
# image's own). Each section is its own process with its own time limit, so a failing or hanging
# section still leaves the others' results; the whole check stays within 8 minutes (BUDGET): a
# section's limit is cut to what is left, and one that cannot start says so in its log.
#
#   setup    examples/gpu_setup.py: refuses a Triton other than the one torch's wheel pins (the check
#            stops there); finds or makes what AOTInductor's CUDA build needs -- a CUDA_HOME with the
#            CUDA headers (OUT_DIR/cuda_home, from the nvidia-* wheels, a toolkit or Triton's copy) and an
#            unversioned libcuda.so (OUT_DIR/cuda_lib, on LIBRARY_PATH) -- or says which file it looked
#            for where, and exports them to the later sections (OUT_DIR/setup.env); then the offline
#            editable install (--no-deps --no-build-isolation --no-index); when that fails, a plain
#            install into OUT_DIR/site, put on PYTHONPATH                     -> setup.log, setup.json
#   env      GPU, driver, memory, torch / triton / python versions, specc imports -> env.json
#   kernels  every specc kernel against its reference on CUDA, bf16 and fp32 -> kernels.json
#   curve    the cost curve c(T) = t(T) / t(1), T = 1..32, of specc's target module replayed as
#            CUDA graphs at SmolLM2's and Qwen3-8B's layer shapes, per-layer cost, and the
#            memory floor from the measured copy bandwidth (examples/gpu_cost_curve.py) -> curve.json
#   engine   SmolLM2's shapes with random weights, bf16, inductor, only the graphs the timed runs use
#            (greedy, one prefill size), each graph's compile seconds printed as it finishes: plain,
#            unfused and fused decode ms per step, with the decode calls replayed as CUDA graphs and launched
#            kernel by kernel, and kernel launches / graph launches / syncs per step from the
#            profiler                                                        -> engine.json
#   rows     row invariance: each node of a verify (chain and 2x2 tree, bf16 and fp32, eager and
#            inductor) against the plain step along its path, bit for bit                -> rows.json
#   engine_qwen  the same at Qwen3-8B's layer shapes, 4 of its 36 layers, with the cost per layer
#                                                                             -> engine_qwen.json
#
# OUT_DIR/sections.json says, per section, its exit status and seconds; the script exits 1 if any
# section failed.
set -u
OUT=${1:?usage: examples/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=480
T0=$(date +%s)
FAILED=0
LAST_RC=0
: > "$OUT/sections.jsonl"

section() {  # section NAME LIMIT_S COMMAND...: run it, log it, record its status
    local name=$1 limit=$2 left rc start
    shift 2
    left=$(( BUDGET - ($(date +%s) - T0) ))
    (( limit > left )) && limit=$left
    if (( limit < 10 )); then
        rc=124
        echo "not run: the check's $BUDGET s were spent" > "$OUT/$name.log"
    else
        start=$(date +%s)
        timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        rc=$?
    fi
    LAST_RC=$rc
    echo "{\"section\": \"$name\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - ${start:-$(date +%s)} )), \"limit_s\": $limit}" >> "$OUT/sections.jsonl"
    if (( rc != 0 )); then
        FAILED=1
        echo "gpu_check: section $name failed (exit $rc$( (( rc == 124 )) && echo ", out of time")); see $OUT/$name.log" >&2
    else
        echo "gpu_check: section $name passed in $(( $(date +%s) - start )) s" >&2
    fi
    return 0
}

setup() {  # the Triton pin and CUDA's pieces first (a refused Triton stops here), then the install
    local rc=0
    $PY examples/gpu_setup.py "$OUT" || rc=$?
    (( rc == 3 )) && return 3
    install_specc || rc=1
    return $rc
}

install_specc() {
    if $PY -m pip install --no-deps --no-build-isolation --no-index -e .; then
        return 0
    fi
    echo "editable install failed; installing a copy into $OUT/site" >&2
    $PY -m pip install --no-deps --no-build-isolation --no-index --target "$OUT/site" .
}

summary() {
    $PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "sections.jsonl").read_text().splitlines() if line.strip()]
(out / "sections.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"{r['section']:<8} exit {r['exit']:>3}  {r['seconds']:>4} s (limit {r['limit_s']} s)")
EOF
}

export -f setup install_specc
export PY OUT
section setup 120 bash -c setup  # timeout runs programs, not shell functions
if (( LAST_RC == 3 )); then
    echo "gpu_check: stopped after setup: $(grep -m 1 '^refused' "$OUT/setup.log")" >&2
    summary
    exit 1
fi
# CUDA_HOME and LIBRARY_PATH for AOTInductor's CUDA build, as the setup found or made them
[ -f "$OUT/setup.env" ] && . "$OUT/setup.env"
[ -d "$OUT/site" ] && export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
section env 60 $PY examples/gpu_check.py --env-only --json "$OUT/env.json"
section kernels 150 $PY examples/gpu_check.py --skip-engine --json "$OUT/kernels.json"
section curve 120 $PY examples/gpu_cost_curve.py --json "$OUT/curve.json"
section engine 270 $PY examples/gpu_check.py --skip-kernels --json "$OUT/engine.json"
section rows 120 $PY examples/gpu_check.py --rows --json "$OUT/rows.json"
section engine_qwen 180 $PY examples/gpu_check.py --skip-kernels --shape qwen3-8b --prompts 2 --rounds 1 \
    --new-tokens 64 --json "$OUT/engine_qwen.json"

summary
exit $FAILED
