# The README's two commands. Both create .venv when missing and install specpilot into it.
# make demo ARGS="--quick" passes options to `specpilot demo`; SPECPILOT_FLAGS="--threads 1" to `specpilot`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.specpilot-installed
# make test runs one pytest worker (pytest-xdist) per usable core, at most 4: each test uses one torch thread, so
# one process leaves the other cores idle. Cores as specpilot counts them (affinity and a cgroup CPU quota, where
# nproc sees only the affinity; read after setup, without torch). TEST_WORKERS=0 runs every test in one process.
TEST_WORKERS ?=
CORES_FOR_TESTS := from specpilot.drafting.cliargs import usable_cores; n = min(usable_cores(), 4); print(n if n >= 2 else 0)

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# Without a GPU take the local CPU torch wheel first: an unpinned torch would pull a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch>=2.4,<3"; \
	else \
		$(PIP) install -q torch==2.13.0 || $(PIP) install -q --index-url https://download.pytorch.org/whl/cpu "torch>=2.4,<3"; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/specpilot $(SPECPILOT_FLAGS) demo $(ARGS)

test: setup
	n="$(TEST_WORKERS)"; [ -n "$$n" ] || n=$$($(PY) -c "$(CORES_FOR_TESTS)"); \
	$(PY) -m pytest -q -n $$n --dist worksteal $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
