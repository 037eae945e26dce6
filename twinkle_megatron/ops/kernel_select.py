"""Which implementation runs the local pass of the token statistics: the torch loop or the Triton kernel.

Both compute the same per-shard quantities (local max and its first column,
S0, S1, the label's logit) and feed the same two collectives and epilogue
(:func:`~.token_stats._token_stats`); they differ only in speed and in float
rounding of the sums. The choice, per call:

1. the ``kernel=`` keyword of the ops, else the environment variable
   ``TWINKLE_MEGATRON_TOKEN_STATS_KERNEL``, else ``"auto"``;
2. ``"torch"``: the torch loop, always (the reference, and the CPU path);
3. ``"triton"``: the kernel, or an error saying why it cannot run (Triton not
   installed, float64 logits, a CPU tensor without ``TRITON_INTERPRET=1``);
4. ``"auto"``: the kernel only for a CUDA tensor in bf16/fp16/fp32, with Triton
   installed, on a device *kind* for which a passing device check is recorded
   for *this* kernel source and *this* Triton version; the torch loop otherwise.

The record is a JSON file (``kernel_checks.json`` next to this module, or the
file named by ``TWINKLE_MEGATRON_KERNEL_RECORD``) written by
``twinkle-megatron kernel-check`` (:mod:`.kernel_check`)::

    {"format": 1,
     "devices": {"NVIDIA H200": {"passed": true, "kernel_sha256": "…", "triton": "3.7.1", …}}}

keyed by ``torch.cuda.get_device_name()``. An entry verifies the kernel when
``passed`` is true (the kernel agreed with the torch loop and float64 *and* was
faster than the torch loop at every size measured), ``kernel_sha256`` is the
SHA-256 of ``triton_token_stats.py`` as installed, and ``triton`` is the
installed Triton version: editing the kernel or changing Triton falls back to
the torch loop until the check is run again. A missing record means nothing is
verified; an unreadable one warns once and verifies nothing.

Every decision is made from the tensor's device and dtype and from files read
once per process (cached): no host synchronisation, and the same choice on
every rank of a TP group of one device kind. Ranks choosing differently would
still agree on every result (the collectives and the epilogue are shared).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = [
    "ENV_KERNEL",
    "ENV_RECORD",
    "KERNELS",
    "RECORD_FORMAT",
    "choose_kernel",
    "clear_caches",
    "device_entry",
    "kernel_fingerprint",
    "load_record",
    "record_path",
    "triton_local_pass",
    "triton_version",
    "verification",
    "write_record",
]

ENV_KERNEL = "TWINKLE_MEGATRON_TOKEN_STATS_KERNEL"
ENV_RECORD = "TWINKLE_MEGATRON_KERNEL_RECORD"
KERNELS = ("auto", "torch", "triton")
RECORD_FORMAT = 1
KERNEL_SOURCE = Path(__file__).with_name("triton_token_stats.py")
DEFAULT_RECORD = Path(__file__).with_name("kernel_checks.json")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def requested_kernel(kernel: Optional[str]) -> str:
    """The requested implementation: the keyword, else the environment variable, else ``"auto"``."""
    source = "kernel"
    if kernel is None:
        kernel, source = os.environ.get(ENV_KERNEL, "").strip().lower() or "auto", ENV_KERNEL
    if kernel not in KERNELS:
        raise ValueError(f"{source} must be one of {KERNELS}, got {kernel!r}")
    return kernel


def choose_kernel(kernel: Optional[str], rows: torch.Tensor) -> str:
    """``"torch"`` or ``"triton"`` for the local pass over ``rows`` (see the module docstring)."""
    kernel = requested_kernel(kernel)
    if kernel == "torch":
        return "torch"
    if kernel == "triton":
        _check_can_run(rows)
        return "triton"
    if rows.device.type != "cuda" or rows.dtype not in KERNEL_DTYPES or not triton_installed():
        return "torch"
    index = rows.device.index if rows.device.index is not None else torch.cuda.current_device()
    return "triton" if _device_verified(index, str(record_path())) else "torch"


def _check_can_run(rows: torch.Tensor) -> None:
    if not triton_installed():
        raise RuntimeError("kernel='triton' but Triton is not installed (pip install --no-deps triton; "
                           "`make kernel-test` installs the pinned version)")
    if rows.dtype not in KERNEL_DTYPES:
        raise TypeError(f"kernel='triton' takes {', '.join(map(str, KERNEL_DTYPES))} logits, got {rows.dtype} "
                        f"(use kernel='torch' or 'auto')")
    if rows.device.type != "cuda":
        from . import triton_token_stats

        if not triton_token_stats.is_interpreted():
            raise ValueError(f"kernel='triton' needs CUDA logits, got a {rows.device.type} tensor (on CPU the "
                             f"kernel runs only in Triton's interpreter: TRITON_INTERPRET=1 set before "
                             f"twinkle_megatron.ops.triton_token_stats is first imported)")


def triton_local_pass() -> Callable:
    """The kernel's launcher (imports Triton on first use)."""
    from .triton_token_stats import triton_local_pass as launch

    return launch


@functools.cache
def triton_installed() -> bool:
    """Whether ``import triton`` can work (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def kernel_fingerprint() -> str:
    """SHA-256 of the kernel's source file: a record verifies exactly this kernel."""
    return hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest()


def record_path() -> Path:
    return Path(os.environ.get(ENV_RECORD) or DEFAULT_RECORD)


def load_record(path: Path) -> dict:
    """The record at ``path`` (``{"format": 1, "devices": {}}`` when there is none).

    Raises ``ValueError`` for a file that is not a record of this format.
    """
    path = Path(path)
    if not path.exists():
        return {"format": RECORD_FORMAT, "devices": {}}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"kernel check record {path}: {error}") from error
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or \
            not isinstance(record.get("devices"), dict):
        raise ValueError(f"kernel check record {path}: expected {{'format': {RECORD_FORMAT}, 'devices': {{...}}}}")
    return record


def device_entry(passed: bool, **details: Any) -> dict:
    """A record entry for this process's kernel source and Triton version; ``details`` are kept as given."""
    return {"passed": bool(passed), "kernel_sha256": kernel_fingerprint(), "triton": triton_version(),
            "torch": torch.__version__,
            "checked": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), **details}


def write_record(path: Path, device_name: str, entry: dict) -> dict:
    """Set ``device_name``'s entry in the record at ``path`` (other devices kept); atomic replace."""
    path = Path(path)
    record = load_record(path)
    record["devices"][device_name] = entry
    record["devices"] = dict(sorted(record["devices"].items()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    clear_caches()
    return record


def verification(device_name: str, record: dict) -> tuple[bool, str]:
    """Whether ``record`` verifies this kernel on ``device_name``, and why (or why not)."""
    entry = record.get("devices", {}).get(device_name)
    if not isinstance(entry, dict):
        return False, f"no device check recorded for {device_name!r}"
    if not entry.get("passed"):
        return False, f"the device check on {device_name!r} did not pass"
    if entry.get("kernel_sha256") != kernel_fingerprint():
        return False, f"the check on {device_name!r} was of another kernel source (run the device check again)"
    if entry.get("triton") != triton_version():
        return False, (f"the check on {device_name!r} used Triton {entry.get('triton')}, "
                       f"installed is {triton_version()}")
    return True, f"verified on {device_name!r} ({entry.get('checked', 'undated')})"


@functools.cache
def _device_verified(index: int, path: str) -> bool:
    try:
        record = load_record(Path(path))
    except ValueError as error:
        warnings.warn(f"twinkle-megatron: {error}; using the torch token-statistics path", stacklevel=3)
        return False
    return verification(torch.cuda.get_device_name(index), record)[0]


def clear_caches() -> None:
    """Forget cached records and fingerprints (after writing a record, or in tests)."""
    for cached in (_device_verified, kernel_fingerprint, triton_installed, triton_version):
        cached.cache_clear()
