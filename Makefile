# Two entry points: `make demo` (set up, then run the main job) and `make test` (set up, then run the tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench-cpu clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "lineattn needs Python >= 3.12 (pyenv reads .python-version)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) benchmarks/bench_kda.py --device cpu --T 1024 --H 2 --K 64 --V 64

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_kda.py --device cpu --T 2048 --H 4 --K 64 --V 64 --out benchmarks/results

clean:
	rm -rf $(VENV)
