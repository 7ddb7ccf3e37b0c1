# Two set-up commands for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One thread: the CPU timings here swing wildly with two.
export OMP_NUM_THREADS ?= 1
export CODECARBON_LOG_LEVEL ?= error

.PHONY: venv demo test test-lowest test-gpu bench bench-gpu gpu-wheels gpu-check gpu-check-dry clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,all]"
	touch $(STAMP)

demo: venv
	$(PY) -m baler_lit.demo

test: venv
	$(PY) -m pytest -q -m "not gpu"

# The lowest supported Lightning (constraints-lowest.txt pins it) in a second venv: the integration tests that
# reach Lightning's hooks and private attributes (integration/lightning_internals.py).
LOWEST_VENV ?= .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_TESTS ?= tests/test_timeline.py tests/test_energy_callback.py tests/test_front_ends.py tests/test_ddp.py

$(LOWEST_STAMP): pyproject.toml constraints-lowest.txt
	test -x $(LOWEST_VENV)/bin/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q -c constraints-lowest.txt torch==2.13.0
	$(LOWEST_VENV)/bin/python -m pip install -q -c constraints-lowest.txt -e ".[dev,all]"
	touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/python -m pytest -q -m "not gpu" $(LOWEST_TESTS)

test-gpu: venv
	$(PY) -m pytest -q -m gpu

BENCHMARKS := overhead baler_speed baler_stream precision prediction_error power_limit_search workbench shaping_phases end_to_end_truth

bench: venv
	set -e; for b in $(BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py; done

# on a CUDA machine: NVML's semantics (read-only), the precision modes and the overhead beside Zeus on the GPU
bench-gpu: venv
	$(PY) benchmarks/nvml_semantics.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/precision.py --out benchmarks/results/precision_gpu.json
	OMP_NUM_THREADS=1 $(PY) benchmarks/overhead.py --out benchmarks/results/overhead_gpu.json

# A GPU machine with no network (issue 26; README "On a GPU machine with no network"). Here, with the
# registries: wheels of what its image lacks (this project's own included) into $(GPU_WHEELS), git-ignored.
# There: install them without a venv (--no-deps: --target ignores the image's packages, so resolving would
# ask for a torch the folder must not hold) and run every GPU part within 8 minutes; results in
# benchmarks/results (and $(OUT), where the device tool sets it). gpu-check-dry rehearses it here on fakes.
GPU_WHEELS ?= .gpu-wheels
GPU_SITE ?= /tmp/lightning-energy-site
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=

gpu-wheels: venv
	$(PY) benchmarks/gpu_check.py wheels --out $(GPU_WHEELS)

gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$(if $(PYTHONPATH),:$(PYTHONPATH)) PYTHONUNBUFFERED=1 \
		$(GPU_PYTHON) benchmarks/gpu_check.py $(if $(OUT),--copy-to $(OUT)) $(GPU_CHECK_ARGS)

gpu-check-dry: venv
	$(PY) benchmarks/gpu_check.py --dry-run $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) runs lightning_logs .pytest_cache
