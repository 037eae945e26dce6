"""Session-wide test setup (runs before any test module is imported)."""

import os

import torch

# Triton reads TRITON_INTERPRET once, when it is first imported -- and megatron-core imports it whenever it is
# installed. Without CUDA its kernels can only run in Triton's interpreter (tests/test_triton_token_stats.py),
# so the variable must be set before the first test module pulls Triton in. On a GPU it stays unset.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
