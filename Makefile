# The README's two commands. Both create .venv when missing and install specpilot into it.
# make demo ARGS="--quick" passes options to `specpilot demo`; SPECPILOT_FLAGS="--threads 1" to `specpilot`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.specpilot-installed
# make test runs one pytest worker (pytest-xdist) per core, at most 4: each test uses one torch thread, so one
# process leaves the other cores idle. TEST_WORKERS=0 runs every test in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 4 ] && n=4; [ "$$n" -lt 2 ] && n=0; echo $$n)

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
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
