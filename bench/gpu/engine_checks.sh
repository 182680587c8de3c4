#!/bin/bash
# GPU machine: the reference engine's GPU tests, where a standby's memory goes
# (standby_mem_probe.py, default and reduced cuBLAS workspace), the workspace's speed
# effect (workspace_speed.py) and the sync-overhead experiment for the given models.
# Everything lands in $OUT (text files) and in RESULTS (bench JSON).
#
#   OUT=<dir> RESULTS=bench/results/<date>-h100 MODELS=qwen2.5-0.5b,qwen2.5-14b bench/gpu/engine_checks.sh
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:?OUT must name a folder}
MODELS=${MODELS:-qwen2.5-0.5b,qwen2.5-14b}
RESULTS=${RESULTS:?RESULTS must name the bench results folder}
export PYTHONPATH=$PWD/vllmpatch/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the engine package, the bench package
mkdir -p "$OUT" "$RESULTS"
T0=$(date +%s)
stamp() { echo "== $* ($(( $(date +%s) - T0 ))s)"; }

{
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    cat COMMIT 2>/dev/null || git rev-parse --short HEAD
} > "$OUT/env.txt" 2>&1

stamp "GPU tests"
[ -n "${SKIP_TESTS:-}" ] || "$PY" -m pytest -q -p no:cacheprovider vllmpatch/tests/test_refengine_gpu.py > "$OUT/pytest_refengine_gpu.txt" 2>&1
tail -3 "$OUT/pytest_refengine_gpu.txt"

stamp "standby memory probe"
for cfg in ${PROBE_CONFIGS:-default :4096:1}; do
    for m in ${PROBE_MODELS:-qwen2.5-0.5b qwen2.5-14b}; do
        echo "### $m CUBLAS_WORKSPACE_CONFIG=$cfg"
        if [ "$cfg" = default ]; then
            CUBLAS_WORKSPACE_CONFIG= "$PY" bench/gpu/standby_mem_probe.py --model "$m"
        else
            CUBLAS_WORKSPACE_CONFIG=$cfg "$PY" bench/gpu/standby_mem_probe.py --model "$m"
        fi
    done
done > "$OUT/standby_mem_probe.txt" 2>&1
grep -E "^###|=>|stream" "$OUT/standby_mem_probe.txt" | head -40

stamp "workspace speed"
"$PY" bench/gpu/workspace_speed.py --models "${WS_MODELS:-$MODELS}" --rounds "${WS_ROUNDS:-1}" > "$OUT/workspace_speed.jsonl" 2> "$OUT/workspace_speed.err"
cat "$OUT/workspace_speed.jsonl"; tail -5 "$OUT/workspace_speed.err"

stamp "sync overhead"
left=$(( ${LIMIT:-570} - ($(date +%s) - T0) - 30 ))
bin/frmps bench --python "$PY" sync-overhead --models "$MODELS" --out "$RESULTS" --workdir /tmp/frmps-bench \
    --budget "$left" > "$OUT/sync_overhead.log" 2>&1
tail -4 "$OUT/sync_overhead.log"
bin/frmps bench --python "$PY" report --out "$RESULTS" > /dev/null 2>&1
sed -n '/## 4\./,/sync-overhead.png/p' "$RESULTS/README.md"
stamp "done; MPS processes left: $(ps -eo comm | grep -c '^nvidia-cuda-mps')"
