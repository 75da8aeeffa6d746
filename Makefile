# The two commands of the README: `make demo` and `make test`. Both install what they need first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install kafka up down bench clean

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
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

up: kafka
	$(BIN)/gpupool up

down: $(STAMP)
	$(BIN)/gpupool down

clean:
	rm -rf $(VENV) .gpupool
