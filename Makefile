# Set-up and everyday commands. Each target creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check typecheck chaos parity peer-torch bench clean

# setup.py and the C source: an install rebuilds the compiled gather (cachestore/format/_gather.c).
$(STAMP): pyproject.toml setup.py cachestore/format/_gather.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is available locally; other versions download gigabytes.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m benchmarks.demo

# The suite CI runs (.ci/run): every check once, in minutes. Tests marked `long` (more backends,
# collates and stopping points of a matrix whose diagonal runs here: tests/marks.py) wait for `check`.
# TEST_JOBS pytest processes (pytest-xdist): a test spends most of its time waiting on the processes
# it starts, so two of them keep two cores busy where one left them idle half the time. The tests of a
# Ray cluster or a SeaweedFS server stay in one process each (xdist_group), which starts it once.
TEST_JOBS ?= 2
test: typecheck
	$(PY) -m pytest -q -m "not long" -n $(TEST_JOBS) --dist loadgroup

# Everything, for a change that touches the engine or the loader's epochs: the whole suite with its
# long variations, the full chaos run, the parity suite at length, and torch's own DataLoader tests
# through CachedLoader where a copy of them is at PEER_TORCH (skipped, with a word, where not).
PEER_TORCH ?= ../shared/peer_torch
check: typecheck
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup
	$(MAKE) chaos
	$(MAKE) parity
	$(MAKE) peer-torch

peer-torch: $(STAMP)
	@if [ -x "$(PEER_TORCH)/run.sh" ]; then PROJ=$(CURDIR) MODES="nocache cachewarm" "$(PEER_TORCH)/run.sh"; \
	else echo "peer-torch: no torch DataLoader test copy at PEER_TORCH=$(PEER_TORCH); skipped"; fi

# The storage engine and the executors are typed strictly; the rest of the loader with mypy's defaults
# (pyproject.toml, [tool.mypy]: one run, so torch's and numpy's stubs are analysed once).
typecheck: $(STAMP)
	$(PY) -m mypy cachestore/ loader/

# Randomised fault scenarios against real processes and files (tests/chaos). CHAOS_SEED and
# CHAOS_N reproduce and size a run (default 200 scenarios); `make test` runs eleven fixed scenarios
# that meet every fault kind, `make check` twenty.
chaos: $(STAMP)
	$(PY) -m tests.chaos

# The parity suite at length (tests/loader/test_parity.py): every epoch kind, backend and collate
# against torch's DataLoader, PARITY_EXAMPLES generated examples per test case (shrunk when one
# fails), PARITY_SEED to reproduce a run; a bounded run of it is part of `make test`.
PARITY_EXAMPLES ?= 200
PARITY_SEED ?= 0
parity: $(STAMP)
	PARITY_EXAMPLES=$(PARITY_EXAMPLES) PARITY_SEED=$(PARITY_SEED) $(PY) -m pytest -q -o faulthandler_timeout=0 tests/loader/test_parity.py

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info cachestore/format/*.so
