# frmps — build, test and run. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

GO       ?= go
PYTHON   ?= python3
VENV     := .venv
VPY      := $(VENV)/bin/python
# vLLM 0.26.0 (the adapter's second supported version) as an overlay on .venv.
VENV026  := .venv-vllm026
VPY026   := $(VENV026)/bin/python
BIN      := bin
PKG      := github.com/frmps/frmps
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT   ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -s -w -X $(PKG)/supervisor/buildinfo.Version=$(VERSION) -X $(PKG)/supervisor/buildinfo.Commit=$(COMMIT)
CFLAGS_STRICT := -O2 -g -std=c11 -Wall -Wextra -Werror -fPIC -fvisibility=hidden -D_GNU_SOURCE

.PHONY: help
help: ## list targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# ---------------------------------------------------------------- setup
# uv (pinned; pip installs it into .tools/uv) installs the locks into virtualenvs that
# `python -m venv` makes (pip included, for `make lock`): from its cache it links the
# packages in and byte-compiles them on every core, ~20 s for .venv where pip took
# ~120 s on one core with its cache warm. Byte-compiled, as pip does: without it the
# suites' first processes compiled vLLM's modules as they imported them, all at once,
# and a vLLM engine took 80 s to start.
UV_VERSION := 0.9.5
UV         := .tools/uv/bin/uv
UV_INSTALL := $(UV) pip install -q --compile-bytecode --no-deps

$(UV):
	test -x .tools/uv/bin/python || $(PYTHON) -m venv .tools/uv
	.tools/uv/bin/python -m pip install -q --disable-pip-version-check uv==$(UV_VERSION)

$(VENV)/.stamp: vllmpatch/requirements.lock vllmpatch/pyproject.toml | $(UV)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) --python $(VPY) -r vllmpatch/requirements.lock
	$(UV_INSTALL) --python $(VPY) --no-build-isolation -e vllmpatch
	touch $@

.PHONY: venv
venv: $(VENV)/.stamp ## Python virtualenv with pinned deps (torch CPU-usable build)

# Only the packages that differ (requirements-vllm026.lock); .venv's site-packages
# follow them on sys.path through a .pth file. The install needs nothing of .venv
# (make test runs it beside .venv's); the .pth file and the version check do.
$(VENV026)/.installed: vllmpatch/requirements-vllm026.lock | $(UV)
	test -x $(VPY026) || $(PYTHON) -m venv $(VENV026)
	$(UV_INSTALL) --python $(VPY026) -r vllmpatch/requirements-vllm026.lock
	touch $@

$(VENV026)/.stamp: $(VENV026)/.installed $(VENV)/.stamp
	$(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$$($(VPY026) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_frmps_base.pth"
	$(VPY026) -c 'import importlib.metadata as m; v = m.version("vllm"); assert v == "0.26.0", v; import torch; assert torch.__version__.startswith("2.11.0"), torch.__version__'
	touch $@

.PHONY: venv-vllm026
venv-vllm026: $(VENV026)/.stamp ## overlay virtualenv with vLLM 0.26.0 + torch 2.11.0 for the adapter's tests

.PHONY: lock
lock: ## re-pin the Python lock from the current virtualenv
	$(VPY) -m pip freeze --all --exclude-editable | grep -v -e "^-e" -e "^pip==" > vllmpatch/requirements.lock.new
	mv vllmpatch/requirements.lock.new vllmpatch/requirements.lock

# ---------------------------------------------------------------- build
.PHONY: build
build: go-build c-build ## build frmps and the interceptor

.PHONY: go-build
go-build:
	mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/frmps ./cmd/frmps

.PHONY: c-build
c-build: ## the CUDA interceptor (no CUDA toolkit needed)
	$(MAKE) -C interceptor CFLAGS_STRICT='$(CFLAGS_STRICT)'

# ---------------------------------------------------------------- protobuf
PROTOS := proto/frmps/v1/control.proto proto/frmps/v1/generation.proto proto/frmps/v1/admin.proto proto/frmps/v1/frontend.proto
PY_PROTO_OUT := vllmpatch/src/frmps_engine/_proto

.PHONY: proto
proto: $(VENV)/.stamp ## regenerate Go and Python code from proto/
	mkdir -p .tools/bin
	$(GO) build -o .tools/bin/ google.golang.org/protobuf/cmd/protoc-gen-go google.golang.org/grpc/cmd/protoc-gen-go-grpc github.com/grpc-ecosystem/grpc-gateway/v2/protoc-gen-grpc-gateway
	$(VPY) -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-go=.tools/bin/protoc-gen-go \
	  --plugin=protoc-gen-go-grpc=.tools/bin/protoc-gen-go-grpc \
	  --plugin=protoc-gen-grpc-gateway=.tools/bin/protoc-gen-grpc-gateway \
	  --go_out=proto --go_opt=paths=source_relative \
	  --go-grpc_out=proto --go-grpc_opt=paths=source_relative \
	  --grpc-gateway_out=proto --grpc-gateway_opt=paths=source_relative,grpc_api_configuration=proto/frmps/v1/admin_gateway.yaml \
	  $(PROTOS)
	rm -rf $(PY_PROTO_OUT)/frmps
	$(VPY) -m grpc_tools.protoc -I proto --python_out=$(PY_PROTO_OUT) --pyi_out=$(PY_PROTO_OUT) --grpc_python_out=$(PY_PROTO_OUT) $(PROTOS)
	# generated Python imports "frmps.v1"; make them package-relative
	sed -i 's/^from frmps\.v1 import/from frmps_engine._proto.frmps.v1 import/' $(PY_PROTO_OUT)/frmps/v1/*.py $(PY_PROTO_OUT)/frmps/v1/*.pyi
	touch $(PY_PROTO_OUT)/frmps/__init__.py $(PY_PROTO_OUT)/frmps/v1/__init__.py

.PHONY: proto-check
proto-check: proto ## fail if the committed generated code is stale
	@git diff --exit-code --stat -- proto $(PY_PROTO_OUT) || { echo "generated protobuf code is stale: run 'make proto' and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- proto $(PY_PROTO_OUT))" || { git status --porcelain -- proto $(PY_PROTO_OUT); echo "untracked generated files: run 'make proto' and commit"; exit 1; }

# ---------------------------------------------------------------- tests
.PHONY: test
test: ## every test (what CI runs)
	$(MAKE) --no-print-directory test-setup
	$(MAKE) --no-print-directory proto-check
	$(MAKE) --no-print-directory test-vllm026-step
	$(MAKE) --no-print-directory py-test-main

# make test runs its stages in three steps, two at a time where neither waits on the
# other and a core would otherwise idle (most of its time on a 2-core machine is the
# Python suites'):
# 1. .venv installs (uv, from its cache) while, at a lower priority so as not to slow
#    it, .venv-vllm026 installs and the Go tests that need no Python, the fuzzing and
#    the interceptor's tests run, two at a time (the race-detector tests leave a core
#    idle half their time, the fuzzing fills it: 93 s for the step against 108 s);
# 2. proto-check (it rewrites generated code that the Go tests compile and the
#    engines import), then the vLLM 0.26.0 suite (run beside the main suite it took
#    11 minutes instead of 2.5, and vLLM's API servers in its end-to-end tests did not
#    start within their tests' bounds) and, at a lower priority, the Go tests that need
#    the virtualenv's Python and the deployment tests: the suite leaves the cores idle
#    an eighth of its time, most of it in its last end-to-end tests' waits;
# 3. the main Python suite alone: it keeps both cores busy.
# (frmps and the interceptor's libraries built first, once: neither make may rewrite a
# binary the other's tests run)
.PHONY: test-vllm026-step
test-vllm026-step: go-build py-test-libs
	nice -n 10 $(MAKE) --no-print-directory -j2 --output-sync=target -o go-build go-test-py deploy-test & go=$$!; \
	$(MAKE) --no-print-directory -o go-build -o py-test-libs py-test-vllm026; \
	rc=$$?; wait $$go && exit $$rc

.PHONY: test-setup
test-setup:
	$(MAKE) --no-print-directory $(UV)
	$(MAKE) --no-print-directory $(VENV)/.stamp & venv=$$!; \
	nice -n 10 $(MAKE) --no-print-directory -j2 --output-sync=target $(VENV026)/.installed fmt-check vet c-test go-build go-test-nopy go-fuzz; \
	rc=$$?; wait $$venv && exit $$rc

.PHONY: fmt-check
fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); test -z "$$out" || { echo "gofmt needed:"; echo "$$out"; exit 1; }

.PHONY: vet
vet:
	$(GO) vet ./...

# FRMPS_PYTHON: the ring's and the control protocol's cross-language tests run
# a real Python peer (without one they skip, or fail when CI=true).
GO_TEST_ENV := FRMPS_PYTHON=$(CURDIR)/$(VPY) PYTHONPATH=$(CURDIR)/vllmpatch/src
# The Go packages whose tests run the virtualenv's Python (FRMPS_PYTHON): the ring's
# writer, the control protocol's peer, the engine preflight, the CLI. The others need
# none (without FRMPS_PYTHON a test that did would skip, or fail when CI=true).
GO_PY_PKGS := $(addprefix $(PKG)/,ringbuf supervisor/control supervisor/engine cmd/frmps)
# The Python tests and the bench: the engine package's source and the repository
# root, which holds the bench package (bench/: the evaluation, its harnesses).
PY_PATH := $(CURDIR)/vllmpatch/src:$(CURDIR)

.PHONY: go-test
go-test: go-test-nopy go-test-py go-fuzz ## Go tests with the race detector, the full writer-crash test, brief fuzzing

.PHONY: go-test-nopy
go-test-nopy:
	$(GO) test -race -count=1 -timeout 15m $(filter-out $(GO_PY_PKGS),$(shell $(GO) list ./...))

.PHONY: go-test-py
go-test-py: $(VENV)/.stamp
	$(GO_TEST_ENV) $(GO) test -race -count=1 -timeout 15m $(GO_PY_PKGS)
	$(GO_TEST_ENV) $(GO) test -count=1 -run Crash ./ringbuf

.PHONY: go-fuzz
go-fuzz:
	# Fuzz budgets are counts of executions, not durations: with a duration Go 1.26's
	# fuzz coordinator can fail a run with a bare "context deadline exceeded" at the
	# deadline on a loaded machine (golang/go#75804, fixed in Go 1.27). The counts
	# are about the 15 / 10 / 10 s these took on the 2-core CI box.
	$(GO) test -run '^$$' -fuzz FuzzReader -fuzztime 600000x ./ringbuf
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime 60000x ./supervisor/control
	$(GO) test -run '^$$' -fuzz FuzzRequest -fuzztime 30000x -fuzzminimizetime 1s ./supervisor/openai

.PHONY: c-test
c-test: c-build ## interceptor unit tests against the fake libcuda
	$(MAKE) -C interceptor test CFLAGS_STRICT='$(CFLAGS_STRICT)'

# The Python suites run on pytest-xdist's workers, a test module to one worker (--dist
# loadfile) so a module's shared fixtures, a `frmps serve` deployment or a loaded model,
# start once. The vLLM 0.26.0 suite: one worker per core, at most 4 (each imports torch
# and vLLM). The main suite: one more than the cores, at most 5: its end-to-end tests
# leave the CPU idle part of the time (engines asleep in their step delays, waits on
# failovers); on 2 cores three workers took 443 s where two took 514 s, while the 0.26.0
# suite, whose vLLM API servers keep the cores busy, took 130 s with three and 106 s
# with two. PYTEST_PAR= PYTEST_PAR_MAIN= run them in one process.
PYTEST_PAR ?= -n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder
# (nproc counts OMP_NUM_THREADS, which the test targets set to 1 for their sub-makes)
MAIN_WORKERS := $(shell n=$$(( $$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1) + 1 )); [ $$n -gt 5 ] && n=5; echo $$n)
PYTEST_PAR_MAIN ?= -n $(MAIN_WORKERS) --dist loadfile --no-loadscope-reorder
# The suites print their 15 slowest tests (setup included): the clean-clone run is a budget
# (12 minutes on a 2-core machine), and a test that grows shows in the log that ran it.
PYTEST_DURATIONS ?= --durations=15

# Every process the tests start runs torch's (and numpy's BLAS) CPU kernels on one
# thread: the suites keep several of those processes busy at once (workers, engines,
# scripts), and OpenMP's idle worker threads spin-wait on cores the others need (a
# Triton-interpreter test script beside two busy loops: 42.7 s and 14.6 CPU-s with the
# default two threads, 28.4 s and 8.4 CPU-s with one). Results do not depend on the
# thread count (test_refengine.py checks it).
test py-test py-test-main py-test-vllm026 go-test go-test-py deploy-test: export OMP_NUM_THREADS = 1

# The interceptor and its fake libcuda, built before the workers start: several test
# modules build them (make -C interceptor), and two workers must not write them at once.
.PHONY: py-test-libs
py-test-libs:
	$(MAKE) -C interceptor all build/libcuda_fake.so CFLAGS_STRICT='$(CFLAGS_STRICT)'

.PHONY: py-test
py-test: py-test-vllm026 py-test-main ## Python tests (engine SDK, reference engine, ring writer, vLLM adapter on 0.33.0 and 0.26.0)

# The main suite (the vLLM adapter's tests on 0.33.0 among them). .venv-vllm026 too:
# bench/serving's test runs vLLM 0.26.0's `vllm bench serve` client from it.
.PHONY: py-test-main
py-test-main: $(VENV)/.stamp $(VENV026)/.stamp go-build py-test-libs
	FRMPS_EXPECT_VLLM=0.33.0 FRMPS_BIN=$(CURDIR)/$(BIN)/frmps PYTHONPATH=$(PY_PATH) $(VPY) -m pytest -q $(PYTEST_PAR_MAIN) $(PYTEST_DURATIONS) vllmpatch/tests

.PHONY: py-test-vllm026
py-test-vllm026: $(VENV026)/.stamp go-build py-test-libs ## the vLLM adapter's tests against vLLM 0.26.0
	FRMPS_EXPECT_VLLM=0.26.0 FRMPS_BIN=$(CURDIR)/$(BIN)/frmps PYTHONPATH=$(PY_PATH) $(VPY026) -m pytest -q -p no:cacheprovider $(PYTEST_PAR) $(PYTEST_DURATIONS) vllmpatch/tests/vllm

.PHONY: test-notorch
test-notorch: ## Go tests and the torch-free Python tests, without installing torch
	$(GO) test -count=1 ./...
	test -x .venv-notorch/bin/python || $(PYTHON) -m venv .venv-notorch
	.venv-notorch/bin/python -m pip install -q -r vllmpatch/requirements-notorch.txt
	.venv-notorch/bin/python -m pip install -q --no-deps -e vllmpatch
	.venv-notorch/bin/python -m pytest -q -m "not torch" vllmpatch/tests

# deploy/ is a Go module of its own, so Helm, the Kubernetes API types,
# Prometheus and BuildKit stay out of frmps's dependencies.
.PHONY: deploy-test
deploy-test: $(VENV)/.stamp go-build ## deployment files: Helm chart, systemd unit, Dockerfile, Grafana dashboard, alert rules
	cd deploy && $(GO) vet ./...
	cd deploy && FRMPS_BIN=$(CURDIR)/$(BIN)/frmps $(GO) test -count=1 -timeout 10m ./...

# Images without a Docker daemon (deploy/image/): a Debian base from
# mmdebstrap, frmps and the interceptor built here, the Python environment
# from PyPI, assembled with buildah. Needs root and Debian's mmdebstrap,
# buildah, podman (and runc where crun cannot run containers).
.PHONY: image
image: image-cpu image-gpu ## both container images, daemonless (buildah; deploy/image/)

.PHONY: image-cpu
image-cpu: ## container image, CPU variant, daemonless: localhost/frmps:cpu
	VERSION=$(VERSION) COMMIT=$(COMMIT) deploy/image/build.sh cpu

.PHONY: image-gpu
image-gpu: ## container image, GPU variant (vLLM 0.26.0, CUDA 13 wheels), daemonless: localhost/frmps:gpu
	VERSION=$(VERSION) COMMIT=$(COMMIT) deploy/image/build.sh gpu

.PHONY: image-test
image-test: ## not in CI (minutes, podman): the cpu image run as the chart runs it; the gpu image's contents, without a GPU
	deploy/image/test.sh
	deploy/image/check-gpu.sh

.PHONY: image-docker-cpu
image-docker-cpu: ## container image, CPU variant (docker with BuildKit; needs Docker Hub, ghcr.io, download.pytorch.org)
	docker build -f deploy/docker/Dockerfile --target cpu --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) -t frmps:$(VERSION)-cpu -t frmps:cpu .

.PHONY: image-docker-gpu
image-docker-gpu: ## container image, GPU variant on the CUDA base (docker with BuildKit)
	docker build -f deploy/docker/Dockerfile --target gpu --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) -t frmps:$(VERSION)-gpu -t frmps:gpu .

# ---------------------------------------------------------------- run
.PHONY: demo
demo: $(VENV)/.stamp build ## set up and run the main job: frmps serve on the CPU, a stream across a real failover
	$(BIN)/frmps version
	$(VPY) bench/demo.py --frmps $(BIN)/frmps

.PHONY: serve
serve: $(VENV)/.stamp build ## run frmps serve on the CPU (tiny model) until Ctrl-C
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(BIN)/frmps serve --no-mps --python $(CURDIR)/$(VPY)

.PHONY: soak
soak: $(VENV)/.stamp go-build ## not in CI: 1,000 SIGKILLs of the active under 16 streams, resources sampled (about an hour on 2 cores): make soak RESULTS=bench/results/<date>-cpu-soak
	PYTHONPATH=$(PY_PATH) $(VPY) -m bench.chaos --frmps $(CURDIR)/$(BIN)/frmps \
	  --kills $(or $(KILLS),1000) --streams $(or $(STREAMS),16) --out $(or $(RESULTS),bench/build/soak)

.PHONY: ring-bench
ring-bench: $(VENV)/.stamp ## ring publish/consume costs
	$(VPY) -m frmps_engine.ring.bench

.PHONY: frontdoor-bench
frontdoor-bench: ## front-door overhead per streamed chunk (fake engine)
	$(GO) run ./bench/frontdoor -split

.PHONY: engine-speed
engine-speed: $(VENV)/.stamp ## reference engine decode speed (GPU; --device cpu --model tiny for a smoke run)
	$(VPY) bench/engine_speed.py

.PHONY: bench-cpu
bench-cpu: $(VENV)/.stamp go-build ## every `frmps bench` experiment on the CPU (tiny model): a check of the harness, not a measurement
	for e in recovery prompt-length since-sync sync-overhead outage standby-memory correctness; do \
	  PYTHONPATH=$(PY_PATH) $(BIN)/frmps bench --python $(CURDIR)/$(VPY) $$e --cpu --out $(or $(RESULTS),bench/build/bench-cpu) || exit 1; done

.PHONY: bench-gpu
bench-gpu: ## on the GPU machine: `make bench-gpu SLOTS="s1" RESULTS=bench/results/<date>-h100` (bench/README.md)
	RESULTS=$(RESULTS) bench/gpu/bench_run.sh $(or $(SLOTS),quick)

.PHONY: bench-plots
bench-plots: $(VENV)/.stamp ## PNGs and README tables from the JSON results: make bench-plots RESULTS=bench/results/<date>-<gpu>
	@test -n "$(RESULTS)" || { echo "usage: make bench-plots RESULTS=bench/results/<date>-<gpu>"; exit 2; }
	PYTHONPATH=$(PY_PATH) $(VPY) -m bench.plots $(RESULTS)

.PHONY: clean
clean:
	rm -rf $(BIN) .tools interceptor/build bench/build
