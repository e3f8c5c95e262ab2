# Two commands on a fresh machine: `make train` and `make test`.
# Both create .venv if it is missing and install leantrain into it (torch pinned to the
# CPU wheel this kind of machine carries; the library itself only asks for torch>=2.11).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.leantrain-installed
TORCH  ?= torch==2.13.0
OUT    ?= runs/default
STEPS  ?= 200

.PHONY: setup train test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(BIN)/leantrain train --preset tiny --steps $(STEPS) --out $(OUT) --forge --agoq

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=30 -n 2 --dist loadfile   # two workers: one a core, a file's tests on one

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not benchmark and not slow and not distributed"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
