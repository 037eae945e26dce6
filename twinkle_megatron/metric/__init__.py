"""Twinkle-compatible metrics with device states and one coalesced sync."""

from .accuracy import Accuracy
from .base import Metric, StateSpec
from .collection import MetricCollection, calculate_metrics
from .loss import LossMetric
from .train import TrainMetric

__all__ = ["Metric", "StateSpec", "MetricCollection", "calculate_metrics", "Accuracy", "LossMetric", "TrainMetric"]
