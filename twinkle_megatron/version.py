"""The package's version: one place, read by ``twinkle_megatron.__version__``, the CLI, the run config and setup.py."""

__version__ = "0.1.0"
