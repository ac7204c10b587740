# capgate: the two commands a user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The official MCP conformance suite (npm), pinned by conformance/package-lock.json.
CONFORMANCE_STAMP := conformance/node_modules/.installed

.PHONY: run test pytest bench lint typecheck check clean venv conformance conformance-deps

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# The compiled sqlglot build where the platform has a wheel for it; pure Python otherwise.
	-$(BIN)/python -m pip install --quiet -e '.[dev,fast]'
	@touch $(STAMP)

## Start capgate on 127.0.0.1:8787 with policies/example.yaml, memory state and the mock upstreams.
run: $(STAMP)
	$(BIN)/python -m mocks.demo

## Lint, type-check, then run the whole test suite (what CI runs).
test: lint typecheck pytest

## The test suite alone (its e2e tests run the MCP conformance suite, so it needs Node too).
pytest: $(STAMP) $(CONFORMANCE_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Install the MCP conformance suite from conformance/package-lock.json (needs node and npm).
conformance-deps: $(CONFORMANCE_STAMP)

$(CONFORMANCE_STAMP): conformance/package.json conformance/package-lock.json
	cd conformance && npm ci --no-audit --no-fund
	@touch $@

## The MCP conformance suite against mocks/conformance_server.py, directly and through capgate.
conformance: $(STAMP) $(CONFORMANCE_STAMP)
	$(BIN)/python -m mocks.conformance $(CONFORMANCE_ARGS)

## Throughput and latency: direct call vs bare proxy vs capgate, as ratios in one run.
bench: $(STAMP)
	$(BIN)/python -m bench.sql_bench
	$(BIN)/python -m bench.record_bench
	$(BIN)/python -m bench.run $(BENCH_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gateway mocks tests bench
	$(BIN)/ruff format --check gateway mocks tests bench

## Strict type checking of the shipped package.
typecheck: $(STAMP)
	$(BIN)/mypy

check: test

clean:
	rm -rf $(VENV) .pytest_cache .demo build *.egg-info conformance/node_modules
