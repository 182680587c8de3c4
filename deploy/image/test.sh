#!/usr/bin/env bash
# Runs the cpu image with podman as the Helm chart runs it (deploy/helm/frmps
# with ci/cpu-values.yaml) and checks what an operator relies on:
#
#   - user 10001:10001, read-only root filesystem, no capabilities, no new
#     privileges; /tmp a writable directory (the chart's emptyDir, where the
#     state dir <tmp>/frmps-10001 lives), /dev/shm a memory-backed mount of
#     the chart's size (ring capacity + 56 MiB); port 8000 published
#   - /livez and /readyz answer (the probes)
#   - a streamed completion survives a SIGKILL of the active engine, sent
#     inside the container
#   - `frmps status` works through `podman exec`
#   - SIGTERM stops the container within the chart's grace period, exit 0,
#     every engine reaped by frmps before it exits, no launch record left
#
#   deploy/image/test.sh [image]     (default: $IMAGE:cpu, from build.sh cpu)
#
# Not in `make test`: it needs podman, a built image and about a minute.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
need podman
image=${1:-$IMAGE:cpu}
podman image exists "$image" || die "no image $image: build it first (make image-cpu)"
py=${HOST_PYTHON:-python3}

# chart:begin -- what the chart renders with ci/cpu-values.yaml
# (deploy/image_test.go checks these against the rendered Deployment).
uid=10001
ring=8388608
shm=$((ring + 56 * 1048576))
shutdown_grace=10
grace=$((5 + 2 * shutdown_grace + 25)) # frmps.terminationGrace
serve_args=(serve --model=tiny --engine=ref --device=cpu --memory=host-shm --sync-every=16 --port=8000
	"--ring-capacity=$ring" "--shutdown-grace=${shutdown_grace}s" --log-json --no-mps)
# chart:end
port=${FRMPS_IMAGE_TEST_PORT:-18000}
name=frmps-image-test-$$
tmp=$(mktemp -d "$WORK/test-tmp.XXXXXX")
chmod 0777 "$tmp" # an emptyDir: writable by the pod's user
fails=0
pass() { printf 'PASS %s\n' "$*"; }
fail() {
	printf 'FAIL %s\n' "$*"
	fails=$((fails + 1))
}
cleanup() {
	podman rm -f -t 0 "$name" >/dev/null 2>&1 || true
	rm -rf "$tmp"
}
trap cleanup EXIT

log "run $image as the chart does"
# shellcheck disable=SC2086 # PODMAN_RUN_OPTS is a list of options
podman run -d --name "$name" $PODMAN_RUN_OPTS \
	--user "$uid:$uid" --read-only --read-only-tmpfs=false \
	--cap-drop ALL --security-opt no-new-privileges \
	-v "$tmp:/tmp" \
	--mount "type=tmpfs,destination=/dev/shm,tmpfs-size=$shm,tmpfs-mode=1777" \
	-p "127.0.0.1:$port:8000" \
	-e FRMPS_TEST_STEP_DELAY_MS=20 \
	"$image" "${serve_args[@]}" >/dev/null
# FRMPS_TEST_STEP_DELAY_MS: the tiny model would finish a stream before the
# kill lands; 20 ms a step keeps it open across the failover.

sec=$(podman exec "$name" sh -c 'id -u; id -g; if touch /probe 2>/dev/null; then echo rootfs-writable; else echo rootfs-read-only; fi; grep -E " /dev/shm " /proc/mounts' | tr '\n' ' ')
read -r u g ro rest <<<"$sec"
if [[ $u == "$uid" && $g == "$uid" && $ro == rootfs-read-only && $rest == *"size=$((shm / 1024))k"* ]]; then
	pass "runs as $uid:$uid, root filesystem read-only, /dev/shm tmpfs of $((shm / 1048576)) MiB"
else
	fail "container security: $sec"
fi

url=http://127.0.0.1:$port
ready=
for _ in $(seq 1 300); do
	if [[ $(podman inspect -f '{{.State.Running}}' "$name" 2>/dev/null) != true ]]; then
		podman logs "$name" | tail -30
		die "container exited before it was ready"
	fi
	if "$py" -c "import urllib.request,sys; urllib.request.urlopen('$url/readyz', timeout=2)" 2>/dev/null; then
		ready=1
		break
	fi
	sleep 0.5
done
[[ -n $ready ]] || {
	podman logs "$name" | tail -30
	die "/readyz not 200 within 150 s"
}
for p in /livez /readyz; do
	code=$("$py" -c "import urllib.request; print(urllib.request.urlopen('$url$p', timeout=3).status)" 2>&1) || true
	if [[ $code == 200 ]]; then pass "GET $p 200"; else fail "GET $p: $code"; fi
done

# Both engines ready: the kill must land on an active with a standby behind it.
status_json() { podman exec "$name" frmps status --json; }
standby=
for _ in $(seq 1 240); do
	if status_json 2>/dev/null | "$py" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if any(e["role"]=="standby" and e["state"] in ("ready","serving") for e in s.get("engines",[])) else 1)'; then
		standby=1
		break
	fi
	sleep 0.5
done
[[ -n $standby ]] || fail "no ready standby within 120 s"

if out=$(podman exec "$name" frmps status 2>&1); then
	pass "podman exec frmps status (exit 0)"
	head -20 <<<"$out" | while IFS= read -r l; do printf '    %s\n' "$l"; done
else
	fail "podman exec frmps status: $out"
fi

active=$(status_json | "$py" -c 'import json,sys; print(next(e["pid"] for e in json.load(sys.stdin)["engines"] if e["role"]=="active"))')
if "$py" "$HERE/stream_kill.py" "$url" 200 -- podman exec "$name" sh -c "kill -KILL $active"; then
	pass "stream across a SIGKILL of the active (pid $active in the container)"
else
	fail "stream across a SIGKILL of the active"
fi
podman exec "$name" frmps status | grep -A3 -i '^failovers\|failover' | head -4 | while IFS= read -r l; do printf '    %s\n' "$l"; done

# SIGTERM: wait until the standby is back (a stop in mid-restart is another
# test), then stop as the kubelet does, timing it against the grace period.
for _ in $(seq 1 240); do
	status_json 2>/dev/null | "$py" -c 'import json,sys; s=json.load(sys.stdin); sys.exit(0 if sum(e["state"] in ("ready","serving") for e in s.get("engines",[]))==2 else 1)' && break
	sleep 0.5
done
# Host pids of the container's processes, to see who is reaped when.
mapfile -t procs < <(podman top "$name" hpid args | tail -n +2)
printf '    %s\n' "${procs[@]}"
frmps_hpid=$(printf '%s\n' "${procs[@]}" | awk '$2 == "frmps" {print $1; exit}')
mapfile -t engine_hpids < <(printf '%s\n' "${procs[@]}" | awk '$2 ~ /python/ {print $1}')
[[ -n $frmps_hpid && ${#engine_hpids[@]} -gt 0 ]] || fail "frmps or engines not found among the container's processes"
start=$(date +%s.%N)
podman kill --signal TERM "$name" >/dev/null
# Poll /proc every 10 ms: an engine still there after frmps has gone was
# left to tini (then to the kernel's namespace teardown).
leftover=$("$py" - "$frmps_hpid" "${engine_hpids[@]}" <<'PY'
import os, sys, time
frmps, engines = sys.argv[1], sys.argv[2:]
alive = lambda p: os.path.exists(f"/proc/{p}")
deadline = time.time() + 120
while alive(frmps) and time.time() < deadline:
    time.sleep(0.01)
print(" ".join(p for p in engines if alive(p)))
PY
)
podman wait "$name" >/dev/null
# frmps's own account of the shutdown (--log-json): each step and when.
podman logs --since "$(date -d "@${start%.*}" +%Y-%m-%dT%H:%M:%S)" "$name" 2>&1 | "$py" -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    rest = " ".join(f"{k}={v}" for k, v in r.items() if not k.startswith("@"))
    print("    %s %s  %s" % (r.get("@timestamp", "")[11:23], r.get("@message", "")[:160], rest[:160]))
' | tail -25
took=$(echo "$(date +%s.%N) - $start" | bc)
rc=$(podman inspect -f '{{.State.ExitCode}}' "$name")
if [[ $rc == 0 ]] && (($(echo "$took < $grace" | bc))); then
	pass "SIGTERM: exit 0 after ${took%.*}.$(cut -c1-1 <<<"${took#*.}") s (grace period ${grace} s)"
else
	fail "SIGTERM: exit $rc after $took s (grace period $grace s)"
	podman logs "$name" 2>&1 | tail -20
fi
if [[ -z $leftover ]]; then
	pass "every engine reaped before frmps exited (host pids ${engine_hpids[*]})"
else
	fail "engines still running when frmps exited: $leftover"
fi
left=$(find "$tmp" -mindepth 1 -path "*/frmps-$uid/*" -type f 2>/dev/null | head)
if [[ -z $left ]]; then pass "state dir clean after the stop (no launch record, no ring)"; else fail "left in the state dir: $left"; fi

if ((fails)); then
	echo "image-test: $fails check(s) failed"
	exit 1
fi
echo "image-test: all checks passed ($image)"
