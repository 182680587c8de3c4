#!/bin/bash
# Downloads the packages of vLLM 0.26.0's OpenAI API server that the offline vLLM
# bundle leaves out (../shared/vllm-gpu: it carries what the offline engine needs)
# as CPython 3.12 manylinux wheels into .gpu/wheels-server, for the GPU machine
# (no network there). `bench/gpu/session.sh prep` installs them into VLSITE; carry
# .gpu/wheels-server. Versions: those vLLM 0.26.0's own dependency resolution picks
# (the .venv-vllm026 environment of `make venv-vllm026`).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.gpu/wheels-server
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$dest" \
    uvicorn==0.54.0 h11==0.16.0 httptools==0.9.0 uvloop==0.23.0 click==8.5.1 \
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 \
    yarl==1.25.1 attrs==26.1.0 python-multipart==0.0.34 prometheus_client==0.26.0 \
    prometheus-fastapi-instrumentator==8.1.0 annotated-doc==0.0.7 model-hosting-container-standards==0.1.16 \
    jmespath==1.1.0 orjson==3.13.0 watchfiles==1.3.0 anyio==4.16.0
ls "$dest" | wc -l | xargs echo "wheels in $dest:"
du -sh "$dest"
