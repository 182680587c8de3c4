#!/usr/bin/env bash
# GPU-machine check of the interceptor and the cuda-vmm backend (< 3 min on an H100).
#   bench/gpu/interceptor_check.sh            # results under $OUT (default bench/build/gpu-check)
# Steps (logs in $OUT/steps.log, verdicts in $OUT/summary.txt, fault table in $OUT/faults.txt):
#   env         GPU, driver, CUDA, torch versions
#   build       make -C interceptor all test   (the C unit tests, fake driver)
#   decls       compile-time check of every hand-declared constant, struct and
#               function type (both cuGetProcAddress ABIs) against cuda.h
#   pool_real   pools on the real driver across 3 processes: export + exit,
#               scratch + swap at the same VA (kernel-free memcpy checks), verify
#   hooks       torch under LD_PRELOAD: cudaMalloc in a tagged region lands in the pool
#   hooks_off   the same with FRMPS_VMM_DISABLE=1: pure passthrough
#   pytest      vllmpatch/tests/test_cuda_vmm*.py (CudaVmmBackend on the GPU)
#   faults      build bench/faults (nvcc, sm_90) and run each trigger once, outside
#               MPS (each faults only its own context); observed errors in faults.txt
# Env: OUT, CUDA_HOME, PYTHON, POOL_MIB (default 1024), RUN_FAULTS (default 1).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$ROOT/bench/build/gpu-check}
PYTHON=${PYTHON:-python3}
POOL_MIB=${POOL_MIB:-1024}
RUN_FAULTS=${RUN_FAULTS:-1}
if [[ -z "${CUDA_HOME:-}" ]]; then
  if command -v nvcc >/dev/null; then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  else CUDA_HOME=/usr/local/cuda; fi
fi
export PATH="$CUDA_HOME/bin:$PATH"
mkdir -p "$OUT"
GEN="$ROOT/bench/build/gpu-gen"
mkdir -p "$GEN"
LIB="$ROOT/interceptor/build/libfrmps_vmm.so"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
: >"$OUT/steps.log"
failed=0

step() { # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  echo "=================== $name" >>"$OUT/steps.log"
  # timeout cannot run shell functions: run them in a child bash (functions exported below).
  timeout "$limit" bash -c '"$@"' step "$@" >>"$OUT/steps.log" 2>&1
  rc=$?
  local verdict=PASS
  if [[ $rc -eq 77 ]]; then verdict=SKIP; elif [[ $rc -ne 0 ]]; then verdict="FAIL(rc=$rc)"; failed=1; fi
  printf '%-10s %-12s %4ss\n' "$name" "$verdict" "$((SECONDS - t0))" | tee -a "$SUMMARY"
}

env_info() {
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -2 || true
  echo "CUDA_HOME $CUDA_HOME"
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' || true
}

build() { make -C "$ROOT/interceptor" all test; }

decls() {
  sed -e 's/FRMPS_CUDA_DECLS_H/FRMPS_CUDA_DECLS_RENAMED_H/g' -e 's/\bfrmps_cu/ours_frmps_cu/g' \
      -e 's/\b\(CU[A-Za-z0-9_]*\|cu[A-Za-z0-9_]*\|CUDA_[A-Za-z0-9_]*\)\b/ours_\1/g' \
      "$ROOT/interceptor/src/cuda_decls.h" >"$GEN/cuda_decls_renamed.h" &&
  gcc -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -I"$CUDA_HOME/include" -I"$GEN" \
      -I"$ROOT/interceptor/src" -I"$ROOT/interceptor/include" \
      "$ROOT/bench/gpu/check_decls.c" -o "$GEN/check_decls" &&
  "$GEN/check_decls" &&
  echo "exported symbols:" && nm -D --defined-only "$LIB" | awk '{print $3}' | grep -v '^_' | sort
}

pool_real() {
  gcc -std=c11 -O2 -Wall -Wextra -Werror -D_GNU_SOURCE -I"$CUDA_HOME/include" -I"$ROOT/interceptor/include" \
      "$ROOT/bench/gpu/pool_real.c" -o "$GEN/pool_real" \
      -L"$ROOT/interceptor/build" -lfrmps_vmm -Wl,-rpath,"$ROOT/interceptor/build" \
      -L"$CUDA_HOME/lib64/stubs" -L"$CUDA_HOME/targets/x86_64-linux/lib/stubs" -lcuda &&
  "$GEN/pool_real" "$POOL_MIB"
}

hooks() { # hooks enabled|disabled
  local extra=()
  [[ $1 == disabled ]] && extra=(FRMPS_VMM_DISABLE=1)
  env "${extra[@]}" FRMPS_VMM_LIB="$LIB" LD_PRELOAD="$LIB" "$PYTHON" "$ROOT/bench/gpu/hooks_torch.py" "$1"
}

pytest_gpu() {
  if ! "$PYTHON" -c 'import pytest' 2>/dev/null; then echo "pytest is not installed"; return 77; fi
  if [[ ! -f "$ROOT/vllmpatch/src/frmps_engine/sdk/memory/base.py" ]]; then echo "engine SDK (sdk/memory/base.py) not in this tree"; return 77; fi
  PYTHONPATH="$ROOT/vllmpatch/src:$ROOT" FRMPS_VMM_LIBRARY="$LIB" "$PYTHON" -m pytest -q -p no:cacheprovider -rs -s \
    "$ROOT/vllmpatch/tests/test_cuda_vmm.py" "$ROOT/vllmpatch/tests/test_cuda_vmm_gpu.py" \
    "$ROOT/vllmpatch/tests/test_vllm_alloc_gpu.py"
}

faults() {
  make -C "$ROOT/bench/faults" BUILD="$ROOT/bench/build/faults" || return 1
  local bin="$ROOT/bench/build/faults" rc=0 p v
  : >"$OUT/faults.txt"
  # program:variant ... ; exit 0 = the expected error, 2 = another error, 1 = no error
  for pv in stack_overflow:recursion illegal_instruction:jump-far illegal_instruction:jump-mid \
            illegal_instruction:brkpt illegal_instruction:trap shared_oob:shared shared_oob:local misaligned:load \
            invalid_address_space:ld-global-shared \
            oob_write:write readonly_write:vmm-read-only; do
    p=${pv%%:*}; v=${pv#*:}
    local line xid n0
    n0=$(dmesg 2>/dev/null | wc -l) # only this run's kernel-log lines (Xid) are shown below
    line=$(timeout 30 "$bin/$p" "$v" 2>&1); local r=$?
    sleep 0.3
    xid=$(dmesg 2>/dev/null | tail -n +$((n0 + 1)) | grep -o 'Xid.*' | sed 's/^Xid ([^)]*): //' | grep -v 'ESR\|^43,' | cut -c1-160 | head -2 | tr '\n' ';')
    echo "$p $v exit=$r :: $(echo "$line" | grep '^observed' || echo "$line" | tail -1) :: ${xid:-no Xid seen}" | tee -a "$OUT/faults.txt"
    [[ $r -eq 1 || $r -ge 3 ]] && rc=1   # no fault at all, or setup failure/timeout
  done
  return $rc
}

export ROOT OUT PYTHON POOL_MIB CUDA_HOME GEN LIB PATH
export -f env_info build decls pool_real hooks pytest_gpu faults
cd "$ROOT"
step env 30 env_info
step build 120 build
step decls 60 decls
step pool_real 120 pool_real
step hooks 120 hooks enabled
step hooks_off 120 hooks disabled
step pytest 300 pytest_gpu
if [[ $RUN_FAULTS == 1 ]]; then step faults 400 faults; fi
echo "results in $OUT"
exit $failed
