"""Twinkle-compatible metrics with device states and one coalesced sync.

The package is built in layers, each importing only the ones before it (``tests/test_layering.py``):

1. ``inputs/``: a call's (inputs, outputs, keywords) become one normalised view per microbatch;
2. ``state/``: the ``Metric`` base (states declared once with their reduction), updates, per-dataset and
   per-position slices, the one coalesced sync, resuming;
3. ``tokens/``: the one pass over a microbatch's logits and what the logits metrics share;
4. the metrics: ``language/`` (accuracy, loss, token statistics, per-sample losses, embeddings, MoE routing,
   training values) and ``rl/`` (GRPO and its variants, PPO, DPO, completion rewards), neither importing the other;
5. ``collection.py``: many metrics fed by one call and reduced in one sync.

Everything outside ``metric/`` (the hooks of ``megatron/``, the ``tracker/``) uses the names below only.
"""

from .collection import MetricCollection
from .inputs.keywords import MetricInputWarning, check_layout_declared
from .inputs.shared_call import SharedCall
from .inputs.tensors import common_device, to_device, token_mask
from .language.accuracy import Accuracy
from .language.embedding import EmbeddingMetric
from .language.loss import LossMetric
from .language.moe_routing import ROUTER_LOSSES, MoERoutingMetric
from .language.sample_losses import SampleLosses
from .language.token_stats import TokenStatsMetric
from .language.train import TrainMetric
from .rl.completion_reward import CompletionRewardMetric
from .rl.dpo import DPOMetric
from .rl.grpo import CISPOMetric, GRPOMetric, GSPOMetric, PPOMetric
from .rl.ppo import PPOValueMetric
from .state.base import Metric, StateSpec
from .state.groups import TokenGroups, token_groups
from .state.sync import MetricSyncError, Number, SyncedStates, calculate_each, calculate_metrics, merge_results
from .tokens.logits_metric import LogitsMetric
from .tokens.logits_pass import TokenClasses, classify_tokens, give_token_classes, logits_token_stats

__all__ = [
    # the metrics and their base (Twinkle's API and this project's additions)
    "Metric", "StateSpec", "SyncedStates", "MetricCollection", "calculate_metrics", "LogitsMetric", "Accuracy",
    "LossMetric", "TokenStatsMetric", "TrainMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric", "DPOMetric",
    "PPOMetric", "PPOValueMetric", "EmbeddingMetric", "CompletionRewardMetric", "MetricSyncError", "SampleLosses",
    "MetricInputWarning", "MoERoutingMetric",
    # for the hooks (megatron/) and the tracker: one call shared by the metrics, the one sync, token
    # classification, slices, values
    "SharedCall", "Number", "calculate_each", "merge_results", "check_layout_declared", "token_mask", "TokenGroups",
    "token_groups", "TokenClasses", "classify_tokens", "give_token_classes", "logits_token_stats", "ROUTER_LOSSES",
    "common_device", "to_device",
]
