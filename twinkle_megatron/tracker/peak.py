"""Peak dense tensor-core TFLOP/s per device, looked up by exact device name.

MFU is only as good as its denominator. A device is found by its *exact*
name as ``torch.cuda.get_device_name()`` reports it (whitespace trimmed):
matching a substring gives an H100 PCIe (756 TFLOP/s) the SXM peak (989), and
guessing a peak for an unknown device has produced MFUs above 500%. An unknown
device, a precision the device has no tensor cores for, or no GPU at all gives
``None``, and the tracker then reports no MFU; ``peak_tflops=`` overrides.

Numbers are the vendors' datasheet peaks *without* structured sparsity (NVIDIA
prints "with sparsity" figures, twice these), per GPU, in TFLOP/s:

* NVIDIA H100 SXM5 / PCIe / NVL: H100 datasheet (nvidia.com/en-us/data-center/h100):
  BF16 1,979 / 1,513 / 1,671 and FP8 3,958 / 3,026 / 3,341 with sparsity.
* NVIDIA H200 SXM / NVL: H200 datasheet (nvidia.com/en-us/data-center/h200): as H100 SXM / NVL.
* NVIDIA H800 SXM / PCIe: the H100 SXM / PCIe compute (H800 differs in interconnect only).
* NVIDIA H20: H20 product brief: BF16 148, FP8 296 (dense).
* NVIDIA A100 and A800 (SXM4 and PCIe, 40 and 80 GB): A100 datasheet: BF16 312 (624 with
  sparsity); Ampere has no FP8.
* NVIDIA L40S / L40 / L4: Ada datasheets: BF16 362.05 / 181.05 / 121, FP8 733 / 362 / 242.5
  (733 / 362.1 / 242 and 1,466 / 724 / 485 with sparsity).
* NVIDIA B200 / GB200 (per GPU): Blackwell datasheet (HGX B200, GB200 NVL72): BF16 2,250 / 2,500,
  FP8 4,500 / 5,000 dense.
* AMD Instinct MI300X / MI325X / MI300A / MI250X: AMD product pages: BF16 1,307.4 / 1,307.4 /
  980.6 / 383, FP8 2,614.9 / 2,614.9 / 1,961.2 / none.

FP16 peaks equal BF16 peaks on every device listed, so ``fp16`` reads the BF16 column.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

_H100_SXM = {"bf16": 989.5, "fp8": 1979.0}
_H100_PCIE = {"bf16": 756.5, "fp8": 1513.0}
_H100_NVL = {"bf16": 835.5, "fp8": 1670.5}
_A100 = {"bf16": 312.0}
_MI300X = {"bf16": 1307.4, "fp8": 2614.9}

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Hopper
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA H800": _H100_SXM,
    "NVIDIA H800 PCIe": _H100_PCIE,
    "NVIDIA H20": {"bf16": 148.0, "fp8": 296.0},
    # Ampere
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A800-SXM4-80GB": _A100,
    "NVIDIA A800 80GB PCIe": _A100,
    # Ada
    "NVIDIA L40S": {"bf16": 362.05, "fp8": 733.0},
    "NVIDIA L40": {"bf16": 181.05, "fp8": 362.0},
    "NVIDIA L4": {"bf16": 121.0, "fp8": 242.5},
    # Blackwell
    "NVIDIA B200": {"bf16": 2250.0, "fp8": 4500.0},
    "NVIDIA GB200": {"bf16": 2500.0, "fp8": 5000.0},
    # AMD CDNA
    "AMD Instinct MI300X": _MI300X,
    "AMD Instinct MI325X": _MI300X,
    "AMD Instinct MI300A": {"bf16": 980.6, "fp8": 1961.2},
    "AMD Instinct MI250X": {"bf16": 383.0},
}

PRECISIONS = ("bf16", "fp16", "fp8")


def peak_tflops(device_name: Optional[str], precision: str = "bf16") -> Optional[float]:
    """Dense peak TFLOP/s of ``device_name`` at ``precision``; ``None`` when not known exactly.

    A pure function of its arguments: pass the name ``torch.cuda.get_device_name()`` gives.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not device_name:
        return None
    column = "bf16" if precision == "fp16" else precision
    return PEAK_TFLOPS.get(device_name.strip(), {}).get(column)


def current_device_name() -> Optional[str]:
    """The name of the current CUDA (or ROCm) device, or ``None`` without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def fp8_autocast_active() -> bool:
    """Whether Transformer Engine's FP8 autocast is active right now.

    Only asks Transformer Engine if it is already imported: a process that never
    imported it cannot be in its autocast, and importing a broken install can
    fail with ImportError, RuntimeError or OSError (missing CUDA or cuDNN).
    """
    if "transformer_engine" not in sys.modules:
        return False
    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            manager = __import__(module, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager
            return bool(manager.is_fp8_enabled())
        except (ImportError, AttributeError, RuntimeError, OSError):
            continue
    return False
