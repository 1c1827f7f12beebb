# The virtual environment sees the system's packages, so a PyTorch that is already installed (for
# example a CUDA build) is used as it is; only when none is importable, or it is older than the 2.8 that
# pyproject.toml asks for, is TORCH_SPEC installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Test processes (pytest-xdist): one per core of a two-core CI machine; TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import sys, torch; sys.exit(torch.__version__ < '2.8')" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e ".[test]"
	touch $@

# The suite starts some two hundred interpreters: each reads the project's bytecode compiled here once instead of
# compiling every module again (PYTHONDONTWRITEBYTECODE stops them from caching it). worksteal: a process that runs
# out of tests takes half of the other's rest, so both end together.
test: install
	$(PY) -m compileall -q edm2 training cli scripts tests $(wildcard *.py)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

# The whole workflow on toy data in a few minutes on a CPU; outputs go to demo-out/.
demo: install
	PY=$(abspath $(PY)) bash scripts/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache
