# shellcheck shell=bash
# Shared settings of the daemonless image build (rootfs.sh, build.sh,
# test.sh, check-gpu.sh). Sourced, not run.

# shellcheck disable=SC2034  # the sourcing scripts use these

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$REPO/deploy/image

# Debian: the suite the base is built from. The packages the build got are
# recorded in packages-$SUITE.txt (rootfs.sh compares, RECORD=1 rewrites).
SUITE=${FRMPS_IMAGE_SUITE:-bookworm}
MIRROR=${FRMPS_IMAGE_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${FRMPS_IMAGE_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# What the image runs on top of the base: Python 3.11 (the version the
# lock pins for), a venv for the engines, tini as PID 1 (it reaps the
# engines' orphans), CA certificates for model downloads.
BASE_PACKAGES=python3,python3-venv,tini,ca-certificates

# Build outputs and caches, outside the repository and outside the image:
# the base tarball, the pip cache (rebuilds download nothing again).
WORK=${FRMPS_IMAGE_WORK:-/var/tmp/frmps-image}
PIP_CACHE=${FRMPS_IMAGE_PIP_CACHE:-$WORK/pip-cache}

IMAGE=${FRMPS_IMAGE_NAME:-localhost/frmps}
VERSION=${VERSION:-$(git -C "$REPO" describe --tags --always --dirty 2>/dev/null || echo dev)}
COMMIT=${COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}

# podman on a host without CAP_SYS_RESOURCE (a container, a sandbox) cannot
# raise rlimits, and crun refuses hybrid cgroup hierarchies: PODMAN_RUN_OPTS
# (default: runc, cgroupfs, limits no higher than the caller's) works on
# both those hosts and ordinary ones.
if [[ -z ${PODMAN_RUN_OPTS+x} ]]; then
	PODMAN_RUN_OPTS="--cgroup-manager cgroupfs --ulimit nofile=$(ulimit -Hn):$(ulimit -Hn) --ulimit nproc=8192:8192"
	command -v runc >/dev/null && PODMAN_RUN_OPTS+=" --runtime runc"
fi

log() { printf '== %s\n' "$*" >&2; }
die() {
	printf 'error: %s\n' "$*" >&2
	exit 1
}
need() {
	local t
	for t in "$@"; do
		command -v "$t" >/dev/null || die "$t not found (Debian: apt-get install $t)"
	done
}
