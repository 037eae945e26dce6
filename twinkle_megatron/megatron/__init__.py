"""Megatron integration: hooks that feed the metrics from a real Megatron training loop."""

from .instrumentation import HookFailures, MegatronInstrumentation, MetricHookError, default_metrics, instrument

__all__ = ["HookFailures", "MegatronInstrumentation", "MetricHookError", "default_metrics", "instrument"]
