# operate-sidecar: every target does its own set-up on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench stress clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo ">> installing operate-sidecar and its dependencies into $(VENV)"
	@echo ">> (first time only: llama-cpp-python compiles llama.cpp from source, about 6 minutes on 2 cores)"
	@$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	@$(PY) -m clients.python.demo

test: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider --timeout=180 tests

bench: $(STAMP)
	@$(PY) -m bench.run

stress: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m slow tests

clean:
	rm -rf $(VENV) build *.egg-info
