#!/bin/bash
# One GPU-machine session: stages run in order, each bounded, each appending a
# line to $OUT/summary.txt; a failed stage does not stop the next one.
#
#   OUT=<dir> bench/gpu/session.sh prep ref-failback:qwen2.5-14b:20:330 vllm-failback:qwen2.5-0.5b:10:300 pack
#   OUT=<dir> bench/gpu/session.sh prep bench:vllm:recovery:qwen2.5-0.5b:500 bench:ref:recovery:qwen2.5-0.5b pack
#   OUT=<dir> bench/gpu/session.sh prep ref-tp:qwen2.5-7b:10:300 pack        (a machine with 2 GPUs)
#
# Stages:
#   prep                               environment, builds (interceptor, fault triggers), commit
#   ref-failback:<model>:<n>:<budget>[:<timeout>]  bench/gpu/failback_proof.py, reference engine, n faults,
#                                      no new fault after budget seconds of faults; the stage is killed after
#                                      timeout seconds (default budget + 330)
#   vllm-failback:<model>:<n>:<budget>[:<timeout>] the same with --engine vllm on a `frmps model init` directory
#   ref-soak:…, vllm-soak:…            the same as a soak: no minimum spacing between faults, the crash-loop
#                                      breaker widened, two spares (--spares 2), resources (fds, threads,
#                                      children, /dev/shm, GPU memory) sampled after every cycle
#   ref-tp:<model>:<n>:<budget>[:<timeout>]  bench/gpu/tp_proof.py: the reference engine with --tensor-parallel-size 2
#                                      on GPUs 0 and 1 (one MPS daemon for both), n faults by MPS clients pinned to
#                                      GPU 0 and GPU 1 alternately; timeout as for ref-failback
#   vllm-tp-failback:<model>:<n>:<budget>[:<timeout>]  the same as ref-tp with --engine vllm (default
#                                      timeout budget + 600)
#   vllm-tp:<model>:<batches>[:<timeout>[:<modes>]] bench/gpu/vllm_throughput.py (frmps + vLLM against vLLM alone;
#                                      default 300 s; modes: --frmps-modes, e.g. sync,async)
#   bench:<engine>:<experiment>:<models>[:<budget>[:<flags>]]  `frmps bench <experiment> --engine <engine>` (ref, vllm; for
#                                      sync-overhead also ref+vllm: both engines in one run) on <models> (comma list),
#                                      results appended to $RESULTS (default $OUT/bench-results: one folder for the
#                                      session, both engines side by side; a re-run resumes), --budget <budget> s
#                                      (default 540); the stage is killed 60 s after its budget; <flags>: more of
#                                      the experiment's flags, '+' for a space (e.g. --trials+1+--cold-cache+dropped;
#                                      faults by program alone, as ':' ends the field: --fault+all,
#                                      --fault+misaligned,shared_oob)
#   vllm-frontend-failback:<model>:<n>:<budget>[:<timeout>]  vllm-failback through vLLM's own API server as the
#                                      front door (frmps serve --frontend vllm): the same streams, faults, checks
#   openai-matrix:<model>[:<timeout>]  bench/openai_matrix.py against `vllm serve`, `frmps serve` (Go front door) and `frmps serve --engine vllm
#                                      --frontend vllm` on the same model directory (default 900 s); the table in
#                                      $OUT/openai-matrix.md. Both need the API server's packages: .gpu/wheels-server
#                                      (bench/gpu/server-wheels.sh downloads them; installed into VLSITE by prep);
#                                      env:MATRIX_SYSTEMS=<list>: which of vllm-serve, frmps-vllm, frmps-go (default all)
#   openai-faults:<model>:<n>[:<timeout>[:<frontend>[:exact]]]  bench/gpu/openai_fault_proof.py: the matrix's features (n, logprobs, echo,
#                                      penalties, stop, min_tokens, JSON schema, regex, tool calls, Responses) in flight
#                                      through `frmps serve --frontend <frontend>` (vllm, the default, or frmps)
#                                      while n real MPS faults hit the active;
#                                      each compared with its no-fault result (default timeout 900 s); exact: on the
#                                      seeded checkpoint (stage seeded:<model> first) with frmps serve --exact, so that
#                                      the comparison sees the KV cache and does not depend on the batch;
#                                      env:OPENAI_FAULTS_ARGS=<flags>: more of the proof's flags (e.g. --cases=a,b)
#   openai-cases-vllm:<model>[:<timeout>[:exact]]  the OpenAI fault proof's cases (OPENAI_FAULTS_ARGS too) with no
#                                      fault, twice, against `vllm serve` alone on the model (exact: the seeded checkpoint,
#                                      VLLM_BATCH_INVARIANT=1, Triton attention, Inductor's deterministic mode and no combo
#                                      kernels in its compilation config, as frmps serve --exact runs vLLM's engines, less
#                                      their pin of the mode for frames compiled after the model), with
#                                      the proof deployment's sizes: does vLLM itself complete every case
#                                      ($OUT/openai-cases-vllm-<model>[-exact].json; default timeout 600 s)
#   hang[:<timeout>], shared-mps[:<timeout>]  bench/gpu/hang_check.sh, shared_mps_check.sh (default 300 s)
#   env:<NAME>=<value>                 exported for the stages after it (e.g. env:VLLM_USE_MEGA_AOT_ARTIFACT=1;
#                                      env:CONTROLS=off|on|<cases>: the proofs' negative controls (failback, soak,
#                                      tp, openai-faults, bench correctness): before the real run at each model, one
#                                      short deployment per case with FRMPS_TEST_TAKEOVER_FAULT=<case> and one fault;
#                                      the proof stops with an error when one compares exact (default on; off is for
#                                      debugging and the results say so); env:CONTROL_S=<s>: the seconds the stages'
#                                      default timeouts add for them (default 900);
#                                      env:FAILBACK_DRILLS=2: the failback/soak stages first run that many admin
#                                      failover drills, no GPU fault, each with its failback: failback_proof --drills;
#                                      env:FAILBACK_SERVE_FLAGS=--prime-fault-path: more `frmps serve` flags for them,
#                                      space-separated; env:WORK=<dir>: the stages after it keep their logs there,
#                                      so that a second run of a stage does not overwrite the first's: the folder
#                                      is created, and `pack` packs only the last WORK)
#   py:<script>[:<timeout>]            python3 bench/gpu/<script> with vLLM's environment (a probe; default
#                                      120 s), its output into $OUT/<script without .py>.out
#   start-profile                      the engines started after it run py-spy on their own start
#                                      (FRMPS_DEBUG_STARTUP_PROFILE=$OUT/start-profile); pack sums them per function
#                                      (bench/gpu/start_profile.py: $OUT/start-profile.txt, .json)
#   seeded:<model>                     the KV-sensitive seeded checkpoint (frmps model init <model> --weights seeded)
#                                      into $WORK/models/<model>-seeded, once; the stages below with a model read it
#   sensitivity:<model>[:<timeout>]    bench.sensitivity on that checkpoint with vLLM (env:SENS_BASELINES=1:
#                                      also the uniform +-1e-3 and normal(0, 0.02) baselines): does the output depend on the
#                                      context? ($OUT/sensitivity-<model>.json)
#   weights-check:<model>[:<timeout>]  bench/gpu/weights_check.py: the weights pool (active, mapped standby) and a plain
#                                      vLLM load checksummed against the checkpoint's file, with a perturbed-file control
#   quick-start:<model>:<n>:<budget>[:<timeout>]  failback_proof.py --quick-start on the seeded checkpoint: `frmps serve
#                                      --model DIR` as the README's GPU quick start starts it, the negative controls first,
#                                      n real MPS faults with failback, the streams in flight at each counted
#   quick-start-preset:<model>[:<timeout>]  `frmps serve --model <preset>` (no other flag): resolved choices, KV budget
#                                      and one completion, from status and the log; then the same with a bad --vllm-arg,
#                                      which must exit 1 after one engine start
#   controls:<engine>:<model>[:<timeout>]  bench/gpu/controls_check.py on the seeded checkpoint: each negative control
#                                      detected, the positive run exact
#   margin:<model>[:<timeout>]         bench/gpu/margin_bound.py on the seeded checkpoint (alone vs in a batch)
#   bi-margin:<model>[:<timeout>]      margin_bound.py with VLLM_BATCH_INVARIANT=1 in three variants (eager; Triton
#                                      attention; both), 16 prompts of 96 tokens: which one is batch-invariant here
#                                      (frmps serve --exact asks for Triton attention, compiled); env:BI_VARIANTS=
#                                      triton-aot,triton-aot-load: Triton attention with vLLM's AOT compile kept on
#                                      (FRMPS_DEBUG_BI_KEEP_AOT), saved by the first run and loaded by the second
#   exact-proof:<model>:<n>:<budget>[:<timeout>]  failback_proof.py --quick-start --exact on the seeded checkpoint:
#                                      `frmps serve --model DIR --exact` as the README shows it, the controls (one
#                                      deployment), then n real MPS faults with failback, every stream compared token
#                                      for token; env:EXACT_PROOF_ARGS: more of its flags, '+' between words
#                                      (--kv-digests: the engines' KV digests at every handover and adoption,
#                                      checked after the run; e.g. --kv-digests+--max-tokens+48)
#   engine-repeat:<model>[:<n>[:<timeout>[:<opts>]]]  bench/gpu/margin_bound.py in n fresh processes (default 4) on the
#                                      seeded checkpoint with --exact's settings (VLLM_BATCH_INVARIANT=1,
#                                      TORCHINDUCTOR_DETERMINISTIC=1, Triton attention), each one's outputs into one token-log
#                                      folder, compared across the processes by bench.token_logs
#                                      ($OUT/engine-repeat-<model>[-<opts>].json); opts, '+' between them: mps: inside a
#                                      private MPS daemon (frmps bench mps); fresh: each process its own empty vLLM cache
#                                      root (it compiles everything itself); timed: Inductor times its reductions'
#                                      candidates (TORCHINDUCTOR_DETERMINISTIC unset); env:ENGINE_REPEAT_ARGS: margin_bound's sizes
#                                      (default --prompts 12 --fillers 12 --max-tokens 128); timeout per process (900 s)
#   k-sweep:<model>[:<budget>[:<ks>]]   `frmps bench correctness --engine vllm --exact` on the seeded checkpoint (stage
#                                      seeded:<model> first): greedy and seeded outputs after a real MPS fault at
#                                      token K equal the no-fault ones, K = 1..1024 (or <ks>, '+' between them), the
#                                      negative controls first (env:CONTROLS); results into $RESULTS as bench:...
#   serving:<model>:<pieces>[:<timeout>]  bench/serving/gpu_stage.sh (the serving comparison beside `vllm serve`)
#                                      on <model> with the given pieces, '+' between them and '/' for their ':'
#                                      (e.g. sweep/vllm-serve,vllm-serve-mps,frmps,frmps-vllm-frontend+faults/60+report);
#                                      results in $OUT/serving-<model>, or $OUT/serving-<model>-<tag> after
#                                      env:SERVING_TAG=<tag> (a second run of a system beside the first: e.g. with
#                                      vLLM's compile cache filled by the first); default timeout 1800 s, each
#                                      piece bounded by gpu_stage.sh's LIMIT_S too
#   pack                               every log of this session into $OUT/logs.tar.gz
# vLLM stages need vLLM 0.26.0: importable by python3, or installed into the directory VLSITE names
# (put ahead of PYTHONPATH).
# Needs bin/frmps (built elsewhere with CGO_ENABLED=0: the GPU machine has no Go).
# Several sessions can run at once on a machine with several GPUs, one GPU each: run `prep` once,
# then per GPU CUDA_VISIBLE_DEVICES=<its UUID> (MPS remaps indices: a UUID names the same GPU to the
# MPS daemon, its clients and the standby outside it), its own OUT and WORK (default
# /tmp/frmps-session) and, for vLLM stages, its own VLLM_CACHE_ROOT.
set -u
OUT=${OUT:-bench/build/session}
VLSITE=${VLSITE:-}
WORK=${WORK:-/tmp/frmps-session}
CONTROLS=${CONTROLS:-on}
CONTROL_S=${CONTROL_S:-900}
BI_VARIANTS=${BI_VARIANTS:-eager,triton,triton-eager}
RESULTS=${RESULTS:-$OUT/bench-results}
# The structured-outputs config of the OpenAI stages' servers (--structured-outputs-config, as vllm serve spells it).
SO_CONFIG='{"backend": "xgrammar", "disable_any_whitespace": true}'
mkdir -p "$OUT" "$WORK"
S=$OUT/summary.txt
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$S"; }

# shellcheck source=bench/gpu/bounded.sh
. "$(dirname "${BASH_SOURCE[0]}")/bounded.sh"
export PYTHONUNBUFFERED=1

ctl_s() { [ "$CONTROLS" = off ] && echo 0 || echo "$CONTROL_S"; }  # the controls' share of a stage's default timeout

nblocks() { case "$1" in *0.5b|*1.5b|*3b) echo 2048 ;; *7b) echo 2048 ;; *14b) echo 1536 ;; *) echo 1024 ;; esac; }

stage_prep() {
    {
        date -u
        nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,compute_mode --format=csv,noheader
        python3 -c "import torch,triton;print('torch',torch.__version__,'cuda',torch.version.cuda,'triton',triton.__version__)"
        nvcc --version | tail -1
        echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
        bin/frmps version
        PYTHONPATH=${VLSITE:-} python3 -c "import importlib.metadata as m; print('vllm', m.version('vllm'))"
    } >> "$S" 2>&1
    # The ring's compiled CRC (the pinned crc32c; without it the engines checksum
    # with numpy, 1.8 ms instead of 0.4 ms per step at batch 64): a wheel carried in
    # .gpu/wheels (see README.md), installed into the machine's Python.
    if ! python3 -c "import crc32c" 2>/dev/null; then
        if compgen -G ".gpu/wheels/crc32c-*.whl" > /dev/null; then
            python3 -m pip install -q --no-index --no-deps .gpu/wheels/crc32c-*.whl >> "$S" 2>&1 && log "prep: crc32c installed"
        else
            log "prep: no crc32c package and no wheel in .gpu/wheels: ring checksums in numpy (slower)"
        fi
    fi
    # py-spy (a sampling profiler, for the throughput stage's engine profile): a wheel in .gpu/wheels.
    if ! command -v py-spy > /dev/null && compgen -G ".gpu/wheels/py_spy-*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps .gpu/wheels/py_spy-*.whl >> "$S" 2>&1 && log "prep: py-spy installed"
    fi
    # vLLM's API server packages (uvicorn, aiohttp, ...), left out of the offline
    # bundle: wheels carried in .gpu/wheels-server, installed beside vLLM.
    if [ -n "$VLSITE" ] && compgen -G ".gpu/wheels-server/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$VLSITE" \
            .gpu/wheels-server/*.whl >> "$S" 2>&1 && log "prep: API server packages installed into VLSITE"
        # vLLM's API server imports (a missing package shows here, not as a server that never answers)
        if PYTHONPATH=$VLSITE:$PWD/vllmpatch/src python3 -c "import vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.serve, frmps_engine.vllm.frontend.server" > "$WORK/import.log" 2>&1; then
            log "prep: vLLM's API server imports"
        else
            log "prep: vLLM's API server does NOT import"; tail -n 3 "$WORK/import.log" >> "$S"
        fi
    fi
    if make -C interceptor all > "$WORK/build.log" 2>&1 && make -C bench/faults >> "$WORK/build.log" 2>&1; then
        log "prep: build OK"
    else
        log "prep: build FAILED"; tail -20 "$WORK/build.log" >> "$S"
    fi
    [ -s "$WORK/ctx_mem.txt" ] || python3 bench/gpu/ctx_mem.py > "$WORK/ctx_mem.txt" 2>&1  # once per machine
    cat "$WORK/ctx_mem.txt" >> "$S"
}

vllm_env() {
    export PYTHONPATH=${VLSITE:+$VLSITE:}$PWD/vllmpatch/src VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}

model_dir() {  # writes the preset's directory once, prints it
    PYTHONPATH=$PWD/vllmpatch/src python3 -m frmps_engine.cli model-dir "$1" --out "$WORK/models/$1"
}

stage_failback() {  # engine model n budget [timeout [soak|frontend]]
    local engine=$1 model=$2 n=$3 budget=$4 limit=${5:-$(($4 + 330 + $(ctl_s)))} m=$2 extra=() soak=()
    if [ "${6:-}" = frontend ]; then
        soak=(--serve-arg=--frontend=vllm)
    fi
    if [ "${6:-}" = soak ]; then
        # Faults as fast as the placement is restored (and a spare is ready): the crash-loop
        # breaker is widened so that it does not stop re-arming; resources sampled every cycle.
        # Two spares: a vLLM spare imports for 23-34 s, longer than a restore (10-17 s), so with
        # one the faults would come at the spare's pace, not the restore's.
        soak=(--min-fault-interval 0 --serve-arg=--max-restarts=100000 --serve-arg=--spares=2)
    fi
    if [ "$engine" = vllm ]; then
        vllm_env
        m=$(model_dir "$model") || { log "vllm-failback $model: model-dir failed"; return; }
        extra=(--num-blocks "$(nblocks "$model")" --max-model-len 4096 --engine-arg=--max-num-seqs=16)
    else
        extra=(--engine-arg=--max-num-seqs=8)
    fi
    local f
    for f in ${FAILBACK_SERVE_FLAGS:-}; do extra+=("--serve-arg=$f"); done
    rm -rf "$WORK/$engine-$model"  # a fresh log dir: the proof reads the engines' logs by name
    log "$engine-failback $model: $n faults, budget ${budget}s"
    bounded "$limit" python3 bench/gpu/failback_proof.py --frmps bin/frmps --engine "$engine" --model "$m" \
        --faults "$n" --drills "${FAILBACK_DRILLS:-0}" --time-budget "$budget" --workdir "$WORK/$engine-$model" \
        --controls "$CONTROLS" --out "$OUT/$engine-$model.json" "${extra[@]}" "${soak[@]}" > "$WORK/$engine-$model.out" 2>&1
    log "$engine-failback $model: rc=$?"
    tail -n 25 "$WORK/$engine-$model.out" >> "$S"
    grep -E "^control |streams in flight at a fault" "$WORK/$engine-$model.out" >> "$S"
}

wait_http() {  # port seconds pid: until GET /v1/models answers; fails at once when pid has exited
    local t=0
    until python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/v1/models', timeout=2)" 2>/dev/null; do
        kill -0 "$3" 2>/dev/null || return 1
        t=$((t + 2)); [ "$t" -ge "$2" ] && return 1; sleep 2
    done
}

stop_group() {  # pid: SIGTERM its process group, SIGKILL after 60 s
    kill -TERM -- "-$1" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$1" 2>/dev/null; wait "$1" 2>/dev/null
}

run_matrix() {  # port model label name limit pid: the matrix against the server on port, once it answers
    if wait_http "$1" "$5" "$6"; then
        timeout "$5" python3 bench/openai_matrix.py --base-url "http://127.0.0.1:$1" --model "$2" --label "$3" \
            --out "$OUT/matrix-$4.json" > "$WORK/matrix-$4.out" 2>&1
        log "openai-matrix $3: rc=$?"
    else
        log "openai-matrix: $3 did not answer"; tail -n 30 "$WORK/matrix-$4.log" >> "$S"
    fi
}

start_group() {  # log cmd...: cmd in the background in a process group of its own (stop_group ends it), its pid in BG_PID
    local out=$1
    shift
    set -m
    "$@" > "$out" 2>&1 &
    BG_PID=$!
    set +m
}

matrix_system() {  # model name label port limit cmd...: one server of the matrix, started, run against, stopped
    local model=$1 name=$2 label=$3 port=$4 limit=$5
    shift 5
    log "openai-matrix $model: $label"
    start_group "$WORK/matrix-$name.log" "$@"
    run_matrix "$port" "$model" "$label" "$name" "$limit" "$BG_PID"
    stop_group "$BG_PID"
}

stage_matrix() {  # model [timeout]
    vllm_env
    local model=$1 limit=${2:-900} m
    m=$(model_dir "$model") || { log "openai-matrix $model: model-dir failed"; return; }
    local want=",${MATRIX_SYSTEMS:-vllm-serve,frmps-vllm,frmps-go},"
    if [[ $want == *,vllm-serve,* ]]; then
        matrix_system "$model" vllm-serve "vllm serve" 8100 "$limit" \
            python3 -m vllm.entrypoints.cli.main serve "$m" --port 8100 --served-model-name "$model" \
            --enable-auto-tool-choice --tool-call-parser hermes --max-model-len 4096 --load-format dummy \
            --structured-outputs-config "$SO_CONFIG" --gpu-memory-utilization 0.45
    fi
    if [[ $want == *,frmps-vllm,* ]]; then
        matrix_system "$model" frmps-vllm "frmps --frontend vllm" 8000 "$limit" \
            bin/frmps serve --engine vllm --frontend vllm --model "$m" --served-model-name "$model" --device cuda \
            --memory cuda-vmm --port 8000 --num-blocks "$(nblocks "$model")" --max-model-len 4096 --python python3 \
            --frontend-arg=--enable-auto-tool-choice --frontend-arg=--tool-call-parser=hermes \
            --vllm-arg=--structured-outputs-config="$SO_CONFIG" --engine-log-dir "$WORK/matrix-frmps-logs"
    fi
    if [[ $want == *,frmps-go,* ]]; then
        # The default front door (frmps's own) at the defaults, with the flags the feature rows need.
        matrix_system "$model" frmps-go "frmps (Go front door)" 8000 "$limit" \
            bin/frmps serve --model "$m" --served-model-name "$model" --port 8000 --max-model-len 4096 --python python3 \
            --enable-auto-tool-choice --tool-call-parser hermes --vllm-arg=--structured-outputs-config="$SO_CONFIG" \
            --engine-log-dir "$WORK/matrix-frmps-go-logs"
    fi
    python3 bench/openai_matrix.py --table "$OUT"/matrix-*.json > "$OUT/openai-matrix.md" 2>&1
    tail -n 45 "$OUT/openai-matrix.md" >> "$S"
}

stage_openai_faults() {  # model n [timeout] [frontend] [exact]
    vllm_env
    local model=$1 n=$2 limit=${3:-$((900 + $(ctl_s)))} fe=${4:-vllm} m exact=()
    local tag="$model-$fe"
    if [ "${5:-}" = exact ]; then
        m=$(seeded_for openai-faults "$model") || return
        exact=(--serve-arg=--exact) tag="$model-$fe-exact"
    else
        m=$(model_dir "$model") || { log "openai-faults $model: model-dir failed"; return; }
    fi
    rm -rf "$WORK/openai-faults-$tag"
    log "openai-faults $model ($fe front door${exact:+, seeded checkpoint, --exact}): $n faults"
    bounded "$limit" python3 bench/gpu/openai_fault_proof.py --frmps bin/frmps --python python3 --model "$m" \
        --served-model-name "$model" --faults "$n" --num-blocks "$(nblocks "$model")" --max-model-len 4096 \
        --frontend "$fe" --workdir "$WORK/openai-faults-$tag" --controls "$CONTROLS" --out "$OUT/openai-faults-$tag.json" \
        "${exact[@]}" ${OPENAI_FAULTS_ARGS:-} > "$WORK/openai-faults-$tag.out" 2>&1
    log "openai-faults $model ($fe): rc=$?"
    tail -n 30 "$WORK/openai-faults-$tag.out" >> "$S"
}

stage_openai_cases_vllm() {  # model [timeout] [exact]: the proof's cases against vllm serve alone
    vllm_env
    local model=$1 limit=${2:-600} m pid env=() flags=() tag=$1 cc
    if [ "${3:-}" = exact ]; then
        m=$(seeded_for openai-cases-vllm "$model") || return
        # Inductor's deterministic mode and no combo kernels in vLLM's compilation config, as the engines
        # get them (the mode alone with vLLM's combo-kernel benchmark stops the model's compile)
        cc=$(python3 -c 'import json; from frmps_engine.vllm.envpolicy import EXACT_INDUCTOR_CONFIG as c
print(json.dumps({"inductor_compile_config": c}))') || { log "openai-cases-vllm $model: no frmps_engine"; return; }
        env=(VLLM_BATCH_INVARIANT=1 TORCHINDUCTOR_DETERMINISTIC=1) tag=$model-exact
        flags=(--attention-backend TRITON_ATTN --compilation-config "$cc")
    else
        m=$(model_dir "$model") || { log "openai-cases-vllm $model: model-dir failed"; return; }
        flags=(--load-format dummy)
    fi
    log "openai-cases-vllm $tag: vllm serve ${env[*]} ${flags[*]}"
    start_group "$WORK/openai-cases-vllm-$tag.log" env "${env[@]}" python3 -m vllm.entrypoints.cli.main serve "$m" \
        --port 8100 --served-model-name "$model" --enable-auto-tool-choice --tool-call-parser hermes --max-model-len 4096 \
        --max-num-seqs 32 --num-gpu-blocks-override "$(nblocks "$model")" "${flags[@]}" --structured-outputs-config "$SO_CONFIG"
    pid=$BG_PID
    if wait_http 8100 "$limit" "$pid"; then
        timeout "$limit" python3 bench/gpu/openai_fault_proof.py --against http://127.0.0.1:8100 --model "$m" \
            --served-model-name "$model" ${OPENAI_FAULTS_ARGS:-} --out "$OUT/openai-cases-vllm-$tag.json" \
            > "$WORK/openai-cases-vllm-$tag.out" 2>&1
        log "openai-cases-vllm $tag: rc=$?"
        tail -n 6 "$WORK/openai-cases-vllm-$tag.out" | cut -c1-400 >> "$S"
        grep -hE "Failed to advance|grammar rejected" "$WORK/openai-cases-vllm-$tag.log" | head -4 | cut -c1-300 >> "$S"
    else
        log "openai-cases-vllm $tag: vllm serve did not answer"; tail -n 20 "$WORK/openai-cases-vllm-$tag.log" >> "$S"
    fi
    stop_group "$pid"
}

seeded_dir() {  # the seeded checkpoint of a preset, written once into $WORK/models; prints it
    PYTHONPATH=$PWD/vllmpatch/src python3 -m frmps_engine.cli model-dir "$1" --weights seeded --out "$WORK/models/$1-seeded"
}

seeded_for() {  # stage model: the seeded checkpoint for a stage, or a logged "none" and failure
    seeded_dir "$2" 2>/dev/null || { log "$1 $2: no seeded checkpoint" >&2; return 1; }
}

stage_seeded() {  # model
    local t0=$SECONDS m
    m=$(seeded_dir "$1" 2> "$WORK/seeded-$1.err") || { log "seeded $1: FAILED"; tail -n 5 "$WORK/seeded-$1.err" >> "$S"; return; }
    log "seeded $1: $m ($(du -sh "$m" | cut -f1), $((SECONDS - t0)) s)"
    cat "$m/frmps_weights.json" >> "$S" 2>/dev/null; echo >> "$S"
}

stage_sensitivity() {  # model [timeout]
    vllm_env
    local m
    m=$(seeded_for sensitivity "$1") || return
    local base=()
    [ "${SENS_BASELINES:-0}" = 1 ] && base=(--baselines --baseline-dir "$WORK/models/$1-baselines")
    log "sensitivity $1 (vLLM${base:+, with the uniform and normal(0, 0.02) baselines})"
    bounded "${2:-420}" python3 -m bench.sensitivity --model "$m" --engine vllm "${base[@]}" \
        --out "$OUT/sensitivity-$1.json" > "$WORK/sensitivity-$1.out" 2>&1
    log "sensitivity $1: rc=$?"; tail -n 12 "$WORK/sensitivity-$1.out" >> "$S"
}

stage_weights_check() {  # model [timeout]
    vllm_env
    local m
    m=$(seeded_for weights-check "$1") || return
    log "weights-check $1"
    bounded "${2:-420}" python3 bench/gpu/weights_check.py --frmps bin/frmps --model "$m" --workdir "$WORK/weights-$1" \
        --out "$OUT/weights-$1.json" > "$WORK/weights-$1.out" 2>&1
    log "weights-check $1: rc=$?"; tail -n 8 "$WORK/weights-$1.out" >> "$S"
}

stage_quick_start() {  # model n budget [timeout]
    vllm_env
    local model=$1 n=$2 budget=$3 limit=${4:-$(($3 + 330 + ${CONTROL_S:-900}))} m
    m=$(seeded_for quick-start "$model") || return
    rm -rf "$WORK/quick-$model"
    log "quick-start $model: frmps serve --model $m, controls ${CONTROLS:-on}, $n faults, budget ${budget}s"
    bounded "$limit" python3 bench/gpu/failback_proof.py --frmps bin/frmps --quick-start --model "$m" \
        --controls "${CONTROLS:-on}" --faults "$n" --time-budget "$budget" --workdir "$WORK/quick-$model" \
        --out "$OUT/quick-$model.json" > "$WORK/quick-$model.out" 2>&1
    log "quick-start $model: rc=$?"
    grep -E "^control |controls:|streams in flight|passed unnoticed|^error" "$WORK/quick-$model.out" | tail -n 12 >> "$S"
    tail -n 6 "$WORK/quick-$model.out" >> "$S"
}

stage_quick_start_preset() {  # model [timeout]: the README's command as written, then a bad vLLM flag
    vllm_env
    local model=$1 limit=${2:-300} pid rc t0
    log "quick-start-preset $model: bin/frmps serve --model $model"
    set -m  # exactly the README's command: the engines' logs go where frmps puts them (frmps status names them)
    bin/frmps serve --model "$model" > "$WORK/preset-$model.log" 2>&1 &
    pid=$!
    set +m
    if wait_http 8000 "$limit" "$pid"; then
        for _ in $(seq 60); do bin/frmps status > "$WORK/preset-$model.status" 2>&1 && grep -q standby "$WORK/preset-$model.status" && break; sleep 2; done
        python3 -c "import json,urllib.request as u; r=u.urlopen(u.Request('http://127.0.0.1:8000/v1/completions', data=json.dumps({'model': '$model', 'prompt': 'Hello', 'max_tokens': 16}).encode(), headers={'Content-Type': 'application/json'}), timeout=120); print('completion:', json.load(r)['choices'][0]['text'][:60].encode())" >> "$S" 2>&1
        grep -E "resolved:|kv cache|WEIGHTS|active|standby" "$WORK/preset-$model.status" >> "$S"
    else
        log "quick-start-preset $model: did not answer"; tail -n 20 "$WORK/preset-$model.log" >> "$S"
    fi
    local elog
    elog=$(awk '$1 == "active" {print $NF}' "$WORK/preset-$model.status" 2>/dev/null | head -n 1)
    grep -hE "resolved:|KV cache:|device memory with the active built|ring: a FULL" "$WORK/preset-$model.log" \
        ${elog:+"$(dirname "$elog")"/*.log} 2>/dev/null | cut -c1-400 | head -8 >> "$S"
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader >> "$S"
    stop_group "$pid"
    log "quick-start-preset $model: a bad --vllm-arg"
    t0=$SECONDS
    timeout "$limit" bin/frmps serve --model "$model" --vllm-arg=--no-such-flag > "$WORK/preset-bad.log" 2>&1
    rc=$?
    log "bad --vllm-arg: rc=$rc after $((SECONDS - t0)) s, engine launches: $(grep -c 'engine launched' "$WORK/preset-bad.log")"
    tail -n 1 "$WORK/preset-bad.log" | cut -c1-400 >> "$S"
}

stage_controls() {  # engine model [timeout]
    vllm_env
    local m
    m=$(seeded_for "controls $1" "$2") || return
    log "controls $1 $2"
    bounded "${3:-900}" python3 bench/gpu/controls_check.py --frmps bin/frmps --engine "$1" --model "$m" \
        --workdir "$WORK/controls-$1-$2" --out "$OUT/controls-$1-$2.json" > "$WORK/controls-$1-$2.out" 2>&1
    log "controls $1 $2: rc=$?"; tail -n 10 "$WORK/controls-$1-$2.out" >> "$S"
}

stage_margin() {  # model [timeout]
    vllm_env
    local m
    m=$(seeded_for margin "$1") || return
    log "margin $1"
    bounded "${2:-420}" python3 bench/gpu/margin_bound.py --model "$m" --out "$OUT/margin-$1.json" > "$WORK/margin-$1.out" 2>&1
    log "margin $1: rc=$?"; tail -n 8 "$WORK/margin-$1.out" >> "$S"
}

stage_engine_repeat() {  # model n [timeout [opts]]: do separate vLLM processes compute alike under --exact's settings?
    vllm_env
    local m n=${2:-4} limit=${3:-900} opts=${4:-} i d env=() ok=0 extra=() cache=""
    local sizes=${ENGINE_REPEAT_ARGS:---prompts 12 --fillers 12 --max-tokens 128}
    m=$(seeded_for engine-repeat "$1") || return
    for o in ${opts//+/ }; do
        case $o in
            mps|fresh) ;;
            timed) extra+=(--inductor-timing) ;;
            *) log "engine-repeat: unknown option $o (mps, fresh, timed)"; return ;;
        esac
    done
    d=$WORK/engine-repeat-$1${opts:+-${opts//+/-}}
    rm -rf "$d" && mkdir -p "$d/tokens"
    if [[ "+$opts+" == *+mps+* ]]; then
        mkdir -p "$d/run" && chmod 700 "$d/run"
        bin/frmps bench mps start --run-dir "$d/run" > "$d/mps.env" 2>&1 || { log "engine-repeat: MPS daemon: $(tail -n 2 "$d/mps.env")"; return; }
        mapfile -t env < <(grep -E '^CUDA_MPS_(PIPE|LOG)_DIRECTORY=' "$d/mps.env")
    fi
    log "engine-repeat $1: $n fresh vLLM processes (--exact's settings${extra:+, Inductor timing its reductions})${opts:+, $opts}, $sizes"
    for i in $(seq 1 "$n"); do
        # fresh: a cache root of its own, so that this process compiles (and times) everything itself
        [[ "+$opts+" == *+fresh+* ]] && cache=$d/cache-$i
        # shellcheck disable=SC2086
        ( if [ "${#env[@]}" -gt 0 ]; then export "${env[@]}"; fi  # the MPS daemon's client
          if [ -n "$cache" ]; then export VLLM_CACHE_ROOT=$cache; fi
          bounded "$limit" python3 bench/gpu/margin_bound.py --model "$m" --batch-invariant "${extra[@]}" \
            --attention-backend TRITON_ATTN $sizes \
            --token-log "$d/tokens" --out "$d/margin-$i.json" > "$d/run-$i.out" 2>&1 ) && ok=$((ok + 1))
        log "engine-repeat $1: run $i rc=$? $(tail -n 1 "$d/run-$i.out" | cut -c1-160)"
        [ -n "$cache" ] && rm -rf "$cache"
    done
    [ ${#env[@]} -gt 0 ] && bin/frmps bench mps stop --run-dir "$d/run" > /dev/null 2>&1
    python3 -m bench.token_logs "$d/tokens" --reference majority --json "$OUT/${d##*/}.json" \
        > "$d/token-logs.txt" 2>&1
    log "engine-repeat $1: $ok of $n runs finished; token logs: rc=$? (1: the processes' outputs differ)"
    i=$(find "$d/tokens" -name 'tokens-*.jsonl' | wc -l)
    [ "$i" -ge 2 ] || log "engine-repeat $1: only $i process(es) wrote outputs: nothing compared across processes"
    grep -E "^engine |completions of" "$d/token-logs.txt" | tail -n $((n + 1)) >> "$S"
}

stage_bi_margin() {  # model [timeout]: which batch-invariant vLLM configuration is batch-invariant here
    vllm_env
    local m v flags
    m=$(seeded_for bi-margin "$1") || return
    for v in ${BI_VARIANTS//,/ }; do
        case $v in
            eager) flags=(--enforce-eager) ;;
            triton) flags=(--attention-backend TRITON_ATTN) ;;
            triton-eager) flags=(--enforce-eager --attention-backend TRITON_ATTN) ;;
            # vLLM's AOT compile kept on (FRMPS_DEBUG_BI_KEEP_AOT): the first run saves the compiled
            # model, the second loads it, as an engine restored after a fault does
            triton-aot|triton-aot-load) flags=(--attention-backend TRITON_ATTN --keep-aot) ;;
            *) log "bi-margin: unknown variant $v"; continue ;;
        esac
        log "bi-margin $1 $v: VLLM_BATCH_INVARIANT=1 TORCHINDUCTOR_DETERMINISTIC=1 ${flags[*]}"
        bounded "${2:-240}" python3 bench/gpu/margin_bound.py --model "$m" --batch-invariant "${flags[@]}" --prompts 16 \
            --max-tokens 96 --out "$OUT/margin-$1-bi-$v.json" > "$WORK/margin-$1-bi-$v.out" 2>&1
        log "bi-margin $1 $v: rc=$?"; grep -E "prompts differ|Using .*backend|attention backend|AOT compil" "$WORK/margin-$1-bi-$v.out" | cut -c1-300 | tail -n 4 >> "$S"
    done
}

stage_exact_proof() {  # model n budget [timeout]
    vllm_env
    local model=$1 n=$2 budget=$3 limit=${4:-$(($3 + 330 + ${CONTROL_S:-900}))} m xa=${EXACT_PROOF_ARGS:-}
    m=$(seeded_for exact-proof "$model") || return
    rm -rf "$WORK/exact-$model"
    log "exact-proof $model: frmps serve --model $m --exact, controls ${CONTROLS:-on}, $n faults, budget ${budget}s"
    bounded "$limit" python3 bench/gpu/failback_proof.py --frmps bin/frmps --quick-start --exact --model "$m" \
        --controls "${CONTROLS:-on}" --faults "$n" --time-budget "$budget" \
        --workdir "$WORK/exact-$model" --out "$OUT/exact-$model.json" ${xa//+/ } > "$WORK/exact-$model.out" 2>&1
    log "exact-proof $model: rc=$?"
    grep -E "^control |controls:|streams in flight|passed unnoticed|KV digests|^error" "$WORK/exact-$model.out" | tail -n 14 >> "$S"
    tail -n 6 "$WORK/exact-$model.out" >> "$S"
}

stage_k_sweep() {  # model [budget [ks]]: stage bench on the seeded checkpoint, with --exact
    local m ks=${3:-}
    m=$(seeded_for k-sweep "$1") || return
    stage_bench vllm correctness "$m" "${2:-900}" "--exact${ks:++--ks+${ks//+/,}}"
}

stage_serving() {  # model pieces [timeout]: bench/serving/gpu_stage.sh's pieces, '+' between them, '/' for their ':'
    local model=$1 pieces=${2//+/ } limit=${3:-1800} dir=$OUT/serving-$1${SERVING_TAG:+-$SERVING_TAG}
    pieces=${pieces//\//:}
    log "serving $model: gpu_stage.sh $pieces (results in $dir)"
    # shellcheck disable=SC2086  # the pieces are separate words
    MODEL=$model OUT=$dir WORK=$WORK VLSITE=${VLSITE:-} bounded "$limit" bash bench/serving/gpu_stage.sh $pieces \
        > "$WORK/${dir##*/}.out" 2>&1
    log "serving $model: rc=$?"
    tail -n 15 "$WORK/${dir##*/}.out" >> "$S"
}

two_gpus() {  # what: fails (and logs why) on a machine with fewer than two GPUs
    local gpus
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
    [ "$gpus" -ge 2 ] && return 0
    log "$1: needs 2 GPUs, this machine has $gpus"
    return 1
}

stage_ref_tp() {  # model n budget [timeout]
    local model=$1 n=$2 budget=$3 limit=${4:-$(($3 + 330 + $(ctl_s)))}
    two_gpus "ref-tp $model" || return
    rm -rf "$WORK/ref-tp-$model"
    log "ref-tp $model: TP=2, $n faults, budget ${budget}s"
    bounded "$limit" python3 bench/gpu/tp_proof.py --frmps bin/frmps --model "$model" --tensor-parallel-size 2 \
        --faults "$n" --time-budget "$budget" --workdir "$WORK/ref-tp-$model" --out "$OUT/ref-tp-$model.json" --controls "$CONTROLS" \
        --engine-arg=--max-num-seqs=8 --num-blocks "$(nblocks "$model")" > "$WORK/ref-tp-$model.out" 2>&1
    log "ref-tp $model: rc=$?"
    tail -n 25 "$WORK/ref-tp-$model.out" >> "$S"
}

stage_vllm_tp() {  # model n budget [timeout]: vLLM with --tensor-parallel-size 2
    local model=$1 n=$2 budget=$3 limit=${4:-$(($3 + 600 + $(ctl_s)))} m
    two_gpus "vllm-tp-failback $model" || return
    vllm_env
    m=$(model_dir "$model") || { log "vllm-tp-failback $model: model-dir failed"; return; }
    rm -rf "$WORK/vllm-tp2-$model"
    log "vllm-tp-failback $model: TP=2, $n faults, budget ${budget}s"
    bounded "$limit" python3 bench/gpu/tp_proof.py --engine vllm --frmps bin/frmps --model "$m" --tensor-parallel-size 2 \
        --faults "$n" --time-budget "$budget" --workdir "$WORK/vllm-tp2-$model" --out "$OUT/vllm-tp2-$model.json" --controls "$CONTROLS" \
        --engine-arg=--max-num-seqs=16 --num-blocks "$(nblocks "$model")" --max-model-len 4096 \
        > "$WORK/vllm-tp2-$model.out" 2>&1
    log "vllm-tp-failback $model: rc=$?"
    tail -n 25 "$WORK/vllm-tp2-$model.out" >> "$S"
}

stage_bench() {  # engine experiment models [budget [flags]]
    local engine=$1 exp=$2 models=$3 budget=${4:-540} sel=() eng=() more=()
    [ -n "${5:-}" ] && read -r -a more <<< "${5//+/ }"
    vllm_env
    case "$exp" in
        recovery|sync-overhead|standby-memory) sel=(--models "$models") ;;
        *) sel=(--model "$models") ;;
    esac
    [ "$exp" = correctness ] && more+=(--controls "$CONTROLS")  # the K sweep's negative controls, first
    case "$engine" in
        ref+vllm) eng=(--engines ref,vllm) ;;  # sync-overhead: both engines in one run
        *) eng=(--engine "$engine") ;;
    esac
    mkdir -p "$RESULTS"
    log "bench $engine $exp $models ${more[*]} (budget ${budget}s) -> $RESULTS"
    bounded $((budget + 60)) bin/frmps bench --python python3 "$exp" "${eng[@]}" "${sel[@]}" "${more[@]}" --budget "$budget" \
        --out "$RESULTS" --workdir "$WORK/bench-$engine-$exp" --faults-dir bench/build/faults --no-plots \
        > "$WORK/bench-$engine-$exp.out" 2>&1
    log "bench $engine $exp: rc=$? (0: done; 2: a point failed; 3: stopped by the budget, run the stage again)"
    tail -n 12 "$WORK/bench-$engine-$exp.out" >> "$S"
}

stage_tp() {  # model batches [timeout] [modes]
    vllm_env
    local m
    m=$(model_dir "$1") || { log "vllm-tp $1: model-dir failed"; return; }
    log "vllm-tp $1 batches $2"
    local spy=()  # py-spy (a wheel in .gpu/wheels, installed by prep): the engine's threads at the largest batch
    command -v py-spy > /dev/null && spy=(--py-spy "$(command -v py-spy)")
    bounded "${3:-300}" python3 bench/gpu/vllm_throughput.py --frmps bin/frmps --model "$m" --batches "$2" \
        --num-blocks 4096 --frmps-modes "${4:-default}" --workdir "$WORK/tp-$1" --out "$OUT/vllm-tp-$1.json" \
        "${spy[@]}" > "$WORK/tp-$1.out" 2>&1
    log "vllm-tp $1: rc=$?"
    tail -n 8 "$WORK/tp-$1.out" >> "$S"
}

for st in "$@"; do
    IFS=: read -r name a b c d e <<< "$st"
    case "$name" in
        prep) stage_prep ;;
        ref-failback) stage_failback ref "$a" "$b" "$c" "$d" ;;
        vllm-failback) stage_failback vllm "$a" "$b" "$c" "$d" ;;
        ref-soak) stage_failback ref "$a" "$b" "$c" "$d" soak ;;
        vllm-soak) stage_failback vllm "$a" "$b" "$c" "$d" soak ;;
        vllm-frontend-failback) stage_failback vllm "$a" "$b" "$c" "$d" frontend ;;
        openai-matrix) stage_matrix "$a" "$b" ;;
        openai-faults) stage_openai_faults "$a" "$b" "$c" "$d" "$e" ;;
        openai-cases-vllm) stage_openai_cases_vllm "$a" "$b" "$c" ;;
        ref-tp) stage_ref_tp "$a" "$b" "$c" "$d" ;;
        vllm-tp-failback) stage_vllm_tp "$a" "$b" "$c" "$d" ;;
        vllm-tp) stage_tp "$a" "$b" "$c" "$d" ;;
        bench) stage_bench "$a" "$b" "$c" "$d" "$e" ;;
        seeded) stage_seeded "$a" ;;
        sensitivity) stage_sensitivity "$a" "$b" ;;
        weights-check) stage_weights_check "$a" "$b" ;;
        quick-start) stage_quick_start "$a" "$b" "$c" "$d" ;;
        quick-start-preset) stage_quick_start_preset "$a" "$b" ;;
        controls) stage_controls "$a" "$b" "$c" ;;
        margin) stage_margin "$a" "$b" ;;
        bi-margin) stage_bi_margin "$a" "$b" ;;
        engine-repeat) stage_engine_repeat "$a" "$b" "$c" "$d" ;;
        exact-proof) stage_exact_proof "$a" "$b" "$c" "$d" ;;
        k-sweep) stage_k_sweep "$a" "$b" "$c" ;;
        serving) stage_serving "$a" "$b" "$c" ;;
        py)  # py:<script in bench/gpu>:<timeout>: a probe, its output into $OUT/<script>.out
            vllm_env; log "py $a"
            bounded "${b:-120}" python3 "bench/gpu/$a" > "$OUT/${a%.py}.out" 2>&1
            log "py $a: rc=$?"; tail -n 20 "$OUT/${a%.py}.out" >> "$S" ;;
        hang|shared-mps)
            f=bench/gpu/${name/-/_}_check.sh
            if [ -x "$f" ]; then log "$name"; OUT=$WORK/$name bounded "${a:-300}" "$f" > "$WORK/$name.out" 2>&1; log "$name rc=$?"; tail -n 15 "$WORK/$name.out" >> "$S"
            else log "$name: $f not present"; fi ;;
        env) export "${st#env:}"; mkdir -p "$WORK"  # env:WORK=<dir> moves the logs of the stages after it
            log "env: ${st#env:} for the stages after this one" ;;
        start-profile)
            if command -v py-spy > /dev/null; then
                export FRMPS_DEBUG_STARTUP_PROFILE=$OUT/start-profile FRMPS_PY_SPY=$(command -v py-spy)
                log "start-profile: the engines' starts sampled by py-spy into $FRMPS_DEBUG_STARTUP_PROFILE"
            else log "start-profile: no py-spy (a wheel in .gpu/wheels, installed by prep)"; fi ;;
        pack)
            if compgen -G "$OUT/start-profile/*.stacks" > /dev/null; then
                python3 bench/gpu/start_profile.py --top 60 --json "$OUT/start-profile.json" "$OUT"/start-profile/*.stacks \
                    > "$OUT/start-profile.txt" 2>&1
            fi
            tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude='./models' . 2>/dev/null; log "pack: $(du -h "$OUT/logs.tar.gz" | cut -f1)" ;;
        *) log "unknown stage $st" ;;
    esac
done
# By the program's name (comm: "nvidia-cuda-mps", 15 characters, for the control daemon and the
# server alike), not its arguments: a shell whose command line names them is not one.
mps_procs() { ps -eo pid,ppid,etimes,comm,args | awk '$4 ~ /^nvidia-cuda-mps/'; }
for _ in $(seq 20); do [ -z "$(mps_procs)" ] && break; sleep 0.5; done
echo "MPS processes left: $(mps_procs | grep -c .)" | tee -a "$S"
mps_procs | tee -a "$S"
