"""Megatron integration: hooks that feed the metrics from a real Megatron training loop."""

from .instrumentation import MegatronInstrumentation, MetricHookError, default_metrics, instrument

__all__ = ["MegatronInstrumentation", "MetricHookError", "default_metrics", "instrument"]
