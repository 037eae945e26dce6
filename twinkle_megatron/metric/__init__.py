"""Twinkle-compatible metrics with device states and one coalesced sync."""

from .accuracy import Accuracy
from .base import Metric, StateSpec
from .collection import MetricCollection
from .completion_reward import CompletionRewardMetric
from .dpo import DPOMetric
from .embedding import EmbeddingMetric
from .grpo import GRPOMetric
from .grpo_variants import CISPOMetric, GSPOMetric, PPOMetric
from .keywords import MetricInputWarning
from .logits_metric import LogitsMetric
from .loss import LossMetric
from .ppo import PPOValueMetric
from .sample_losses import SampleLosses
from .sync import MetricSyncError, SyncedStates, calculate_metrics
from .token_stats import TokenStatsMetric
from .train import TrainMetric

__all__ = ["Metric", "StateSpec", "SyncedStates", "MetricCollection", "calculate_metrics", "LogitsMetric", "Accuracy",
           "LossMetric", "TokenStatsMetric", "TrainMetric", "GRPOMetric", "GSPOMetric", "CISPOMetric", "DPOMetric",
           "PPOMetric", "PPOValueMetric", "EmbeddingMetric", "CompletionRewardMetric", "MetricSyncError",
           "SampleLosses", "MetricInputWarning"]
