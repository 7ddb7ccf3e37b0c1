# Two set-up commands for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One thread: the CPU timings here swing wildly with two.
export OMP_NUM_THREADS ?= 1
export CODECARBON_LOG_LEVEL ?= error

.PHONY: venv demo test test-durations test-lowest test-gpu bench bench-gpu gpu-wheels gpu-check gpu-check-dry clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,all]"
	touch $(STAMP)

demo: venv
	$(PY) -m baler_lit.demo

# Test processes in parallel (pytest-xdist): one per CPU ("logical"); TEST_WORKERS=0 runs them in this process.
# The schedule (tests/suite_schedule.py): a module's tests run on one worker, the heaviest modules go first.
TEST_WORKERS ?= logical
SCHEDULE := --dist loadfile --no-loadscope-reorder

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(SCHEDULE) -m "not gpu"

# Record each test's seconds in tests/durations.json, the order the schedule starts them in.
test-durations: venv
	LIGHTNING_ENERGY_RECORD_DURATIONS=$(CURDIR)/tests/durations.json $(PY) -m pytest -q -n $(TEST_WORKERS) $(SCHEDULE) -m "not gpu"

# The lowest supported Lightning (constraints-lowest.txt pins 2.5.6) in place of the venv's, for the integration
# tests that reach Lightning's hooks and private attributes (integration/lightning_internals.py): lightning and
# pytorch-lightning 2.5.6 alone (their dependencies are the venv's: the same ranges) in $(LOWEST_SITE), first on
# PYTHONPATH. The first command fails unless that is the Lightning the tests import.
LOWEST_SITE ?= .lightning-lowest
LOWEST_STAMP := $(LOWEST_SITE)/.installed
LOWEST_TESTS ?= tests/test_timeline.py tests/test_energy_callback.py tests/test_front_ends.py tests/test_ddp.py

$(LOWEST_STAMP): constraints-lowest.txt $(STAMP)
	rm -rf $(LOWEST_SITE)
	$(PY) -m pip install -q --no-deps --no-compile --target $(LOWEST_SITE) -c constraints-lowest.txt lightning pytorch-lightning
	touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	PYTHONPATH=$(CURDIR)/$(LOWEST_SITE) $(PY) -c "import lightning, lightning.pytorch as pl; \
		assert lightning.__version__ == pl.__version__ == '2.5.6', lightning.__version__; print('Lightning', lightning.__version__)"
	PYTHONPATH=$(CURDIR)/$(LOWEST_SITE) $(PY) -m pytest -q -n $(TEST_WORKERS) $(SCHEDULE) -m "not gpu" $(LOWEST_TESTS)

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
	rm -rf $(VENV) $(LOWEST_SITE) runs lightning_logs .pytest_cache
