# kvtier: the README's two commands are `make demo` and `make test`; both do all set-up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE
# The slowest tests are listed after every run (CI watches the 30-minute budget with it).
PYTEST_ARGS ?= --durations=25

.PHONY: setup demo test test-unit test-integration clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/kvtier doctor --no-load
	$(VENV)/bin/kvtier demo $(DEMO_ARGS)

# the unit suite, then the integration suite (one at a time: see scripts/test.sh)
test: setup
	@PY=$(PY) bash scripts/test.sh $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest -q -m "not integration" $(PYTEST_ARGS)

test-integration: setup
	$(PY) -m pytest -q -m integration $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
