# One virtual environment per clone, created on first use. On hosts without an NVIDIA GPU the
# CPU build of torch is installed before the project, so pip never pulls the multi-GB CUDA
# build; set TORCH_INDEX_URL to a CPU wheel index if your pip has no local CPU wheel.
# SYSTEM_TORCH=1 builds the venv on the torch $(PYTHON) already has instead (a GPU node's CUDA
# build, a cluster without network): see the setup recipe below. A venv made that way is
# remembered (its stamp), so later make commands keep using it without the variable.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ifeq ($(SYSTEM_TORCH),)
SYSTEM_TORCH := $(if $(wildcard $(VENV)/.installed-system-torch),1,)
endif
STAMP := $(VENV)/$(if $(filter 1,$(SYSTEM_TORCH)),.installed-system-torch,.installed)
# GPUs when there are any, else 4 CPU processes over gloo.
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ $$n -gt 0 ] && echo $$n || echo 4)

.PHONY: setup lint format test test-fast train bench bench-gpu bench-gpu-prepare describe clean

setup: $(STAMP)

ifeq ($(SYSTEM_TORCH),1)
# SYSTEM_TORCH=1: the venv sees $(PYTHON)'s packages (--system-site-packages) and gets no torch
# and no pip upgrade of its own (nor pip and setuptools at all when $(PYTHON) has pip: the
# system's are used, not the older ones ensurepip bundles); setup stops unless that torch
# imports and is a supported one
# (parallel_dims/_torch_support.py: >=2.11,<2.16). meshtrain itself goes in without dependencies
# or build isolation, from this checkout (--no-index: no network; if that pip install cannot
# build, the checkout is put on the venv's path instead). Then pip adds what else is missing
# (runtime and dev extras) with torch pinned to the system's version, where an index is
# reachable; offline (PIP_NO_INDEX=1 skips the attempt's retries) it says what it could not get
# and setup still succeeds if what train.py and make bench-gpu need is there: torch, numpy and
# tokenizers (pytest, ruff etc. are for make test).
$(STAMP): pyproject.toml
	@echo "== SYSTEM_TORCH=1: setting up $(VENV) on the torch of $(PYTHON) (no torch install, no pip upgrade)"
	@$(PYTHON) -c "$$SYSTEM_TORCH_CHECK"
	@if test -e $(VENV)/pyvenv.cfg && ! grep -Eqs '^include-system-site-packages *= *true' $(VENV)/pyvenv.cfg; then \
		echo "error: $(VENV) exists without the system's packages (a plain make setup made it, with a torch of its own); remove it (make clean) and run SYSTEM_TORCH=1 make setup again" >&2; \
		exit 2; \
	fi
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $$($(PYTHON) -c "import pip" 2>/dev/null && echo --without-pip) $(VENV)
	@$(PY) -c "$$SYSTEM_TORCH_CHECK"
	@echo "== installing meshtrain from this checkout without dependencies (pip --no-deps --no-build-isolation --no-index -e .)"
	@$(PY) -m pip install --quiet --no-deps --no-build-isolation --no-index -e . \
		|| { echo "== pip could not install it offline (above: no setuptools >= 64 and wheel for $(PYTHON)?): putting the checkout on the venv's path instead (meshtrain.pth)"; \
			$(PY) -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'meshtrain.pth').write_text('$(CURDIR)\n')" || exit 1; \
			touch $(VENV)/.meshtrain-pth; }
	@$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/system-torch-constraint.txt
	@if test -e $(VENV)/.meshtrain-pth; then \
		echo "== skipping the other dependencies: install them with pip where an index is reachable: $(PY) -m pip install -c $(VENV)/system-torch-constraint.txt -e '.[dev,peer]'"; \
	else \
		echo "== the other dependencies and the dev/test extras, where pip can get them ($$(cat $(VENV)/system-torch-constraint.txt) pinned)"; \
		$(PY) -m pip install --quiet --no-build-isolation -c $(VENV)/system-torch-constraint.txt -e ".[dev,peer]" \
			|| echo "== warning: pip could not install some of them (no network?); make test needs them: rerun SYSTEM_TORCH=1 make setup where an index is reachable (rm $(STAMP) first)"; \
	fi
	@$(PY) -c "import importlib.util as u, sys; m = [n for n in ('numpy', 'tokenizers') if u.find_spec(n) is None]; m and sys.exit('error: train.py and make bench-gpu need numpy and tokenizers besides torch; missing for ' + sys.executable + ': ' + ', '.join(m) + ' (install them for $(PYTHON), or run SYSTEM_TORCH=1 make setup where an index is reachable)')"
	@touch $(STAMP)
	@echo "== $(VENV) is ready on the system's torch; run tools with $(VENV)/bin/python, $(VENV)/bin/torchrun (or: source $(VENV)/bin/activate)"
else
$(STAMP): pyproject.toml
	@echo "== setting up $(VENV) (first run, or pyproject.toml changed; about a minute)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip"
	@$(PY) -m pip install --quiet --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "== no NVIDIA GPU: installing the CPU build of torch (torch==2.13.0)"; \
		$(PY) -m pip install --quiet --no-compile "torch==2.13.0" $${TORCH_INDEX_URL:+--index-url $$TORCH_INDEX_URL}; \
	else \
		echo "== NVIDIA GPU found: pip picks a CUDA build of torch (torch>=2.11,<2.16)"; \
	fi
	@echo "== installing meshtrain and its dev/test dependencies (pytest, hypothesis, matplotlib, ruff, torchtitan for comparisons)"
	@$(PY) -m pip install --quiet --no-compile -e ".[dev,peer]"
	@echo "== compiling the bytecode of what a training process imports"
	@env -u PYTHONDONTWRITEBYTECODE $(PY) -c "import tools.forkserver_preload" 2>/dev/null || true
	@touch $(STAMP)
	@echo "== $(VENV) is ready; run tools with $(VENV)/bin/python, $(VENV)/bin/torchrun (or: source $(VENV)/bin/activate)"
endif
# pip compiles every installed module's bytecode on one core (about 45 CPU s for the 19,000
# files of torch and the dev extras), most of which no process ever imports. pip installs with
# --no-compile instead, and one import of what a training rank imports
# (tools/forkserver_preload.py: torch, its distributed and compile packages, torchao's float8,
# the trainer; about 2,900 files) writes their bytecode before the tests' processes all start at
# once and would each compile it again; what else a test imports is compiled at its first
# import (`make test` writes bytecode even where PYTHONDONTWRITEBYTECODE is set). Measured on a
# 2-core Intel Xeon host: that import 8.8 s wall, where compileall over all of site-packages on
# both cores took 26 s (fresh-clone setup 65-70 -> 41-46 s wall; docs/testing.md).

# Is $(PYTHON)'s (then the venv's) torch importable and supported? Run by SYSTEM_TORCH=1 setup.
define SYSTEM_TORCH_CHECK
import runpy, sys
support = runpy.run_path("parallel_dims/_torch_support.py")
low, high, spec = support["MIN_TORCH"], support["MAX_TORCH_EXCLUSIVE"], support["SUPPORTED_SPEC"]
fix = "give make a python that has one (PYTHON=/path/to/python3), or run make setup without SYSTEM_TORCH"
try:
    import torch
except ImportError as e:
    sys.exit(f"error: SYSTEM_TORCH=1 but {sys.executable} cannot import torch ({e}); {fix}")
version = support["parse_torch_version"](torch.__version__)
if version is None or not low <= version < high:
    sys.exit(f"error: SYSTEM_TORCH=1 but {sys.executable} has torch {torch.__version__}, outside {spec}; {fix}")
where = torch.__path__[0]
if sys.prefix != sys.base_prefix and where.startswith(sys.prefix):
    sys.exit(f"error: the venv {sys.prefix} has a torch of its own ({where}) hiding the system's; remove the venv (make clean) and run SYSTEM_TORCH=1 make setup again")
print(f"== {sys.executable}: torch {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU build'}) from {where}")
endef
export SYSTEM_TORCH_CHECK

# Lint and format check run first in `make test` (and so in CI); `make format` fixes formatting.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# pytest-xdist workers for `make test`: one more than the cores on a host without a GPU (at
# most 8). Many tests wait on one process at a time (torchrun start-up, a rendezvous, a
# deliberate timeout, a rank stopped after another failed) while a core sits idle: with two
# workers on a 2-core Intel Xeon host the main suite took 1010 s wall for 1634 CPU s of tests
# (386 core-seconds idle or in pytest itself), with three 855 s for 1622 CPU s (docs/testing.md).
# Each worker runs whole files (--dist loadfile): a module's shared fixtures (one launch for
# several tests) run once. TEST_WORKERS=1 runs in one process; a GPU host defaults to one.
TEST_WORKERS ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || { n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 8 ] && echo $$((n + 1)) || echo 8; })
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The numerics-sensitive tests run twice: on this CPU's own kernels, then in the second lane
# (tests/kernel_lane.py: ATen's scalar kernels and MKL's compatible GEMMs), so a test that
# holds only for one machine's kernels fails here rather than on another CPU; the same session
# runs the mesh tests again under the portable mesh builder. The lane runs after the main suite:
# started beside it at nice 10, the two sessions took 1098 s wall for 2032 CPU s (1.08x CPU s /
# 2 on 2 cores), one after the other 1185 s for 2181 CPU s (1.09x), fresh clones of the same
# tests on the same host half an hour apart (its speed drifts): no gain, as three workers leave
# the cores little idle time (docs/testing.md). Bytecode caching is on for the tests even where
# the environment sets PYTHONDONTWRITEBYTECODE: without it every collecting process rewrites
# the ~200 test modules' asserts again, about 3 CPU s each (the caches go to the gitignored
# __pycache__ folders).
test: lint
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q $(XDIST) tests
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m tests.kernel_lane -q $(XDIST)

test-fast: lint
	$(PY) -m pytest -q -m unit tests

train: $(STAMP)
	@$(PY) train.py --nproc_per_node=$(NPROC) --config train_configs/llama3.toml $(ARGS)

# Then docs/benchmarks.md, the one page of measured figures, is generated again from
# bench_results/*.json (benchmarks/report.py).
bench: $(STAMP)
	$(PY) -m benchmarks.run --out bench_results/bench.json
	$(PY) -m benchmarks.report

# One GPU: trainer vs a bare bf16 loop vs torchtitan's model, eager and compiled (docs/gpus.md).
# On a GPU node with its own CUDA torch and no network: SYSTEM_TORCH=1 make bench-gpu (the
# venv setup above needs no network), or run python -m benchmarks.gpu with that python from the
# repository root, no venv at all. Ends with the first-GPU-run checklist.
bench-gpu: $(STAMP)
	$(PY) -m benchmarks.gpu --out bench_results/gpu.json $(ARGS)

# The torchtitan rows of bench-gpu (its model and its own trainer) need torchtitan_ref and the
# wheels of ../shared (SHARED=path elsewhere): this copies them into the ignored .gpu/ (git
# ignores it through .git/info/exclude); carry .gpu to the GPU machine. Needs no venv.
SHARED ?= ../shared
bench-gpu-prepare:
	$(PYTHON) -m benchmarks.gpu --prepare-torchtitan $(SHARED)

describe: $(STAMP)
	$(PY) -m parallel_dims --world-size 4096 --dp-shard -1 --cp 2 --tp 8 --pp 4 --ep 64 --rank 17 --gpus-per-node 8

clean:
	rm -rf $(VENV) outputs .pytest_cache .hypothesis
