# Dev environment: torch is pinned to the CPU wheel on disk (a bare `torch` pulls a CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_DEV_CONSTRAINT ?= torch==2.13.0
WORLD_SIZE ?= 4
DEVICE_TRITON ?= 3.6.0
DEVICE_TRITON_DIR ?= .triton-device
DEVICE_TRITON_DIST := $(DEVICE_TRITON_DIR)/triton-$(DEVICE_TRITON).dist-info

.PHONY: install test demo bench lint clean gpu-check kernel-resources

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q "$(TORCH_DEV_CONSTRAINT)"
	$(PY) -m pip install -q -e ".[test,deepspeed,transformers]" "$(TORCH_DEV_CONSTRAINT)"
	# torchtitan without its heavy dependencies (datasets, wandb, ...): its MoE is all tests/test_torchtitan.py needs
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0

# The tests that compile kernels for sm_90 on the CPU (tests/test_kernel_inputs.py) build them with
# the GPU host's Triton, so that what they read is the code the GPU runs (README, "Without CUDA").
test: install $(DEVICE_TRITON_DIST)
	ALLTOALL_OPS_DEVICE_TRITON=$(DEVICE_TRITON_DIR) $(PY) -m pytest -q -x --durations=15

demo: install
	$(PY) -m examples.demo --world-size $(WORLD_SIZE)

bench: install
	$(PY) -m pip install -q -e ".[bench]" "$(TORCH_DEV_CONSTRAINT)"
	$(PY) -m benchmarks.bench --out results
	$(PY) -m benchmarks.moe_layer --out results/performance
	$(PY) -m benchmarks.ulysses --profile --out results/performance

lint: install
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check alltoall_ops tests benchmarks examples tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis $(DEVICE_TRITON_DIR)

# The GPU host's Triton (3.6), beside the one installed here: it lays tiles out differently
# (docs/benchmarks.md, twenty-sixth session). Needs the network once, for the wheel.
$(DEVICE_TRITON_DIST): | $(PY)
	$(PY) -m pip install -q --no-deps --upgrade --target $(DEVICE_TRITON_DIR) "triton==$(DEVICE_TRITON)"

# Registers, spills and SASS of the data-moving kernels as the GPU host builds them.
kernel-resources: install $(DEVICE_TRITON_DIST)
	PYTHONPATH=$(DEVICE_TRITON_DIR) $(PY) -m tools.kernel_resources $(KERNELS)

# On the GPU host (system python3 with torch preinstalled, no venv, no network): every test marked
# gpu (8 workers where pytest-xdist is installed: about 2 minutes warm, 3-5 on a fresh machine), then
# the SM-budget benchmark, whose table replaces results/overlap_gpu.md (docs/gpu.md).
GPU_TEST_WORKERS = $(shell python3 -c "import xdist" 2>/dev/null && echo "-n 8")
gpu-check:
	python3 -m pytest -q -m gpu -rf $(GPU_TEST_WORKERS) tests/test_*_gpu.py
	python3 -m benchmarks.overlap --out results --budgets 16 24 32 all
