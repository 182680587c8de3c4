#!/bin/bash
# The serving comparison on a GPU machine, in pieces that each fit one bounded
# command (the pieces append to one results directory; `report` rebuilds it):
#
#   OUT=<dir> bench/serving/gpu_stage.sh plan sweep-vllm sweep-frmps report
#   OUT=<dir> bench/serving/gpu_stage.sh equal-kv:40000 faults report
#
# Pieces:
#   plan                   print every command line and the estimate (starts nothing)
#   model                  the seeded checkpoint of $MODEL, written once into $WORK/models (other pieces call it)
#   sweep-vllm             the sweep for vllm serve, alone and as an MPS client
#   sweep-frmps            the sweep for frmps serve (Go front door) and frmps serve --frontend vllm
#   sweep:<systems>        the sweep for a comma list of systems
#   equal-kv:<blocks>[:<systems>]  the sweep again with <blocks> KV blocks for every system (default: all four)
#   faults[:<spacings>[:<systems>]]  fault mode: $FAULT_RATE req/s for $WINDOW_S s per system, a fault every
#                          <spacing> s (default 60,15: one spacing shorter than frmps's restore)
#   report                 results.json, README.md and the plots of $OUT
#
# Settings (environment): MODEL (preset, qwen2.5-7b), MODEL_DIR (default: its seeded checkpoint in
# $WORK/models), RATES (4,16,inf), TRIALS (3), TRIAL_S (8), INPUT_LEN (512), OUTPUT_LEN (128),
# RANGE_RATIO (0.5), PY_SPY (0; 1: after each system's trials one more saturation run, not counted, with
# py-spy sampling its engine process: raw/profile-<system>-<view>.stacks; PY_SPY_VIEWS, default idle: cpu, gil,
# idle, one run each; PY_SPY_RATE, default inf: the profile runs' request rate), INF_PROMPTS and INF_CONCURRENCY
# (0, 0: the saturation trial sends its requests at once; INF_CONCURRENCY=N keeps at most N in flight), AFTER_FAILOVER (0; 1: each frmps system's
# trials again after a failover drill and its failback, as <system>+failover), MAX_NUM_SEQS, MAX_BATCHED, MAX_MODEL_LEN (0: every system at vllm serve's defaults, what a
# user of either gets without a flag), FAULT_RATE (4),
# WINDOW_S (180), LIMIT_S (570: each piece is stopped past it; the harness then stops its servers
# and MPS daemons). Needs bin/frmps (built elsewhere with CGO_ENABLED=0), python3 with vLLM 0.26.0
# (or VLSITE, put ahead of PYTHONPATH, as bench/gpu/session.sh does), and for faults the triggers
# built by `make -C bench/faults` (session.sh prep builds them).
set -u
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-bench/build/serving}
WORK=${WORK:-/tmp/frmps-session}
VLSITE=${VLSITE:-}
MODEL=${MODEL:-qwen2.5-7b}
RATES=${RATES:-4,16,inf}
TRIALS=${TRIALS:-3}
TRIAL_S=${TRIAL_S:-8}
FAULT_RATE=${FAULT_RATE:-4}
WINDOW_S=${WINDOW_S:-180}
LIMIT_S=${LIMIT_S:-570}
mkdir -p "$OUT" "$WORK"
S=$OUT/serving-stages.txt
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$S"; }

export PYTHONPATH=${VLSITE:+$VLSITE:}$PWD/vllmpatch/src:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

# shellcheck source=bench/gpu/bounded.sh
. "$(dirname "${BASH_SOURCE[0]}")/../gpu/bounded.sh"

model_dir() {
    if [ -n "${MODEL_DIR:-}" ]; then echo "$MODEL_DIR"; return; fi
    python3 -m frmps_engine.cli model-dir "$MODEL" --weights seeded --out "$WORK/models/$MODEL-seeded"
}

common() {  # the flags every piece gives the harness
    echo --model "$1" --out "$OUT" --python python3 --input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}" \
        --range-ratio "${RANGE_RATIO:-0.5}" --max-num-seqs "${MAX_NUM_SEQS:-0}" \
        --max-num-batched-tokens "${MAX_BATCHED:-0}" --max-model-len "${MAX_MODEL_LEN:-0}"
}

steady() {  # the sweep's saturation trials: INF_PROMPTS requests, at most INF_CONCURRENCY in flight (0: one burst)
    echo --inf-prompts "${INF_PROMPTS:-0}" --inf-concurrency "${INF_CONCURRENCY:-0}"
}

sweep() {  # name systems [more flags]
    local name=$1 systems=$2 m t0=$SECONDS
    shift 2
    m=$(model_dir) || { log "$name: no model directory"; return; }
    log "$name: $systems, rates $RATES, $TRIALS trials of ${TRIAL_S}s $*"
    # shellcheck disable=SC2046
    local spy=()  # PY_SPY=1: one more saturation run per system with its engine process sampled
    [ "${PY_SPY:-0}" = 1 ] && command -v py-spy > /dev/null && spy=(--py-spy "$(command -v py-spy)" --py-spy-views "${PY_SPY_VIEWS:-idle}" --py-spy-rate "${PY_SPY_RATE:-inf}")
    [ "${AFTER_FAILOVER:-0}" = 1 ] && spy+=(--after-failover)  # frmps systems: the trials again after a failover drill
    bounded "$LIMIT_S" bin/frmps bench serving sweep $(common "$m") $(steady) --systems "$systems" --rates "$RATES" \
        --trials "$TRIALS" --trial-s "$TRIAL_S" "${spy[@]}" "$@" >> "$OUT/serving-$name.out" 2>&1
    log "$name: rc=$? in $((SECONDS - t0)) s"
    tail -n 6 "$OUT/serving-$name.out" >> "$S"
}

for st in "$@"; do
    IFS=: read -r name a b <<< "$st"
    case "$name" in
        model)
            t0=$SECONDS
            if m=$(model_dir); then log "model: $m ($((SECONDS - t0)) s)"; else log "model: FAILED"; fi ;;
        plan)
            m=$(model_dir) || { log "plan: no model directory"; continue; }
            # shellcheck disable=SC2046
            bin/frmps bench serving sweep $(common "$m") $(steady) --rates "$RATES" --trials "$TRIALS" --trial-s "$TRIAL_S" \
                --dry-run > "$OUT/serving-plan.txt" 2>&1
            # shellcheck disable=SC2046
            bin/frmps bench serving faults $(common "$m") --rate "$FAULT_RATE" --window-s "$WINDOW_S" --dry-run \
                >> "$OUT/serving-plan.txt" 2>&1
            grep '^# estimate' "$OUT/serving-plan.txt" | tee -a "$S" ;;
        sweep-vllm) sweep sweep-vllm vllm-serve,vllm-serve-mps ;;
        sweep-frmps) sweep sweep-frmps frmps,frmps-vllm-frontend ;;
        sweep) sweep "sweep-${a//,/+}" "$a" ;;
        equal-kv) sweep "equal-kv-$a" "${b:-vllm-serve,vllm-serve-mps,frmps,frmps-vllm-frontend}" --kv-blocks "$a" ;;
        faults)
            m=$(model_dir) || { log "faults: no model directory"; continue; }
            t0=$SECONDS
            log "faults: ${FAULT_RATE} req/s, ${WINDOW_S}s per system, spacing ${a:-60,15}"
            # shellcheck disable=SC2046
            bounded "$LIMIT_S" bin/frmps bench serving faults $(common "$m") --rate "$FAULT_RATE" --window-s "$WINDOW_S" \
                --spacing-s "${a:-60,15}" --systems "${b:-vllm-serve-mps-restart,frmps,frmps-vllm-frontend}" \
                >> "$OUT/serving-faults.out" 2>&1
            log "faults: rc=$? in $((SECONDS - t0)) s"
            tail -n 6 "$OUT/serving-faults.out" >> "$S" ;;
        report) bin/frmps bench serving report "$OUT" >> "$S" 2>&1; log "report: rc=$?" ;;
        *) log "unknown piece $st" ;;
    esac
done
# By the program's name (the control daemon and the server alike): none may be left.
mps_procs() { ps -eo pid,ppid,etimes,comm,args | awk '$4 ~ /^nvidia-cuda-mps/'; }
for _ in $(seq 20); do [ -z "$(mps_procs)" ] && break; sleep 0.5; done
echo "MPS processes left: $(mps_procs | grep -c .)" | tee -a "$S"
