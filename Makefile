# Set-up and checks. `make test` works from a fresh clone: it creates .venv,
# installs the CPU torch wheel, the package with its dev/bench extras, Azurite
# (npm) into .tools/ and Ceph radosgw (Debian packages, as root), then runs
# pytest. Stamps make repeats fast.
#
# Tiers: `make test` proves every promise once (each crash kind, backend, fault
# kind, resume, the demo's short form); `make test-soak` runs the repetitions
# kept for statistics (the `soak` marker: hundreds of kill trials, big-memory
# runs, benchmark smoke runs, long demo configurations); `make test-gpu` the
# CUDA path. CI (.ci/run) runs test, test-soak, then lint.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
AZURITE := .tools/node_modules/.bin/azurite-blob
INSTALL_STAMP := $(VENV)/.dcp-volumes-installed
RADOSGW := /usr/bin/radosgw
PYTEST_ARGS ?=
# Two pytest-xdist workers (these machines have two cores); `loadgroup` keeps
# each `xdist_group` (radosgw, the kill and timing tests) on one worker.
XDIST ?= -n 2 --dist loadgroup

.PHONY: test test-soak test-gpu lint demo setup constraints

setup: $(INSTALL_STAMP) $(AZURITE) $(RADOSGW)

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and on its own: the CPU wheel lies on this machine's disk and
# pip finds it through the machine's pip config. Installed only when missing
# or of another version, so pip never reaches for a (CUDA) torch from an index.
# Re-runs when pyproject.toml changes (new dependencies).
$(INSTALL_STAMP): pyproject.toml constraints.txt | $(PY)
	if ! $(PY) -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "$(TORCH_VERSION)")' 2>/dev/null; then \
		$(PY) -m pip install 'torch==$(TORCH_VERSION)'; \
	fi
	$(PY) -m pip install -c constraints.txt -e '.[dev,bench]'
	touch $@

# From tools/package-lock.json: every transitive version pinned, so a fresh
# machine gets the tree that was tested (a bare `npm install azurite@X` takes
# the newest match of each range, which the registry may not hold).
$(AZURITE): tools/package.json tools/package-lock.json
	mkdir -p .tools
	cp tools/package.json tools/package-lock.json .tools/
	npm ci --prefix .tools --no-audit --no-fund --loglevel=error
	test -x $@
	touch -h $@

# Ceph's S3 server for the conformance suite (testkit/radosgw.py runs a private
# one-node cluster on 127.0.0.1; nothing is configured system-wide).
$(RADOSGW):
	bash testkit/install_radosgw.sh

# The `serial` tests (deadlines of about a second) run alone once the workers are
# done; exit status 5 is "none of them selected" (a PYTEST_ARGS subset).
test: setup
	$(PY) -m pytest tests -m "not soak and not serial" $(XDIST) $(PYTEST_ARGS)
	$(PY) -m pytest tests -m "serial and not soak" $(PYTEST_ARGS) || test $$? -eq 5

test-soak: setup
	$(PY) -m pytest tests -m soak $(XDIST) $(PYTEST_ARGS)

# The GPU path (tests/test_gpu.py and the other `gpu` tests, soak ones included),
# on a machine with a CUDA device; without one they are skipped, with the
# reason. `make test` runs the short ones too, so CI skips them there.
test-gpu: setup
	$(PY) -m pytest tests -m gpu $(PYTEST_ARGS)

lint: $(INSTALL_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: setup
	$(VENV)/bin/dcp-volumes demo

# Re-pin constraints.txt from a .venv that works (keeps its header comment).
constraints: $(INSTALL_STAMP)
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable \
		| grep -v -e '^torch==' -e '^dcp.volumes'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
