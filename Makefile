# Two commands on a bare machine: `make run` (the whole system) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install install-test bench-search bench-write clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install install-test: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/memories up

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench-search: $(VENV)/.installed
	$(BIN)/memories bench search

bench-write: $(VENV)/.installed
	$(BIN)/memories bench write

clean:
	rm -rf $(VENV) .memories .pytest_cache
