#!/usr/bin/env bash
# The device check, prepared for the first GPU machine that comes: examples/gpu_check.sh OUT_DIR
#
# Runs from the repository root on a machine with no network (the packages it needs are the
# image's own). Each section is its own process with its own time limit, so a failing or hanging
# section still leaves the others' results; the whole check stays within 8 minutes (BUDGET): a
# section's limit is cut to what is left, and one that cannot start says so in its log.
#
#   setup    offline editable install (--no-deps --no-build-isolation --no-index); when that fails,
#            a plain install into OUT_DIR/site, put on PYTHONPATH            -> setup.log
#   env      GPU, driver, memory, torch / triton / python versions, specc imports -> env.json
#   kernels  every specc kernel against its reference on CUDA, bf16 and fp32 -> kernels.json
#   curve    the cost curve c(T) = t(T) / t(1), T = 1..32, of specc's target module replayed as
#            CUDA graphs at SmolLM2's and Qwen3-8B's layer shapes, per-layer cost, and the
#            memory floor from the measured copy bandwidth (examples/gpu_cost_curve.py) -> curve.json
#   engine   SmolLM2's shapes with random weights, bf16, inductor: plain, unfused and fused
#            decode ms per step, with the decode calls replayed as CUDA graphs and launched
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
    echo "{\"section\": \"$name\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - ${start:-$(date +%s)} )), \"limit_s\": $limit}" >> "$OUT/sections.jsonl"
    if (( rc != 0 )); then
        FAILED=1
        echo "gpu_check: section $name failed (exit $rc$( (( rc == 124 )) && echo ", out of time")); see $OUT/$name.log" >&2
    else
        echo "gpu_check: section $name passed in $(( $(date +%s) - start )) s" >&2
    fi
    return 0
}

install_specc() {
    if $PY -m pip install --no-deps --no-build-isolation --no-index -e .; then
        return 0
    fi
    echo "editable install failed; installing a copy into $OUT/site" >&2
    $PY -m pip install --no-deps --no-build-isolation --no-index --target "$OUT/site" .
}

export -f install_specc
export PY OUT
section setup 120 bash -c install_specc  # timeout runs programs, not shell functions
[ -d "$OUT/site" ] && export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
section env 60 $PY examples/gpu_check.py --env-only --json "$OUT/env.json"
section kernels 150 $PY examples/gpu_check.py --skip-engine --json "$OUT/kernels.json"
section curve 120 $PY examples/gpu_cost_curve.py --json "$OUT/curve.json"
section engine 270 $PY examples/gpu_check.py --skip-kernels --json "$OUT/engine.json"
section rows 120 $PY examples/gpu_check.py --rows --json "$OUT/rows.json"
section engine_qwen 180 $PY examples/gpu_check.py --skip-kernels --shape qwen3-8b --prompts 2 --rounds 1 \
    --new-tokens 64 --json "$OUT/engine_qwen.json"

$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "sections.jsonl").read_text().splitlines() if line.strip()]
(out / "sections.json").write_text(json.dumps(rows, indent=1))
for r in rows:
    print(f"{r['section']:<8} exit {r['exit']:>3}  {r['seconds']:>4} s (limit {r['limit_s']} s)")
EOF
exit $FAILED
