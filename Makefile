# One virtual environment per clone, created on first use. On hosts without an NVIDIA GPU the
# CPU build of torch is installed before the project, so pip never pulls the multi-GB CUDA
# build; set TORCH_INDEX_URL to a CPU wheel index if your pip has no local CPU wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# GPUs when there are any, else 4 CPU processes over gloo.
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ $$n -gt 0 ] && echo $$n || echo 4)

.PHONY: setup lint format test test-fast train bench bench-gpu describe clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "== setting up $(VENV) (first run, or pyproject.toml changed; about a minute)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "== no NVIDIA GPU: installing the CPU build of torch (torch==2.13.0)"; \
		$(PY) -m pip install --quiet "torch==2.13.0" $${TORCH_INDEX_URL:+--index-url $$TORCH_INDEX_URL}; \
	else \
		echo "== NVIDIA GPU found: pip picks a CUDA build of torch (torch>=2.11,<2.16)"; \
	fi
	@echo "== installing meshtrain and its dev/test dependencies (pytest, hypothesis, matplotlib, ruff, torchtitan for comparisons)"
	@$(PY) -m pip install --quiet -e ".[dev,peer]"
	@touch $(STAMP)
	@echo "== $(VENV) is ready; run tools with $(VENV)/bin/python, $(VENV)/bin/torchrun (or: source $(VENV)/bin/activate)"

# Lint and format check run first in `make test` (and so in CI); `make format` fixes formatting.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# pytest-xdist workers for `make test`: 2 without a GPU. Many tests wait on one process at a
# time (torchrun start-up, a 1-process run, a deliberate timeout) while a core sits idle; two
# workers keep both cores busy. Each worker runs whole files (--dist loadfile): a module's
# shared fixtures (one launch for several tests) run once. TEST_WORKERS=1 runs in one process.
TEST_WORKERS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 2)
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The numerics-sensitive tests run twice: on this CPU's own kernels, then in the second-kernel
# lane (tests/kernel_lane.py: ATen's scalar kernels and MKL's compatible GEMMs), so a test that
# holds only for one machine's kernels fails here rather than on another CPU.
test: lint
	$(PY) -m pytest -q --durations=25 $(XDIST) tests
	$(PY) -m tests.kernel_lane -q $(XDIST)
	MESHTRAIN_MESH_BUILDER=portable $(PY) -m pytest -q $(XDIST) tests/unit/test_fake_build.py \
		tests/distributed/test_parallel_dims_gloo.py tests/distributed/test_parallelize_equivalence.py

test-fast: lint
	$(PY) -m pytest -q -m unit tests

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) train.py --config train_configs/llama3.toml $(ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run --out bench_results/bench.json

# One GPU: trainer vs a bare bf16 loop vs torchtitan's model, eager and compiled (see README).
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu --out bench_results/gpu.json $(ARGS)

describe: $(STAMP)
	$(PY) -m parallel_dims --world-size 4096 --dp-shard -1 --cp 2 --tp 8 --pp 4 --ep 64 --rank 17 --gpus-per-node 8

clean:
	rm -rf $(VENV) outputs bench_results .pytest_cache .hypothesis
