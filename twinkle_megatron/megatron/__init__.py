"""Megatron integration: hooks that feed the metrics from a real Megatron training loop."""

from .hook_failures import HookFailures, MetricHookError
from .instrumentation import MegatronInstrumentation, instrument
from .metric_choice import default_metrics

__all__ = ["HookFailures", "MegatronInstrumentation", "MetricHookError", "default_metrics", "instrument"]
