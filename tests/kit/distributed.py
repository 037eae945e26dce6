"""The multi-rank runner, public in the package (``twinkle_megatron.testing.distributed``); re-exported for tests."""

from twinkle_megatron.testing.distributed import Layout, WorkerError, run_distributed

__all__ = ["Layout", "WorkerError", "run_distributed"]
