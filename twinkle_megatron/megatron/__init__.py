"""Megatron integration: hooks that feed the metrics from a real Megatron training loop."""

from .hook_failures import HookFailures, MetricHookError
from .instrumentation import MegatronInstrumentation, instrument
from .metric_choice import default_metrics
from .rollout_routing import RolloutRouting, RolloutRoutingMetric, attach_rollout_routing

__all__ = ["HookFailures", "MegatronInstrumentation", "MetricHookError", "RolloutRouting", "RolloutRoutingMetric",
           "attach_rollout_routing", "default_metrics", "instrument"]
