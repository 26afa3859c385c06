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

# torch==2.13.0 first: it is a CPU wheel on this machine's disk, and installing it before the project keeps pip
# from resolving `torch>=2.4` to a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[train,dev,load]'
	touch $@

venv: $(VENV)/.installed

# Serve the model repository on http://$(HOST):$(PORT) (built from the tiny presets first if it is empty).
serve: repository
	TSERVE_REPOSITORY=$(REPOSITORY) TSERVE_HOST=$(HOST) TSERVE_PORT=$(PORT) $(BIN)/python -m service

repository: venv
	$(BIN)/python -m export.bootstrap --repository $(REPOSITORY)

test: venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

# Train the three tiny presets (seconds each) into $(RUNS)/<task>-tiny.
train-tiny: venv
	for task in translation gpt vit; do $(BIN)/python -m models.train $$task --preset tiny --out $(RUNS)/$$task-tiny || exit 1; done

clean:
	rm -rf $(VENV) $(RUNS) .pytest_cache

# Download the three datasets into $(TSERVE_DATA_DIR) and verify every file against models/data_checksums.py
# (nothing to do when all are present and verified): from GitHub, or from the base URL in TSERVE_DATA_MIRROR.
.PHONY: data
data: venv
	$(BIN)/python -m models.data fetch

# Engine benchmark: ours vs transformers generate() vs Optimum ORTModel vs ONNX Runtime GenAI (on our own exported
# GPT graph), in one run, and our GPT engine's batch-scaling table against its fp32 matmul roofline (separate venv:
# Optimum needs transformers<4.58; onnxruntime-genai shares its onnxruntime). Writes reports/bench_engine.json.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.installed: bench/requirements.txt pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet torch==2.13.0
	$(BENCH_VENV)/bin/pip install --quiet -r bench/requirements.txt
	$(BENCH_VENV)/bin/pip install --quiet -e . --no-deps
	touch $@

.PHONY: bench-engine
bench-engine: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/bench_engine.py $(BENCH_ARGS)

# HTTP benchmark: throughput and latency percentiles per endpoint vs a plain FastAPI + transformers generate()
# baseline, in one run. Writes reports/bench_http.json.
.PHONY: bench-http
bench-http: venv
	$(BIN)/python bench/bench_http.py $(BENCH_ARGS)

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
