#!/bin/bash
# One GPU-machine run of `frmps bench`: builds what is missing (interceptor, fault
# triggers), then runs the named slots, each a set of experiments that fits with the
# others in about 9 minutes on an H100 (bench/README.md has the table), or given
# as "x:<experiment> <flags>". Every
# command gets --budget from the time left, so a slow run stops cleanly between
# points; re-running the same slot resumes from the result files.
#
#   RESULTS=bench/results/2026-11-22-h100 OUT=<dir> bench/gpu/bench_run.sh s1
#
# RESULTS: one results directory for the whole sweep (bring it back to the next run:
#          resumption reads it). Default bench/results/<UTC date>-<gpu>.
# OUT:     where a copy of RESULTS and the log tails go at the end (optional).
# LIMIT:   seconds this run may take in all (default 540); BENCH_ARGS: extra flags.
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
LIMIT=${LIMIT:-540}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD/vllmpatch/src:$PWD${PYTHONPATH:+:$PYTHONPATH}  # the engine package, the bench package
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE '[A-Z]{1,2}[0-9]{2,4}' | head -1 | tr 'A-Z' 'a-z')
RESULTS=${RESULTS:-bench/results/$(date -u +%F)-${GPU:-gpu}}
WORK=${WORK:-/tmp/frmps-bench}
mkdir -p "$RESULTS" "$WORK"
rm -rf "$WORK"/logs-* "$WORK"/baseline-logs "$WORK"/*.log  # this run's logs only

[ -x bin/frmps ] || { echo "bin/frmps missing: build it where Go is (CGO_ENABLED=0 go build -o bin/frmps ./cmd/frmps)"; exit 1; }
if [ ! -f interceptor/build/libfrmps_vmm.so ] || [ ! -x bench/build/faults/misaligned ]; then
    echo "== building the interceptor and the fault triggers"
    make -C interceptor all >"$WORK/build.log" 2>&1 && make -C bench/faults >>"$WORK/build.log" 2>&1 ||
        { tail -20 "$WORK/build.log"; exit 1; }
fi

left() { echo $(( LIMIT - ($(date +%s) - T0) - 40 )); }
bench() {
    local b
    b=$(left)
    if [ "$b" -lt 60 ]; then echo "== skipped (time): frmps bench $*"; return; fi
    echo "== frmps bench $* (budget ${b}s)"
    bin/frmps bench --python "$PY" "$@" --out "$RESULTS" --workdir "$WORK" --budget "$b" ${BENCH_ARGS:-}
    echo "== exit $? after $(( $(date +%s) - T0 ))s"
}

for slot in "$@"; do
    case "$slot" in
    s1) bench recovery --models qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b ;;
    s2) bench recovery --models qwen2.5-7b,qwen2.5-14b ;;
    s3) bench sync-overhead; bench standby-memory ;;
    s4) bench prompt-length ;;
    s5) bench since-sync --systems frmps-n1,frmps-n16 ;;
    s6) bench since-sync --systems frmps-no-kv; bench outage ;;
    s7) bench correctness ;;
    x:*) bench ${slot#x:} ;;  # one experiment with its flags: "x:recovery --models qwen2.5-3b"
    quick) bench recovery --quick --models qwen2.5-0.5b,qwen2.5-14b; bench sync-overhead --quick --models qwen2.5-0.5b,qwen2.5-14b ;;
    smoke)  # every experiment once on 0.5B, into <RESULTS>-smoke: run first, to catch GPU-only problems cheaply
        R0=$RESULTS; RESULTS=$R0-smoke; mkdir -p "$RESULTS"
        bench recovery --models qwen2.5-0.5b --trials 1 --cold-cache warm
        bench sync-overhead --models qwen2.5-0.5b --quick
        bench standby-memory --models qwen2.5-0.5b
        bench correctness --ks 4
        bench since-sync --model qwen2.5-0.5b --ks 4
        bench prompt-length --model qwen2.5-0.5b --lengths 500
        bench outage --model qwen2.5-0.5b --duration 8
        bin/frmps bench --python "$PY" report --out "$RESULTS" >/dev/null
        RESULTS=$R0 ;;
    *) echo "unknown slot $slot (smoke, s1..s7, quick, x:<experiment> <flags>)"; exit 2 ;;
    esac
done

bench_report() { bin/frmps bench --python "$PY" report --out "$RESULTS" >/dev/null; }
bench_report
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp -r "$RESULTS" "$OUT/"
    [ -d "$RESULTS-smoke" ] && cp -r "$RESULTS-smoke" "$OUT/"
    for f in "$WORK"/logs-*/*.log "$WORK"/baseline-logs/*.log "$WORK"/*.log; do
        [ -f "$f" ] && { echo "=== $f"; grep -v '^\s*$' "$f" | tail -n 30; }
    done > "$OUT/logs_tail.txt" 2>&1
fi
echo "== done in $(( $(date +%s) - T0 ))s; results in $RESULTS; MPS processes left: $(ps -eo comm | grep -c '^nvidia-cuda-mps')"
