# The two commands of the README: `make demo` and `make test`. Both install what they need first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test acceptance install kafka up down bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

kafka: $(STAMP)
	$(BIN)/gpupool kafka fetch

demo: kafka
	$(BIN)/gpupool demo

test: kafka
	$(BIN)/python -m pytest -q -p no:cacheprovider --ignore=tests/acceptance tests

# seed 004's four acceptance groups against a live stack of their own; the report a buyer reads lands in docs/acceptance
acceptance: kafka
	$(BIN)/gpupool acceptance report --out docs/acceptance

up: kafka
	$(BIN)/gpupool up

down: $(STAMP)
	$(BIN)/gpupool down

clean:
	rm -rf $(VENV) .gpupool
