# Quick start: `make serve` (build a model repository if there is none, then serve) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The data folder (full sets, for training, `make data` and the tests that need them; the test suite itself runs on
# tests/fixtures/data): ../shared/data beside the checkout when it exists, else ./data. Relative paths only.
DATA_DIR ?= $(firstword $(wildcard ../shared/data) data)
export TSERVE_DATA_DIR ?= $(abspath $(DATA_DIR))
RUNS ?= runs

REPOSITORY ?= model_repository
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv serve repository test test-fast train-tiny clean

# --- the locked install (requirements/, docs/operations.md "The install") ----------------------------------
# Every venv and image installs exact versions with their hashes from a lock in requirements/ (`make lock` writes
# them with uv from pyproject.toml, requirements/locust.in and bench/requirements.txt), never from pyproject's
# ranges. dev.txt: the serving set and the train, dev and load extras (.venv); serving.txt: the serving set alone
# (deploy/Dockerfile); serving-gpu.txt: the same with onnxruntime-gpu and its CUDA 13 / cuDNN 9 wheels
# (requirements/gpu.in; deploy/Dockerfile.gpu; the same set resolves for 3.12, `make gpu-check`'s); locust.txt: deploy/Dockerfile.locust; bench.txt: .venv-bench. The CPU locks are for CPython 3.11 on
# x86-64 Linux, this machine's, CI's and the Debian bookworm images' Python.
# PyTorch is not in the locks: requirements/torch.txt pins the CPU build of torch==2.13.0, installed first with
# --no-deps (its own dependencies are locked, resolved from that wheel's metadata) from TORCH_FIND_LINKS: /opt/wheels
# where the wheel lies on this machine's disk, else PyTorch's CPU index (PyPI's torch is the CUDA build: an
# unpinned one would pull multi-GB nvidia-* wheels). `pip check` then proves the venv consistent.
# INSTALLER=uv: the same installs with `uv pip` (needs uv on PATH: pip install uv), much faster cold.
INSTALLER ?= pip
UV ?= uv
TORCH_FIND_LINKS ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
installer = $(if $(filter uv,$(INSTALLER)),$(UV) pip install --quiet --python $(1)/bin/python,$(1)/bin/pip install --quiet)

# $(call locked-venv,VENV,LOCK[,CHECK]): VENV made afresh (a lock that changed leaves nothing stale behind) holding
# exactly torch's pin, LOCK and the project (editable), then CHECK (default: pip check, every requirement met)
define locked-venv
	$(PYTHON) -m venv --clear $(1)
	$(call installer,$(1)) --no-deps -r requirements/torch.txt --find-links $(TORCH_FIND_LINKS)
	$(call installer,$(1)) --no-deps --require-hashes -r $(2)
	$(call installer,$(1)) --no-deps -e .
	$(or $(3),$(1)/bin/python -m pip check)
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml requirements/dev.txt requirements/torch.txt
	$(call locked-venv,$(VENV),requirements/dev.txt)

venv: $(VENV)/.installed

# Refresh the locks (needs uv: pip install 'uv>=0.13'): re-resolve every input, keeping each locked version that
# still fits (LOCK_ARGS=--upgrade moves everything to the newest allowed; --upgrade-package NAME one package), then
# `make venv` installs the result. tests/deploy/test_lock.py fails while pyproject.toml and the locks disagree.
# The serving, locust and GPU locks are constrained to dev.txt's versions: every install runs the same versions.
LOCK_ARGS ?=
LOCK_CPU = --python-version 3.11 --python-platform x86_64-unknown-linux-gnu
LOCK_GPU = --python-version 3.11 --python-platform x86_64-unknown-linux-gnu
UV_COMPILE = $(UV) pip compile --quiet --generate-hashes --no-emit-package torch --custom-compile-command 'make lock' \
	--find-links $(TORCH_FIND_LINKS) -c requirements/torch.txt $(LOCK_ARGS)
.PHONY: lock
lock:
	$(UV_COMPILE) $(LOCK_CPU) pyproject.toml --extra train --extra dev --extra load -o requirements/dev.txt
	$(UV_COMPILE) $(LOCK_CPU) pyproject.toml -c requirements/dev.txt -o requirements/serving.txt
	$(UV_COMPILE) $(LOCK_GPU) pyproject.toml requirements/gpu.in --extra gpu --no-emit-package onnxruntime \
		-c requirements/dev.txt -o requirements/serving-gpu.txt
	$(UV_COMPILE) $(LOCK_CPU) requirements/locust.in -c requirements/dev.txt -o requirements/locust.txt
	$(UV_COMPILE) $(LOCK_CPU) bench/requirements.txt -o requirements/bench.txt
	$(MAKE) --no-print-directory kserve-lock
	$(MAKE) --no-print-directory ray-lock
	$(MAKE) --no-print-directory mutation-lock

# Regenerate the gRPC stubs (service/api/oip/grpc/generated) from the vendored upstream protos with the locked
# grpcio-tools (service/api/oip/grpc/protos.py), and the ONNX schema module (service/engines/onnx_graph) the
# load-time weights variants use; tests/unit/api/test_grpc_stubs.py and tests/unit/engines/test_weights.py fail
# while they are stale.
.PHONY: proto
proto: venv
	$(BIN)/python -m service.api.oip.grpc.protos
	$(BIN)/python -m service.engines.onnx_graph.protos

# The KServe SDK's venv (requirements/kserve.in says why it is its own): the SDK from its lock and nothing else,
# not the project; tests/api/test_oip_api.py runs its client script with this venv's python.
KSERVE_VENV ?= .venv-kserve
$(KSERVE_VENV)/.installed: requirements/kserve.txt
	$(PYTHON) -m venv --clear $(KSERVE_VENV)
	$(call installer,$(KSERVE_VENV)) --no-deps --require-hashes -r requirements/kserve.txt
	$(KSERVE_VENV)/bin/python -m pip check
	touch $@

.PHONY: kserve-venv kserve-lock
kserve-venv: $(KSERVE_VENV)/.installed

kserve-lock:
	$(UV_COMPILE) $(LOCK_CPU) requirements/kserve.in -o requirements/kserve.txt

# Ray Serve's venv (requirements/ray.in says why it is its own): its lock (Ray and the serving set, at dev.txt's
# versions) and the project, editable and --no-deps, no torch; deploy/ray/ runs in it, and
# tests/deploy/test_ray_cluster.py starts its Ray cluster with this venv's python.
RAY_VENV ?= .venv-ray
$(RAY_VENV)/.installed: requirements/ray.txt pyproject.toml
	$(PYTHON) -m venv --clear $(RAY_VENV)
	$(call installer,$(RAY_VENV)) --no-deps --require-hashes -r requirements/ray.txt
	$(call installer,$(RAY_VENV)) --no-deps -e .
	$(RAY_VENV)/bin/python -m pip check
	touch $@

.PHONY: ray-venv ray-lock
ray-venv: $(RAY_VENV)/.installed

ray-lock:
	$(UV_COMPILE) $(LOCK_CPU) pyproject.toml requirements/ray.in -c requirements/dev.txt -o requirements/ray.txt

# Serve the model repository on http://$(HOST):$(PORT) (built from the tiny presets first if it is empty).
serve: repository
	TSERVE_REPOSITORY=$(REPOSITORY) TSERVE_HOST=$(HOST) TSERVE_PORT=$(PORT) $(BIN)/python -m service

repository: venv
	$(BIN)/python -m export.bootstrap --repository $(REPOSITORY)

# An offline batch job on the model repository, through the service's app in-process (service/batch, docs/batch.md):
# IN, a requests file (OpenAI Batch JSONL), or with BATCH_ARGS=--text German sentences, one a line; OUT, the results
# (a file there already is resumed). - for standard input or output.
#   make batch-job IN=requests.jsonl OUT=results.jsonl
#   make batch-job IN=test.de OUT=test.en BATCH_ARGS="--text -O num_beams=4"
BATCH_ARGS ?=
ifneq ($(filter batch-job,$(MAKECMDGOALS)),)
ifeq ($(and $(IN),$(OUT)),)
$(error batch-job needs IN=FILE and OUT=FILE (- for standard input or output))
endif
endif
.PHONY: batch-job
batch-job: repository
	TSERVE_REPOSITORY=$(REPOSITORY) $(BIN)/python -m service.batch -i $(IN) -o $(OUT) $(BATCH_ARGS)

test: venv kserve-venv ray-venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

# Run every `$ curl` example of README.md and docs/api.md against a server on $(REPOSITORY) and compare its output
# with the printed one (tests/support/readme_check.py; READMECHECK_ARGS=--rtol 1e-6 on another CPU than the docs').
.PHONY: readme-check
READMECHECK_ARGS ?=
readme-check: repository
	$(BIN)/python -m tests.support.readme_check --repository $(REPOSITORY) $(READMECHECK_ARGS)

# Train the three tiny presets (seconds each) into $(RUNS)/<task>-tiny.
train-tiny: venv
	for task in translation gpt vit; do $(BIN)/python -m models.train $$task --preset tiny --out $(RUNS)/$$task-tiny || exit 1; done

clean:
	rm -rf $(VENV) $(RUNS) .pytest_cache .venv-mutation .venv-kserve .venv-ray mutation/work

# Download the three datasets into $(TSERVE_DATA_DIR) and verify every file against models/data_checksums.py
# (nothing to do when all are present and verified): from GitHub, or from the base URL in TSERVE_DATA_MIRROR.
.PHONY: data
data: venv
	$(BIN)/python -m models.data fetch

# Engine benchmark: ours vs transformers generate() vs Optimum ORTModel vs ONNX Runtime GenAI (on our own exported
# GPT graph), in one run, and our GPT engine's batch-scaling table against its fp32 matmul roofline (separate venv:
# Optimum needs transformers<4.58; onnxruntime-genai shares its onnxruntime; bench/requirements.txt pins it, locked in
# requirements/bench.txt). Writes reports/bench_engine.json.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: requirements/bench.txt requirements/torch.txt pyproject.toml
	$(call locked-venv,$(BENCH_VENV),requirements/bench.txt,$(BENCH_CHECK))
# the bench venv holds the project without its serving stack (the benchmark runs the engines only): pip check, less
# the project's own requirements
BENCH_CHECK = $(BENCH_VENV)/bin/python -m pip check | grep -v -e '^transformer-serving ' -e '^No broken' | { ! grep .; }

.PHONY: bench-engine
bench-engine: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/bench_engine.py $(BENCH_ARGS)

# llama.cpp, the GPT's C++ peer in `make bench-engine` (bench/enginebench/llama_cpp.py; skipped there until it is
# built): llama-batched-bench and llama-server built by bench/build_llama_cpp.sh from the llama.cpp source vendored in
# the llama-cpp-python sdist (pinned; fetched with pip download --no-binary), into .cache/llama.cpp/build. Once: a
# rerun with the binaries there does nothing. Not part of `make test` or CI (about 16 minutes on 2 cores).
# LLAMA_CPP_JOBS: the build's parallelism (default 2); pip is .venv's when there is one.
LLAMA_CPP_JOBS ?= 2
.PHONY: llama-cpp
llama-cpp:
	JOBS=$(LLAMA_CPP_JOBS) PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) bench/build_llama_cpp.sh

# HTTP benchmark: throughput and latency percentiles per endpoint vs a plain FastAPI + transformers generate()
# baseline and the C++ peers (llama-server once `make llama-cpp` has built it; CTranslate2 offline), in one run.
# Writes reports/bench_http.json.
.PHONY: bench-http
bench-http: venv
	$(BIN)/python bench/bench_http.py $(BENCH_ARGS)

# The CUDA path proved on one NVIDIA machine in at most 10 minutes (bench/gpu_check.py, docs/gpu.md): onnxruntime-gpu
# installed offline from GPU_WHEELS (its split parts put back together, every sha256 checked against the locks), the
# GPU tests (pytest -m gpu tests/gpu), the engine benchmark on CUDA and CPU, 60 s of bench-http on CUDA; writes
# reports/gpu_check.json and .txt. Without a GPU, a dry run: the CUDA steps are skipped by name. Python 3.12 there
# (PYTHON=python3.12), no venv needed: it makes its own from the folder. `make gpu-wheels` fills the folder (needs
# PyPI): the serving lock's wheels for Python 3.12 less numpy and nvidia-* (the CUDA image has them), pytest, httpx
# and onnx, onnxruntime-gpu split in 18 MiB parts. GPU_CHECK_ARGS: e.g. --steps wheels,environment,gpu-tests.
GPU_WHEELS ?= .cache/gpu-wheels
GPU_CHECK_ARGS ?=
.PHONY: gpu-check gpu-wheels
gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) bench/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) bench/gpu_check.py --prepare-wheels --wheels $(GPU_WHEELS)

# The compose stack's images, built from Debian packages and PyPI with no image registry (deploy/images.sh): a
# Debian base (mmdebstrap), tserve:cpu and tserve:locust on it, and the nginx and Prometheus images of
# tests/deploy/test_compose_stack.py. Needs root or sudo, mmdebstrap and a running Docker daemon.
.PHONY: images
images:
	deploy/images.sh

# The compose stack (docker-compose.yml), with docker-compose v1 (1.29) or `docker compose` v2 alike: COMPOSE is
# `docker compose` when the Docker CLI has the v2 plugin, else docker-compose. COMPOSE_FILES: by default the stack
# `make images` built, which needs no image registry (docker-compose.test.yml: Debian's nginx and Prometheus in
# place of the official images, Grafana left out); COMPOSE_FILES=docker-compose.yml COMPOSE_UP_ARGS=--build for the
# official images from Docker Hub. The project is named COMPOSE_PROJECT (tserve), whatever the folder's name.
#   make images && make compose-up                    # http://127.0.0.1:8000 (nginx), Prometheus on :9090
#   make compose COMPOSE_ARGS="logs -f api"           # any other compose command on the same project and files
COMPOSE ?= $(shell if docker compose version >/dev/null 2>&1; then echo docker compose; \
	elif command -v docker-compose >/dev/null 2>&1; then echo docker-compose; fi)
COMPOSE_PROJECT ?= tserve
COMPOSE_FILES ?= docker-compose.yml docker-compose.test.yml
COMPOSE_UP_ARGS ?= --no-build
COMPOSE_ARGS ?= ps
COMPOSE_RUN = $(COMPOSE) -p $(COMPOSE_PROJECT) $(addprefix -f ,$(COMPOSE_FILES))
COMPOSE_FOUND = @test -n "$(COMPOSE)" || { echo "make: neither \`docker compose\` (v2) nor docker-compose (v1) found: \
	install one (sudo apt-get install docker-compose)" >&2; exit 1; }

.PHONY: compose-up compose-down compose
compose-up:
	$(COMPOSE_FOUND)
	$(COMPOSE_RUN) up -d $(COMPOSE_UP_ARGS)

compose-down:
	$(COMPOSE_FOUND)
	$(COMPOSE_RUN) down

compose:
	$(COMPOSE_FOUND)
	$(COMPOSE_RUN) $(COMPOSE_ARGS)

# Load testing (locust) and the static deployment checks.
include deploy/Makefile.fragment

# --- mutation testing (mutation/run.py; docs/testing.md) -------------------------------------------------------------
# `make mutation`: mutmut 3 over the core the unit tests must pin down, package by package (mutation/packages.toml:
# decoding, streaming, scheduling, the APIs' request -> parameters mapping, export/checks.py, integer_gemm,
# response_cache), each with its fast unit tests; prints `mutation score: <package> <killed>/<total> = <x>%` per
# package and overall, and writes each package's survivors with their diffs to mutation/work/<package>/survivors.txt.
# Incremental: a rerun tests the mutants of the functions that changed, and the last run's survivors again.
# MUTATION_ARGS: package names, --max-children N (default: the CPU count), --scores-only. Not in CI (minutes of
# CPU). Its own venv, layered over .venv (a .pth file puts .venv's packages behind its own): the tests run on .venv's
# locked versions, and .venv stays exactly its lock.
MUTATION_VENV ?= .venv-mutation
MUTATION_ARGS ?=
$(MUTATION_VENV)/.installed: mutation/requirements.txt | venv
	rm -rf $(MUTATION_VENV)
	$(BIN)/python -m venv $(MUTATION_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
		"$$($(MUTATION_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dev-venv.pth"
	$(MUTATION_VENV)/bin/pip install --quiet --no-deps --require-hashes -r mutation/requirements.txt
	touch $@

.PHONY: mutation mutation-lock
mutation: $(MUTATION_VENV)/.installed
	nice -n 10 $(MUTATION_VENV)/bin/python mutation/run.py $(MUTATION_ARGS)

# Refresh mutation/requirements.txt from mutation/requirements.in (needs uv; `make lock` runs it too).
mutation-lock:
	$(UV) pip compile --quiet --generate-hashes --python-version 3.11 \
		--python-platform x86_64-unknown-linux-gnu --custom-compile-command 'make mutation-lock' \
		mutation/requirements.in -c requirements/dev.txt -o mutation/requirements.txt
