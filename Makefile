# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test gpu-test docs plots clean

$(VENV)/.installed: pyproject.toml
	@echo "installing ase-tcfp32 and its dependencies into $(VENV) (once; a few minutes on a fresh machine)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -e ".[test]"
	@touch $@

demo: $(VENV)/.installed
	@$(PY) examples/md_water.py

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q tests

gpu-test: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu -n 4 tests

docs: $(VENV)/.installed
	$(PY) -m mkdocs build --strict
	@echo "documentation site in site/index.html"

plots: $(VENV)/.installed
	$(PY) benchmarks/plot.py
	$(PY) benchmarks/report.py

format: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
