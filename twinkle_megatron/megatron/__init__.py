"""Megatron integration: hooks that feed the metrics from a real Megatron training loop."""

from .instrumentation import HookFailures, MegatronInstrumentation, MetricHookError, default_metrics, instrument
from .rollout_routing import RolloutRouting, RolloutRoutingMetric, attach_rollout_routing

__all__ = ["HookFailures", "MegatronInstrumentation", "MetricHookError", "RolloutRouting", "RolloutRoutingMetric",
           "attach_rollout_routing", "default_metrics", "instrument"]
