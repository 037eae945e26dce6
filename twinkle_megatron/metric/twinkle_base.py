"""Twinkle's ``Metric`` as the base of every metric here, when Twinkle is installed (never a dependency)."""

from __future__ import annotations

import importlib.util
import os


def twinkle_metric_base() -> type:
    """``twinkle.metric.Metric`` when Twinkle is installed and importable, else ``object``
    (``TWINKLE_MEGATRON_STANDALONE=1`` keeps Twinkle out)."""
    if os.environ.get("TWINKLE_MEGATRON_STANDALONE", "") not in ("", "0"):
        return object
    try:
        if importlib.util.find_spec("twinkle") is None:
            return object
        from twinkle.metric.base import Metric as TwinkleMetric
    except Exception:  # noqa: BLE001 - a broken or unrelated 'twinkle' must not break this package
        return object
    return TwinkleMetric
