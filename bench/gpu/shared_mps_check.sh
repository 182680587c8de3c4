#!/bin/bash
# frmps on an MPS daemon that belongs to the operator (frmps serve --mps-pipe-dir),
# on the GPU machine. The script plays the operator: it starts an MPS control
# daemon outside frmps, runs bench/gpu/failover_proof.py against it (qwen2.5-0.5b;
# a co-tenant MPS client of that daemon faults mid-stream, then the promoted engine
# faults in its own context), checks that every failover happened and that frmps
# never started, stopped or restarted the daemon (same control daemon pid
# throughout; MPS servers are restarted by the control daemon itself), and quits the
# daemon at the end.
# Usage: OUT=<dir> bench/gpu/shared_mps_check.sh ["<faults>" [<max_tokens>]]
# Needs bin/frmps built where Go is (CGO_ENABLED=0 go build -o bin/frmps ./cmd/frmps)
# and nvcc for the fault triggers. Results: $OUT/summary.txt (ends with PASS/FAIL),
# $OUT/proof-shared.json, $OUT/mps-control.log, $OUT/logs_tail.txt.
set -u
# Stopped by a bound (SIGTERM to the process group): the Python check unwinds and
# stops its frmps; this script then still writes its logs and cleans up.
trap 'echo "stopped by SIGTERM (a time bound)" >> "${OUT:-.}/summary.txt"' TERM
OUT=${OUT:-bench/build/shared-mps}
FAULTS=${1:-misaligned:load,oob_write:write}
MAXTOK=${2:-512}
MODEL=${MODEL:-qwen2.5-0.5b}
BASE=/tmp/frmps-operator-mps
PIPE=$BASE/pipe
LOGD=$BASE/log
mkdir -p "$OUT"
S=$OUT/summary.txt
verdict=PASS
fail() { echo "FAIL: $*" | tee -a "$S"; verdict=FAIL; }
ctl() { echo "$1" | CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD timeout 20 nvidia-cuda-mps-control; }
ctl_pid() { cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.used,memory.total --format=csv,noheader
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
} > "$S" 2>&1
if make -C interceptor all > "$OUT/build.log" 2>&1 && make -C bench/faults >> "$OUT/build.log" 2>&1; then
    echo "build OK" >> "$S"
else
    fail "build"; tail -20 "$OUT/build.log" >> "$S"
fi

# The operator's daemon, started outside frmps (as a service or a Kubernetes MPS
# daemon would be): its own pipe and log directories, not writable by others.
[ -n "$(ctl_pid)" ] && ctl quit > /dev/null 2>&1
rm -rf "$BASE"; mkdir -p "$PIPE" "$LOGD"; chmod 755 "$BASE" "$PIPE" "$LOGD"
CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD nvidia-cuda-mps-control -d
sleep 1
PID0=$(ctl_pid)
echo "operator's MPS control daemon: pid ${PID0:-none}, pipe $PIPE; get_server_list: '$(ctl get_server_list)'" | tee -a "$S"
[ -n "$PID0" ] && kill -0 "$PID0" 2>/dev/null || fail "the operator's daemon did not start"

timeout 1800 python3 bench/gpu/failover_proof.py --frmps bin/frmps --model "$MODEL" --faults "$FAULTS" \
    --mps-pipe-dir "$PIPE" --mps-log-dir "$LOGD" --workdir /tmp/frmps-shared --out "$OUT/proof-shared.json" \
    --max-tokens "$MAXTOK" --inject-after 100000 --stop-on-error 2>&1 | tee -a "$S"
[ "${PIPESTATUS[0]}" = 0 ] || fail "failover_proof.py exited non-zero"

PID1=$(ctl_pid)
echo "after: control daemon pid ${PID1:-none} (was $PID0); get_server_list: '$(ctl get_server_list)'" | tee -a "$S"
[ -n "$PID1" ] && [ "$PID1" = "$PID0" ] && kill -0 "$PID1" 2>/dev/null || fail "the control daemon is not the one the operator started"
python3 - "$OUT/proof-shared.json" <<'PY' | tee -a "$S" || verdict=FAIL
import json, sys
r = json.load(open(sys.argv[1]))
bad = 0
for e in r["faults"]:
    for phase in ("first", "second"):
        p = e.get(phase)
        if p is None:
            continue
        rec, ex = p.get("record") or {}, p.get("exact") or {}
        ok = bool(rec.get("ok")) and ex.get("errors", 1) == 0 and ex.get("text_equal") == ex.get("requests")
        bad += not ok
        print(f"{e['fault']} {phase}: failover ok={rec.get('ok')} cause={rec.get('cause')} "
              f"texts {ex.get('text_equal')}/{ex.get('requests')} errors {ex.get('errors')}")
    if e.get("error"):
        bad += 1
        print(f"{e['fault']}: ERROR {e['error']}")
sys.exit(1 if bad or not r["faults"] else 0)
PY
# frmps must not have asked this daemon to start, quit or restart anything.
if grep -h -i -E "restarting it|mps daemon (started|stopped)" /tmp/frmps-shared/logs-*/frmps.log > "$OUT/frmps-mps-lines.txt" 2>/dev/null; then
    fail "frmps logged starting/stopping an MPS daemon: $(head -3 "$OUT/frmps-mps-lines.txt")"
fi
grep -h "joined the operator's mps daemon\|leaving the operator's mps daemon" /tmp/frmps-shared/logs-*/frmps.log | head -4 >> "$S"
cp "$LOGD/control.log" "$OUT/mps-control.log" 2>/dev/null
cp "$LOGD/server.log" "$OUT/mps-server.log" 2>/dev/null
echo "MPS servers started by the control daemon over the run: $(grep -c -i "starting new server" "$LOGD/control.log" 2>/dev/null)" | tee -a "$S"
for f in /tmp/frmps-shared/logs-*/*.log; do echo "=== $f"; grep -v '^\s*$' "$f" | tail -n 25; done > "$OUT/logs_tail.txt" 2>&1

ctl quit > /dev/null
for _ in $(seq 50); do kill -0 "$PID0" 2>/dev/null || break; sleep 0.2; done
kill -0 "$PID0" 2>/dev/null && fail "the operator's daemon did not quit"
echo "daemon quit; MPS processes left: $(ps -eo comm | grep -c '^nvidia-cuda-mps')" | tee -a "$S"
echo "== shared MPS check: $verdict" | tee -a "$S"
[ "$verdict" = PASS ]
