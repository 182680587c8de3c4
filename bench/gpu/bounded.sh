# shellcheck shell=bash
# bounded SECONDS CMD...: run CMD in a process group of its own; past SECONDS the
# whole group gets SIGTERM (the checks then stop their frmps, which stops its MPS
# daemon and engines), and SIGKILL 90 s later. Returns CMD's status, 124 when it
# was stopped. `timeout` would signal only its child: a check's frmps (in a session
# of its own) and its MPS daemon would outlive it. Sourced by the GPU stage scripts.
bounded() {
    local limit=$1 pid t=0
    shift
    set -m
    "$@" &
    pid=$!
    set +m
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$t" -ge "$limit" ]; then
            kill -TERM -- "-$pid" 2>/dev/null
            for _ in $(seq 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
            kill -KILL -- "-$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            return 124
        fi
        sleep 1
        t=$((t + 1))
    done
    wait "$pid"
}
