"""The CUDA-to-CPU shim, shipped in the package (``twinkle_megatron.testing.cuda_shim``); re-exported for the tests."""

from twinkle_megatron.testing.cuda_shim import PATCHED_CUDA_FUNCTIONS, cpu_cuda_shim, is_cuda_device

__all__ = ["PATCHED_CUDA_FUNCTIONS", "cpu_cuda_shim", "is_cuda_device"]
