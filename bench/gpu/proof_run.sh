#!/bin/bash
# One GPU-machine session of the failover proof: environment, builds, the
# reference engine's GPU tests, then bench/gpu/failover_proof.py per model.
# Usage: OUT=<dir> bench/gpu/proof_run.sh "qwen2.5-0.5b|<faults>|<budget_s>|<max_tokens>" ...
# (empty <faults> = all of them; ENGINE_ARGS="--max-num-seqs=8 ..." go to every engine; SYNC_EVERY, default 16). Results: $OUT/summary.txt, $OUT/proof-<model>.json,
# $OUT/logs_tail.txt (last lines of every engine, supervisor and MPS log).
set -u
OUT=${OUT:-bench/build/proof}
mkdir -p "$OUT"
S=$OUT/summary.txt
{
date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__)"
nvcc --version | tail -1
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
} > "$S" 2>&1
if make -C interceptor all >"$OUT/build.log" 2>&1 && make -C bench/faults >>"$OUT/build.log" 2>&1; then
    echo "build OK" >> "$S"
else
    echo "build FAILED" >> "$S"; tail -20 "$OUT/build.log" >> "$S"
fi
if [ -z "${SKIP_PYTEST:-}" ]; then
    PYTHONPATH=$PWD/vllmpatch/src:$PWD timeout 150 python3 -m pytest -q vllmpatch/tests/test_refengine_gpu.py > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest test_refengine_gpu.py rc=$?: $(tail -1 "$OUT/pytest_gpu.log")" >> "$S"
fi
python3 bench/gpu/ctx_mem.py >> "$S" 2>&1
cat "$S"
for spec in "$@"; do
    IFS='|' read -r model faults budget maxtok <<< "$spec"
    args=(--frmps bin/frmps --model "$model" --workdir /tmp/fp --out "$OUT/proof-$model.json" --sync-every "${SYNC_EVERY:-16}"
          --time-budget "${budget:-300}" --max-tokens "${maxtok:-768}" --inject-after 100000 --inject-delay "${INJECT_DELAY:-0.5}" --stop-on-error)
    [ -n "$faults" ] && args+=(--faults "$faults")
    for ea in ${ENGINE_ARGS:-}; do args+=("--engine-arg=$ea"); done
    echo "== $model" | tee -a "$S"
    timeout $(( ${budget:-300} + 150 )) python3 bench/gpu/failover_proof.py "${args[@]}" 2>&1 | tee -a "$S"
done
for f in /tmp/fp/logs-*/*.log; do echo "=== $f"; grep -v '^\s*$' "$f" | tail -n 25; done > "$OUT/logs_tail.txt" 2>&1
sleep 2
echo "after: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader); MPS processes left: $(ps -eo comm | grep -c '^nvidia-cuda-mps')" | tee -a "$S"
ps -eo pid,ppid,etimes,args | grep "[n]vidia-cuda-mps" | tee -a "$S"
