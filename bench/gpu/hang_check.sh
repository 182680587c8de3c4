#!/bin/bash
# Hang detection on the GPU machine: bench/gpu/hang_check.py against qwen2.5-0.5b
# (active in MPS, --memory cuda-vmm, default thresholds): a 32k-token prompt with no
# failover, a kernel that never returns (first inside MPS, then outside), SIGSTOP.
# Usage: OUT=<dir> bench/gpu/hang_check.sh [extra hang_check.py flags]
# Needs bin/frmps built where Go is (CGO_ENABLED=0 go build -o bin/frmps ./cmd/frmps).
# Results: $OUT/hang_check.json, $OUT/summary.txt, $OUT/logs_tail.txt.
set -u
# Stopped by a bound (SIGTERM to the process group): the Python check unwinds and
# stops its frmps; this script then still writes its logs and cleans up.
trap 'echo "stopped by SIGTERM (a time bound)" >> "${OUT:-.}/summary.txt"' TERM
OUT=${OUT:-bench/build/hang}
mkdir -p "$OUT"
S=$OUT/summary.txt
{
date -u; nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.used,memory.total --format=csv,noheader
python3 -c "import torch;print('torch',torch.__version__,'cuda',torch.version.cuda)"
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
} > "$S" 2>&1
make -C interceptor all > "$OUT/build.log" 2>&1 || { echo "interceptor build FAILED" >> "$S"; tail -20 "$OUT/build.log" >> "$S"; }
timeout 1800 python3 bench/gpu/hang_check.py --frmps bin/frmps --model "${MODEL:-qwen2.5-0.5b}" \
    --workdir /tmp/frmps-hang --out "$OUT/hang_check.json" "$@" 2>&1 | tee -a "$S"
rc=${PIPESTATUS[0]}
for f in /tmp/frmps-hang/logs-*/*.log; do echo "=== $f"; grep -v '^\s*$' "$f" | tail -n 30; done > "$OUT/logs_tail.txt" 2>&1
sleep 2
echo "after: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader); MPS processes left: $(ps -eo comm | grep -c '^nvidia-cuda-mps')" | tee -a "$S"
exit "$rc"
