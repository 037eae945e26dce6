"""twinkle-megatron: Twinkle's metric API, correct and cheap under Megatron's TP/PP/CP/DP."""

from .metric import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    MetricInputWarning,
    MetricSyncError,
    PPOMetric,
    PPOValueMetric,
    TokenStatsMetric,
    TrainMetric,
)
from .parallel import ParallelContext
from .tracker import MetricsTracker, TrackerConfig
from .version import __version__

__all__ = ["Metric", "MetricCollection", "Accuracy", "LossMetric", "TokenStatsMetric", "TrainMetric", "GRPOMetric",
           "GSPOMetric", "CISPOMetric", "PPOMetric", "PPOValueMetric", "DPOMetric", "EmbeddingMetric",
           "CompletionRewardMetric", "ParallelContext", "MetricsTracker", "TrackerConfig", "MetricSyncError",
           "MetricInputWarning",
           "__version__"]
