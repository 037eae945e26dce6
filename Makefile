# Every target sets up what it needs first: a virtual environment that reuses an
# installed torch (system site packages) or installs torch==2.13.0 when there is
# none, then this package in editable mode with megatron-core and the test tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.twinkle-megatron-installed
BACKENDS_STAMP := $(VENV)/.logging-backends-installed
TORCH_PIN := $(VENV)/torch-constraint.txt
# --no-compile: Python compiles a module when it is first imported; compiling every module of torch (or of
# transformers...) up front cost about 16 s of CPU per install, mostly for modules no test imports.
PIP_INSTALL := -m pip install -q --no-compile
# ...and writes it to __pycache__ then, for every later interpreter (a test session starts dozens: pytest's workers,
# the fork servers, the demo and the Slurm recipe's ranks), unless PYTHONDONTWRITEBYTECODE is set, as it is on the
# machines this project is developed on: there each interpreter compiled again every module it imported that had no
# cache (about 1.2 s of `import megatron.core`).
unexport PYTHONDONTWRITEBYTECODE

# Triton for the fused token-statistics kernel: the version torch 2.13 pins. Installed without dependencies
# (never touching torch) and only where none is importable (a CUDA torch brings its own).
TRITON_VERSION ?= 3.7.1

# `make test MCORE=0.14.0`: the suite against another megatron-core release, installed (pure Python, no
# dependencies) into .mcore/VERSION and put ahead of the venv's megatron-core on PYTHONPATH. 0.17 on declare
# Python >= 3.12 and run on 3.11 (--ignore-requires-python); 0.18 on import triton at `import megatron.core`,
# installed beside it (TRITON_VERSION, without dependencies: torch never changes) where none is importable.
MCORE ?=
# Extra pytest arguments (CI runs the megatron-core matrix without the suites no release changes: see .ci/run).
PYTEST_ARGS ?=
# `make test` runs the test files on this many pytest-xdist worker processes (0: in the pytest process itself, one
# test at a time). A serial run keeps a 2-core machine about 1.3 cores busy (the single-process tests use one, the
# forked gloo ranks wait on each other's collectives); two workers keep both cores busy. --dist loadfile keeps each
# file on one worker, so that a file's cached references and module fixtures are made once.
TEST_WORKERS ?= 2
ifneq ($(MCORE),)
MCORE_DIR := .mcore/$(MCORE)
MCORE_STAMP := $(MCORE_DIR)/.installed
TEST_ENV := PYTHONPATH=$(abspath $(MCORE_DIR))
endif

.PHONY: setup test test-backends test-slurm test-slurm-multinode test-twinkle test-bridge demo demo-moe lint bench \
	clean triton kernel-test gpu-check

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) $(PIP_INSTALL) torch==2.13.0
	$(PY) $(PIP_INSTALL) -e '.[test]'
	touch $(STAMP)

test: $(STAMP) $(MCORE_STAMP)
	$(TEST_ENV) $(PY) -c "from importlib.metadata import version; print('megatron-core', version('megatron-core'))"
	$(TEST_ENV) $(PY) -m pytest tests --ignore=tests/test_backends.py -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Order-only on the venv: a changed setup.py reinstalls this package, not the megatron-core release.
$(MCORE_STAMP): | $(STAMP)
	$(PY) $(PIP_INSTALL) --no-deps --ignore-requires-python --target $(MCORE_DIR) megatron-core==$(MCORE)
	$(TEST_ENV) $(PY) -c "import megatron.core" 2>/dev/null || $(TEST_ENV) $(PY) -c "import triton" 2>/dev/null || \
		$(PY) $(PIP_INSTALL) --no-deps --target $(MCORE_DIR) triton==$(TRITON_VERSION)
	$(TEST_ENV) $(PY) -c "import megatron.core"
	touch $@

# The logging backends against the real tensorboard, wandb, mlflow and swanlab (pinned in
# tests/requirements-backends.txt), with the venv's torch pinned so that no install can replace it.
test-backends: $(BACKENDS_STAMP)
	$(PY) -m pytest tests/test_backends.py

$(BACKENDS_STAMP): $(STAMP) tests/requirements-backends.txt
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)
	$(PY) $(PIP_INSTALL) -c $(TORCH_PIN) -r tests/requirements-backends.txt
	$(PY) -c "import sys, torch; pin = open('$(TORCH_PIN)').read().split('==')[1].strip(); \
	          sys.exit(None if torch.__version__ == pin else f'torch changed from {pin} to {torch.__version__}')"
	touch $@

# examples/slurm/train.sbatch on a real one-host Slurm (installed from the distribution when missing, root):
# start the cluster, run the jobs, stop the cluster whatever the outcome. Logs and job outputs stay in
# SLURM_TEST_DIR.
SLURM_TEST_DIR ?= /tmp/twinkle-slurm-test
test-slurm: $(STAMP)
	SLURM_TEST_DIR=$(SLURM_TEST_DIR) bash tests/slurm/cluster.sh start
	status=0; TWINKLE_SLURM_TEST=1 SLURM_CONF=$(SLURM_TEST_DIR)/slurm.conf $(PY) -m pytest tests/slurm -v -s \
		-p no:cacheprovider --basetemp=$(SLURM_TEST_DIR)/pytest || status=$$?; \
	SLURM_TEST_DIR=$(SLURM_TEST_DIR) bash tests/slurm/cluster.sh stop || status=$$?; \
	exit $$status

# The same recipe with --nodes=2 on a real two-host Slurm on this machine (root): network namespaces, one slurmd
# per host (tests/slurm/multinode.sh). The tests run in the hub's network namespace, where the controller is;
# the cluster is torn down whatever the outcome, and `stop` fails if a daemon, namespace or interface is left.
SLURM_MN_DIR ?= /tmp/twinkle-slurm-multinode
SLURM_MN_TIMEOUT ?= 1800
test-slurm-multinode: $(STAMP)
	SLURM_MN_DIR=$(SLURM_MN_DIR) bash tests/slurm/multinode.sh start
	status=0; SLURM_MN_DIR=$(SLURM_MN_DIR) timeout --kill-after=30 $(SLURM_MN_TIMEOUT) \
		bash tests/slurm/multinode.sh in-hub env TWINKLE_SLURM_MULTINODE_TEST=1 \
		SLURM_CONF=$(SLURM_MN_DIR)/slurm.conf $(PY) -m pytest tests/slurm/test_multinode.py -v -s \
		-p no:cacheprovider --basetemp=$(SLURM_MN_DIR)/pytest || status=$$?; \
	SLURM_MN_DIR=$(SLURM_MN_DIR) bash tests/slurm/multinode.sh stop || status=$$?; \
	exit $$status

# Twinkle's own code as the caller and the oracle: twinkle-kit 0.5.1 with its dependencies (transformers,
# datasets, modelscope...) in a venv of its own, torch held at the installed version by a constraints file.
TWINKLE_VENV ?= .venv-twinkle
TWINKLE_PY := $(TWINKLE_VENV)/bin/python
TWINKLE_STAMP := $(TWINKLE_VENV)/.twinkle-installed

$(TWINKLE_STAMP): setup.py tests/twinkle-constraints.txt
	test -x $(TWINKLE_PY) || $(PYTHON) -m venv $(TWINKLE_VENV)
	$(TWINKLE_PY) -c "import torch" 2>/dev/null || $(TWINKLE_PY) $(PIP_INSTALL) torch==2.13.0
	$(TWINKLE_PY) $(PIP_INSTALL) -c tests/twinkle-constraints.txt twinkle-kit==0.5.1 -e '.[test]'
	touch $(TWINKLE_STAMP)

test-twinkle: $(TWINKLE_STAMP)
	$(TWINKLE_PY) -m pytest tests/test_twinkle_integration.py tests/test_twinkle_docs.py tests/test_user_metrics.py

# Megatron-Bridge 0.6.2's own training code as the caller (its gpt_step, state injection, train_step, training_log,
# evaluation and GlobalState with its loggers, tests/bridge): the tests download its wheel into .cache/ (pip download
# --no-deps) and import it behind the smallest stubs. Bridge needs megatron-core >= 0.18: 0.19.2 is installed without
# dependencies into the matrix's folder (.mcore/0.19.2, what `make test MCORE=0.19.2` uses: CI installs it once for
# both), put first on PYTHONPATH (its metadata asks for Python >= 3.12, its code runs on 3.11), with Triton, which it
# imports. The logging packages (test-backends' install) are Bridge's loggers.
BRIDGE_MCORE ?= 0.19.2
BRIDGE_MCORE_DIR := .mcore/$(BRIDGE_MCORE)

test-bridge: $(BACKENDS_STAMP) triton $(BRIDGE_MCORE_DIR)/.installed
	TWINKLE_BRIDGE_TEST=1 PYTHONPATH=$(abspath $(BRIDGE_MCORE_DIR)) $(PY) -m pytest tests/bridge

# Defined here only when MCORE names another release: with MCORE=$(BRIDGE_MCORE) the matrix's rule makes this stamp.
ifneq ($(MCORE),$(BRIDGE_MCORE))
$(BRIDGE_MCORE_DIR)/.installed: | $(STAMP)
	$(PY) $(PIP_INSTALL) --no-deps --ignore-requires-python --target $(BRIDGE_MCORE_DIR) \
		megatron-core==$(BRIDGE_MCORE)
	touch $@
endif

demo: $(STAMP)
	$(PY) examples/train_gpt.py --run-name demo --log-dir runs
	$(PY) -m twinkle_megatron.cli plot runs/demo/metrics.jsonl -o runs/demo/plots

# The MoE variant: 4 experts top-2 per layer, PP2 × DP2 × EP2 on 4 CPU ranks; routing health and its heat map.
demo-moe: $(STAMP)
	$(PY) examples/train_gpt.py --tp 1 --pp 2 --dp 2 --ep 2 --moe-experts 4 --moe-topk 2 --run-name demo-moe \
		--log-dir runs
	$(PY) -m twinkle_megatron.cli plot runs/demo-moe/metrics.jsonl -o runs/demo-moe/plots

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do $(PY) $$script || exit 1; done

triton: $(STAMP)
	@$(PY) -c "import triton" 2>/dev/null || $(PY) $(PIP_INSTALL) --no-deps triton==$(TRITON_VERSION)

# The Triton kernel under Triton's interpreter on CPU (no GPU needed), the selection rule, gpu-check's CPU parts.
kernel-test: triton
	TRITON_INTERPRET=1 $(PY) -m pytest tests/test_triton_token_stats.py tests/test_kernel_select.py tests/test_gpu_check.py

# On one CUDA device: the `cuda` tests (with the kernel's tests, compiled), the kernel check that writes the record
# kernel="auto" reads (twinkle-megatron kernel-check), then the timings (benchmarks/gpu_timings.py). Without CUDA
# it says so and exits 0.
gpu-check: $(STAMP)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "gpu-check on $$($(PY) -c 'import torch; print(torch.cuda.get_device_name())'): tests, kernel check, timings"; \
		$(PY) -m pytest tests/test_cuda.py tests/test_triton_token_stats.py tests/test_kernel_select.py -p no:cacheprovider \
		&& $(PY) -m twinkle_megatron.cli kernel-check && $(PY) benchmarks/gpu_timings.py; \
	else \
		echo "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing was checked; on CPU, make kernel-test tests the kernel under Triton's interpreter"; \
	fi

clean:
	rm -rf $(VENV) $(TWINKLE_VENV) .mcore .cache build *.egg-info .pytest_cache .ruff_cache
