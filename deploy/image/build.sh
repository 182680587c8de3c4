#!/usr/bin/env bash
# Builds the frmps image without a Docker daemon, from what Debian's
# mirrors, PyPI and the Go module proxy serve:
#
#   deploy/image/build.sh cpu|gpu
#
# base:   rootfs.sh's Debian root filesystem (mmdebstrap), imported as is
# frmps:  built here, static (CGO_ENABLED=0), copied in
# lib:    the CUDA interceptor built here (make c-build), copied in
# Python: a venv at /opt/frmps/venv, filled by pip inside the image from
#         wheels downloaded into $PIP_CACHE/wheels (outside the image)
#   cpu:  the engines' runtime set at requirements.lock's versions, torch
#         without its nvidia-* wheels (the CPU path does not load them)
#   gpu:  vLLM 0.26.0 + torch 2.11.0 (CUDA 13.0 wheels; the CUDA runtime
#         libraries come from the nvidia-* wheels), resolved by pip under
#         the constraints of requirements-gpu.lock (RECORD=1 rewrites it)
#
# The image is the Dockerfile's (deploy/docker/Dockerfile) in layout, user,
# entrypoint and environment. Tags: $IMAGE:$VERSION-<variant>, $IMAGE:<variant>.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

variant=${1:-}
[[ $variant == cpu || $variant == gpu ]] || die "usage: $0 cpu|gpu"
need buildah go make cc
mkdir -p "$WORK" "$PIP_CACHE"

base=$("$HERE/rootfs.sh" | tail -1)

log "frmps $VERSION ($COMMIT), static"
stage=$WORK/stage-$variant
rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib"
(cd "$REPO" && CGO_ENABLED=0 go build -trimpath \
	-ldflags "-s -w -X github.com/frmps/frmps/supervisor/buildinfo.Version=$VERSION -X github.com/frmps/frmps/supervisor/buildinfo.Commit=$COMMIT" \
	-o "$stage/bin/frmps" ./cmd/frmps)
"$stage/bin/frmps" version >&2
log "interceptor"
make -s -C "$REPO" c-build >&2
install -m 0644 "$REPO/interceptor/build/libfrmps_vmm.so" "$stage/lib/"

ctr=$(buildah from --quiet scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah add --quiet "$ctr" "$base" / >/dev/null
# chroot isolation: no OCI runtime, host network (pip reaches PyPI).
mounts=(-v "$PIP_CACHE:/var/cache/pip" -v "$REPO:/src:ro")
# A host whose HTTPS goes through a proxy with its own CA names that CA's
# bundle in PIP_CERT: pip in the image uses it, the image does not keep it.
pipenv=(env PIP_DISABLE_PIP_VERSION_CHECK=1)
if [[ -n ${PIP_CERT:-} ]]; then
	mounts+=(-v "$PIP_CERT:/run/build-ca.crt:ro")
	pipenv+=(PIP_CERT=/run/build-ca.crt)
fi
[[ -z ${PIP_INDEX_URL:-} ]] || pipenv+=(PIP_INDEX_URL="$PIP_INDEX_URL")
run() { buildah run --isolation chroot "${mounts[@]}" "$ctr" -- "$@"; }

log "user 10001, venv"
run useradd --system --uid 10001 --user-group --home-dir /nonexistent --shell /usr/sbin/nologin frmps
run python3 -m venv /opt/frmps/venv
# Wheels are downloaded into $PIP_CACHE/wheels (kept between builds: pip
# download skips the files it has) and installed from there only. pip's own
# HTTP cache is not relied on: a proxy that answers "no-store" disables it.
pipdl=("${pipenv[@]}" /opt/frmps/venv/bin/pip download --dest /var/cache/pip/wheels --progress-bar off)
pipin=("${pipenv[@]}" /opt/frmps/venv/bin/pip install --no-index --find-links /var/cache/pip/wheels)
pip=("${pipenv[@]}" /opt/frmps/venv/bin/pip install --progress-bar off)
# The engine package itself is built out of /src in a scratch copy (the
# mount is read-only; setuptools writes its build/ and egg-info there).
run sh -c 'rm -rf /tmp/vllmpatch && cp -r /src/vllmpatch /tmp/vllmpatch && rm -rf /tmp/vllmpatch/build /tmp/vllmpatch/src/*.egg-info'
case $variant in
cpu)
	log "Python (cpu): $(grep -v '^#' "$HERE/requirements-cpu.txt" | xargs)"
	# --no-deps: exactly these, at the lock's versions; torch's nvidia-*
	# and triton wheels (several GB) are left out.
	reqs=(--no-deps -c /src/vllmpatch/requirements.lock -r /src/deploy/image/requirements-cpu.txt)
	run "${pipdl[@]}" "${reqs[@]}"
	run "${pipin[@]}" "${reqs[@]}"
	run "${pip[@]}" --no-deps /tmp/vllmpatch
	;;
gpu)
	# vLLM 0.26.0 as its own dependency resolution has it; then the engine
	# package's runtime set, at requirements.lock's versions, over it. The
	# one conflict: vLLM's nvidia-cutlass-dsl* ask for protobuf<7, the
	# engine's generated code needs protobuf>=7.35 (its gencode version); the
	# engine's protobuf wins, as in the environments the adapter is tested in
	# (make venv-vllm026), and `pip check` shows that one complaint.
	engine_pins=(protobuf grpcio crc32c)
	cons=()
	if [[ -z ${RECORD:-} ]]; then
		grep -v -i -E "^($(
			IFS='|'
			echo "${engine_pins[*]}"
		))==" "$HERE/requirements-gpu.lock" >"$stage/vllm-constraints.txt"
		mounts+=(-v "$stage:/stage:ro")
		cons=(-c /stage/vllm-constraints.txt)
	fi
	log "Python (gpu): vllm==0.26.0 torch==2.11.0, then ${engine_pins[*]} and the engine package"
	vllm=("${cons[@]}" vllm==0.26.0 torch==2.11.0 triton==3.6.0)
	pins=(--no-deps -c /src/vllmpatch/requirements.lock "${engine_pins[@]}")
	run "${pipdl[@]}" "${vllm[@]}"
	run "${pipin[@]}" "${vllm[@]}"
	run "${pipdl[@]}" "${pins[@]}"
	run "${pipin[@]}" "${pins[@]}"
	run "${pip[@]}" --no-deps /tmp/vllmpatch
	run "${pipenv[@]}" /opt/frmps/venv/bin/pip check >&2 || true
	if [[ -n ${RECORD:-} ]]; then
		{
			echo "# What build.sh gpu installed (RECORD=1 deploy/image/build.sh gpu rewrites this);"
			echo "# later builds resolve vLLM under these constraints."
			run /opt/frmps/venv/bin/pip freeze --exclude-editable | grep -v -i -e '^frmps-engine' -e '^frmps_engine'
		} >"$HERE/requirements-gpu.lock"
		log "recorded $HERE/requirements-gpu.lock"
	fi
	;;
esac
run sh -c 'rm -rf /tmp/vllmpatch /tmp/* /root/.cache'
run /opt/frmps/venv/bin/python -c 'import frmps_engine, grpc, numpy, torch, tokenizers, safetensors; print("torch", torch.__version__)'
# Drop the build-time tools the image does not need at run time: pip stays
# (inspection), its cache was outside.

buildah copy --quiet "$ctr" "$stage/bin/frmps" /opt/frmps/bin/frmps >/dev/null
buildah copy --quiet "$ctr" "$stage/lib/libfrmps_vmm.so" /opt/frmps/lib/libfrmps_vmm.so >/dev/null

cfg=(
	--user 10001:10001
	--workingdir /tmp
	--port 8000
	--env PATH=/opt/frmps/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
	--env FRMPS_PYTHON=/opt/frmps/venv/bin/python
	--env FRMPS_VMM_LIBRARY=/opt/frmps/lib/libfrmps_vmm.so
	--env HOME=/tmp --env XDG_CACHE_HOME=/tmp/.cache
	--env PYTHONDONTWRITEBYTECODE=1 --env PYTHONUNBUFFERED=1
	--entrypoint '["/usr/bin/tini", "--", "frmps"]'
	--label org.opencontainers.image.title=frmps
	--label org.opencontainers.image.version="$VERSION"
	--label org.opencontainers.image.revision="$COMMIT"
	--label io.frmps.base="debian-$SUITE (mmdebstrap)"
)
case $variant in
cpu) cfg+=(--cmd '["serve", "--no-mps", "--model", "tiny"]') ;;
gpu)
	# frmps starts its own MPS daemon (nvidia-cuda-mps-control, which the
	# NVIDIA container runtime mounts with the driver) unless told otherwise.
	cfg+=(--env NVIDIA_VISIBLE_DEVICES=all --env "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
		--cmd '["serve", "--device", "cuda", "--memory", "cuda-vmm", "--model", "qwen2.5-0.5b"]')
	;;
esac
buildah config "${cfg[@]}" "$ctr"

log "commit $IMAGE:$VERSION-$variant"
buildah commit --quiet --rm "$ctr" "$IMAGE:$VERSION-$variant" >/dev/null
trap - EXIT
buildah tag "$IMAGE:$VERSION-$variant" "$IMAGE:$variant"
size=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE:$variant" >/dev/null 2>&1; podman image inspect --format '{{.Size}}' "$IMAGE:$variant" 2>/dev/null || echo '?')
log "built $IMAGE:$VERSION-$variant ($size bytes uncompressed)"
echo "$IMAGE:$VERSION-$variant"
