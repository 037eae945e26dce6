# Every target sets up what it needs first: a virtual environment that reuses an
# installed torch (system site packages) or installs torch==2.13.0 when there is
# none, then this package in editable mode with megatron-core and the test tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.twinkle-megatron-installed

.PHONY: setup test test-slurm demo lint bench clean

setup: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

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

demo: $(STAMP)
	$(PY) examples/train_gpt.py --run-name demo --log-dir runs
	$(PY) -m twinkle_megatron.cli plot runs/demo/metrics.jsonl -o runs/demo/plots

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	@for script in benchmarks/bench_*.py; do $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
