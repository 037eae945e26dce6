"""twinkle-megatron: Twinkle's metric API, correct and cheap under Megatron's TP/PP/CP/DP."""

from .metric import Accuracy, LossMetric, Metric, MetricCollection, TrainMetric
from .parallel import ParallelContext

__version__ = "0.1.0"

__all__ = ["Metric", "MetricCollection", "Accuracy", "LossMetric", "TrainMetric", "ParallelContext", "__version__"]
