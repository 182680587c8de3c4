#!/bin/bash
# GPU sessions side by side on a machine with several GPUs, one bench/gpu/session.sh per GPU,
# in the background (a device call is bounded; the sessions outlive it):
#
#   OUT=<dir> bench/gpu/lanes.sh start "<stages for GPU 0>" "<stages for GPU 1>" ...
#   OUT=<dir> bench/gpu/lanes.sh wait <seconds>      (again until it prints "all lanes done")
#
# start: runs session.sh's prep once (builds, installs, the bare context's memory), copies the
# repository to $OUT/repo (later calls may replace the working tree), and starts session N on
# GPU N with CUDA_VISIBLE_DEVICES=<GPU N's UUID> (MPS renumbers the GPUs it serves for its
# clients: a UUID names the same GPU to the MPS daemon, its clients and the standby outside MPS),
# OUT=$OUT/gpuN, WORK=/tmp/frmps-lane-N and VLLM_CACHE_ROOT=~/.cache/vllm-lane-N; each session
# ends with `pack`. A lane given "" is left idle. A lane whose stages start with "@all" is the
# only one and gets every GPU (CUDA_VISIBLE_DEVICES unset: tensor-parallel stages).
# wait: waits up to <seconds> while a session runs, then prints each lane's last summary lines and
# packs what the lanes wrote so far (JSON, summaries, py-spy stacks, the finished lanes' log
# packs) into $OUT/lanes.tar.gz.
#
# The four runs of bench/results/2026-11-27-h100x4-vllm-03baebc/ (the repository on the GPU
# machine, vLLM installed in VLSITE):
#   VLSITE=/path/to/vlsite OUT=/tmp/lanes bench/gpu/lanes.sh start \
#     "vllm-soak:qwen2.5-0.5b:30:480:800 bench:vllm:correctness:qwen2.5-0.5b:660" \
#     "vllm-soak:qwen2.5-7b:30:540:900" "vllm-soak:qwen2.5-14b:30:720:1100" \
#     "vllm-tp:qwen2.5-0.5b:1,8,64:720:async,sync"
# The sessions share the host's CPUs: host-bound latencies run a little slower than alone.
set -u
OUT=${OUT:?set OUT to a directory}
cmd=${1:-}
shift || true

running() {
    local f
    for f in "$OUT"/gpu*.pid; do
        [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && return 0
    done
    return 1
}

case "$cmd" in
start)
    [ "$#" -ge 1 ] || { echo "usage: lanes.sh start \"<stages for GPU 0>\" ..." >&2; exit 2; }
    mapfile -t uuids < <(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null)
    if [ "$#" -gt "${#uuids[@]}" ]; then
        echo "lanes.sh: $# lanes for ${#uuids[@]} GPUs" >&2
        exit 2
    fi
    mkdir -p "$OUT"
    if running; then echo "lanes.sh: lanes of $OUT are still running" >&2; exit 2; fi
    rm -rf "$OUT/repo" && mkdir -p "$OUT/repo"
    # .gpu/vb (the vLLM bundle) stays behind; .gpu/wheels (crc32c, py-spy) goes: prep installs from it
    tar --exclude=./.gpu/vb --exclude=./.git -cf - . | tar -xf - -C "$OUT/repo" || exit 1
    cd "$OUT/repo" || exit 1
    OUT=$OUT/prep WORK=/tmp/frmps-lane-prep bash bench/gpu/session.sh prep > "$OUT/prep.log" 2>&1
    cat "$OUT/prep/summary.txt"
    i=0
    for stages in "$@"; do
        if [ -n "$stages" ]; then
            read -r -a st <<< "$stages"
            if [ "${st[0]}" = "@all" ]; then  # every GPU of the machine (tensor parallelism)
                [ "$#" -eq 1 ] || { echo "lanes.sh: an @all lane must be the only one" >&2; exit 2; }
                st=("${st[@]:1}")
                gpus=(-u CUDA_VISIBLE_DEVICES)
                echo "all GPUs: ${st[*]}"
            else
                gpus=("CUDA_VISIBLE_DEVICES=${uuids[$i]}")
                echo "GPU $i (${uuids[$i]}): $stages"
            fi
            env "${gpus[@]}" VLLM_CACHE_ROOT="$HOME/.cache/vllm-lane-$i" OUT="$OUT/gpu$i" \
                WORK="/tmp/frmps-lane-$i" setsid nohup bash bench/gpu/session.sh "${st[@]}" pack \
                > "$OUT/gpu$i.log" 2>&1 < /dev/null &
            echo $! > "$OUT/gpu$i.pid"
        fi
        i=$((i + 1))
    done
    ;;
wait)
    limit=${1:-300}
    t=0
    while running && [ "$t" -lt "$limit" ]; do sleep 5; t=$((t + 5)); done
    for f in "$OUT"/gpu*.pid; do
        [ -f "$f" ] || continue
        lane=$(basename "$f" .pid)
        if kill -0 "$(cat "$f")" 2>/dev/null; then echo "== $lane running"; else echo "== $lane done"; fi
        tail -n 4 "$OUT/$lane/summary.txt" 2>/dev/null
    done
    (cd "$OUT" && find . -path ./repo -prune -o -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.stacks' \
        -o -name '*.md' -o -name '*.txt' -o -name '*.log' -o -name 'logs.tar.gz' \) -size -30M -print |
        tar -czf lanes.tar.gz -T -)
    if running; then echo "lanes still running"; else echo "all lanes done"; fi
    ;;
*)
    echo "usage: OUT=<dir> lanes.sh start \"<stages for GPU 0>\" ... | OUT=<dir> lanes.sh wait <seconds>" >&2
    exit 2
    ;;
esac
