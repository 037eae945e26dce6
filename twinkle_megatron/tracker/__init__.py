"""Step tracking: time, real-token throughput, Megatron-exact FLOPs and MFU, memory, EMAs, anomalies."""

from .config import TrackerConfig
from .flops import FlopsCoefficients, flops_coefficients, num_floating_point_operations
from .memory import MemorySnapshot, read_device_memory
from .peak import PEAK_TFLOPS, current_device_name, fp8_autocast_active, peak_tflops
from .smoothing import ExponentialMovingAverages, is_loss_spike
from .timer import StepTimer
from .tracker import MetricsTracker

__all__ = ["MetricsTracker", "TrackerConfig", "num_floating_point_operations", "flops_coefficients",
           "FlopsCoefficients", "peak_tflops", "PEAK_TFLOPS", "current_device_name", "fp8_autocast_active",
           "StepTimer", "MemorySnapshot", "read_device_memory", "ExponentialMovingAverages", "is_loss_spike"]
