# Two entry points: `make train` (set up, then run the main job) and `make test` (set up, then run the tests).
# `make demo` times the KDA backends beside jax-linear-attention on this CPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train demo test bench-cpu clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "lineattn needs Python >= 3.12 (pyenv reads .python-version)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	@touch $(STAMP)

train: $(STAMP)
	$(PY) -m lineattn.train.cli fetch-data
	$(PY) -m lineattn.train.cli train --config configs/shakespeare.yaml --run-dir runs/shakespeare
	$(PY) -m lineattn.train.cli generate --run-dir runs/shakespeare --prompt "ROMEO." --max-new-tokens 300

demo: $(STAMP)
	$(PY) benchmarks/bench_kda.py --device cpu --T 1024 --H 2 --K 64 --V 64

test: $(STAMP)
	$(PY) -m pytest -n 2 -q --durations=20

bench-cpu: $(STAMP)
	$(PY) benchmarks/bench_kda.py --device cpu --T 2048 --H 4 --K 64 --V 64 --out benchmarks/results

clean:
	rm -rf $(VENV)
