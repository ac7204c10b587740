# capgate: the two commands a user needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The official MCP conformance suite (npm), pinned by conformance/package-lock.json.
CONFORMANCE_STAMP := conformance/node_modules/.installed

# `make eval`: its own venv with the eval extra (AgentDojo and the LLM clients it pulls in).
EVAL_VENV  ?= .venv-eval
EVAL_BIN   := $(EVAL_VENV)/bin
EVAL_STAMP := $(EVAL_VENV)/.installed

.PHONY: run test pytest bench lint typecheck check clean venv conformance conformance-deps eval eval-venv lock

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@# The compiled sqlglot build where the platform has a wheel for it; pure Python otherwise.
	-$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,fast]'
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
	$(BIN)/ruff check gateway mocks tests bench eval
	$(BIN)/ruff format --check gateway mocks tests bench eval

## Strict type checking of the shipped package.
typecheck: $(STAMP)
	$(BIN)/mypy

eval-venv: $(EVAL_STAMP)

$(EVAL_STAMP): pyproject.toml constraints.txt
	@test -x $(EVAL_BIN)/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_BIN)/python -m pip install --quiet --upgrade pip
	$(EVAL_BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,eval]'
	@touch $@

## AgentDojo (v1.2.1) through capgate: utility and attacks per suite, and a permissive baseline.
## EVAL_ARGS e.g. "--suites banking --json report.json" (python -m eval.agentdojo --help).
eval: $(EVAL_STAMP)
	$(EVAL_BIN)/python -m eval.agentdojo $(EVAL_ARGS)

check: test

## Refresh constraints.txt: the newest versions pyproject.toml allows, in a scratch venv (then
## run `make test` on them before committing the file).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet -e '.[dev,eval,fast]'
	{ sed -n '1,2p' constraints.txt; .venv-lock/bin/python -m pip freeze --exclude-editable \
	  | grep -v '^capgate'; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf .venv-lock
	$(PYTHON) deploy/sync_pins.py

clean:
	rm -rf $(VENV) $(EVAL_VENV) .pytest_cache .demo build *.egg-info conformance/node_modules
