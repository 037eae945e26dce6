"""Session-wide test setup (runs before any test module is imported)."""

import gc
import os

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported -- and megatron-core imports it whenever it is
# installed. Without CUDA its kernels can only run in Triton's interpreter (tests/test_triton_token_stats.py),
# so the variable must be set before the first test module pulls Triton in. On a GPU it stays unset.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests marked `cuda` (tests/test_cuda.py, what `make gpu-check` runs) need a CUDA device; without one they are
# skipped, unless TWINKLE_MEGATRON_CUDA_TESTS_ON_CPU=1 asks for their dry run on CPU (the kernel interpreted).
CUDA_TESTS_ON_CPU = os.environ.get("TWINKLE_MEGATRON_CUDA_TESTS_ON_CPU") == "1"


# The files that take longest (about 8 to 36 s each in a 2-core `make test`), in that order. They run first:
# pytest-xdist (--dist loadfile) hands out whole files in collection order, and a long file handed out last would
# leave the other worker idle until it ends.
LONGEST_FIRST = ("test_megatron_lm_loop.py", "test_demo.py", "test_fused_loss.py", "test_incidents.py",
                 "test_docs_examples.py", "test_forward_step.py", "test_slurm.py", "test_demo_incidents.py",
                 "test_rollout_mismatch.py", "test_megatron_instrument.py", "test_rollout_routing.py",
                 "test_layer_norms.py", "test_cli.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available() or CUDA_TESTS_ON_CPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs it)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # What collection imported (torch, megatron-core, the test modules: millions of objects) lives as long as the
    # session: frozen, the collector's full passes stop walking it, and the ranks forked for each test inherit it
    # frozen, so their collector never touches (and never copies) those pages.
    gc.freeze()
