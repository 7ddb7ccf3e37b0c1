# Two set-up commands for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One thread: the CPU timings here swing wildly with two.
export OMP_NUM_THREADS ?= 1
export CODECARBON_LOG_LEVEL ?= error

.PHONY: venv demo test test-gpu bench bench-gpu clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bso-server]"
	touch $(STAMP)

demo: venv
	$(PY) -m baler_lit.demo

test: venv
	$(PY) -m pytest -q -m "not gpu"

test-gpu: venv
	$(PY) -m pytest -q -m gpu

BENCHMARKS := overhead baler_speed baler_stream precision prediction_error power_limit_search workbench shaping_phases

bench: venv
	set -e; for b in $(BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py; done

# on a CUDA machine: NVML's semantics (read-only), the precision modes and the overhead beside Zeus on the GPU
bench-gpu: venv
	$(PY) benchmarks/nvml_semantics.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/precision.py --out benchmarks/results/precision_gpu.json
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py --out benchmarks/results/overhead_gpu.json

clean:
	rm -rf $(VENV) runs lightning_logs .pytest_cache
