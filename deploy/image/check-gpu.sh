#!/usr/bin/env bash
# Checks the gpu image's contents without a GPU: it runs the image (podman,
# as its own user, read-only root filesystem) and looks at what a GPU node
# would use: the static frmps, the CUDA interceptor, the engine package and
# its vLLM plugin entry point, torch built for CUDA 13.0, vLLM 0.26.0
# importable. What needs a GPU (the interceptor hooking the driver, a
# failover on the device) is the GPU suite's (bench/gpu), not this.
#
#   deploy/image/check-gpu.sh [image]     (default: $IMAGE:gpu)
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"
need podman
image=${1:-$IMAGE:gpu}
podman image exists "$image" || die "no image $image: build it first (make image-gpu)"

# shellcheck disable=SC2086 # PODMAN_RUN_OPTS is a list of options
prun() { podman run --rm $PODMAN_RUN_OPTS --read-only --cap-drop ALL --security-opt no-new-privileges --tmpfs /tmp "$@"; }
log "$image: $(podman image inspect --format '{{.Size}}' "$image") bytes"
prun "$image" version
# shellcheck disable=SC2016 # expanded by the shell in the image
prun --entrypoint /bin/sh "$image" -c '
set -e
id
f=$FRMPS_VMM_LIBRARY
test -r "$f" && head -c 4 "$f" | od -An -c | grep -q "E   L   F" && echo "interceptor: $f ($(wc -c <"$f") bytes, ELF)"
test -x /usr/bin/tini && echo "tini: /usr/bin/tini"
'
prun -i --entrypoint /opt/frmps/venv/bin/python "$image" - <<'PY'
import ctypes, importlib.metadata as md, os, sys

def show(k, v):
    print(f"{k:>24}: {v}")

show("python", sys.version.split()[0])
import torch
show("torch", f"{torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
assert torch.__version__.startswith("2.11.0"), torch.__version__
assert torch.version.cuda and torch.version.cuda.startswith("13."), torch.version.cuda
show("cuda available", f"{torch.cuda.is_available()} (no GPU here: expected False)")
import vllm
show("vllm", vllm.__version__)
assert vllm.__version__ == "0.26.0", vllm.__version__
import frmps_engine
from frmps_engine.vllm import plugin  # noqa: F401  the adapter vLLM loads
show("frmps_engine", f"{md.version('frmps-engine')} at {os.path.dirname(frmps_engine.__file__)}")
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.dist and e.dist.name == "frmps-engine"]
show("vllm plugin entry point", ", ".join(f"{e.name} = {e.value}" for e in eps))
assert eps, "frmps-engine registers no vllm.general_plugins entry point"
import grpc, google.protobuf
show("grpcio / protobuf", f"{grpc.__version__} / {google.protobuf.__version__}")
lib = os.environ["FRMPS_VMM_LIBRARY"]
# RTLD_LAZY: the interceptor resolves the driver when first used, so it
# loads without libcuda; a missing dependency of its own would fail here.
ctypes.CDLL(lib, mode=os.RTLD_LAZY)
show("interceptor", f"{lib} loads (dlopen, no driver)")
print("gpu image content check: ok")
PY
