# Every target that needs Python creates .venv and installs on first use; a no-op afterwards.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install test lint run clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, by exact pin, so pip takes the CPU wheel this machine kind carries.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(STAMP) lint
	$(VENV)/bin/pytest tests

run: $(STAMP)
	$(PY) -m flows.training --config examples/digits_cnn.yaml

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
