# Two commands for a fresh clone:  `make run` (the main job)  and  `make test` (the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install run test test-fast lint lint-cpp format-cpp redis

install: $(VENV)/.installed

# The full install: the light package (client, CLI, job store) plus the worker extra (torch,
# transformers, triton, xgrammar), the HTTP API's extra (FastAPI, uvicorn), the tests and the
# linters. torch is pinned to the exact CPU build that lies on this machine's disk; a looser pin
# would pull several GB of CUDA wheels.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[worker,serve,test,lint]'
	touch $@

redis:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
	  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no

run: install
	$(VENV)/bin/batchery run examples/chat.jsonl -o results.jsonl --errors errors.jsonl

# The Triton kernel tests run in a process of their own: the interpreter's global state is
# set when triton is first imported, and the rest of the suite imports it through transformers.
test: install redis
	$(PY) -m pytest -q -ra --ignore=tests/test_triton_kernels.py $(PYTEST_ARGS)
	$(PY) -m pytest -q -ra tests/test_triton_kernels.py

# Unit tests only: no worker processes, no private Redis servers, no real model (a few minutes).
test-fast: install redis
	$(PY) -m pytest -q -ra -m "not integration and not slow" --ignore=tests/test_triton_kernels.py $(PYTEST_ARGS)
	$(PY) -m pytest -q -ra -m "not integration and not slow" tests/test_triton_kernels.py

# ruff (lint and format), mypy (fully typed: engine, contract, engine service) and the import contract
# (layers only import downward, no cycles: [tool.importlinter] in pyproject.toml).
lint: install lint-cpp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy -p batchery.contract -p batchery.engine -p batchery.worker.service
	$(VENV)/bin/lint-imports

# The CPU kernels' C++ (engine/csrc/) in .clang-format's style: format-cpp rewrites the files, lint-cpp (part of
# lint, so CI runs it) only checks them. clang-format comes from PyPI, pinned in the lint extra.
CPP_FILES = $(wildcard engine/csrc/*.cpp engine/csrc/*.h)

format-cpp: install
	$(VENV)/bin/clang-format -i $(CPP_FILES)

lint-cpp: install
	$(VENV)/bin/clang-format --dry-run --Werror $(CPP_FILES)
