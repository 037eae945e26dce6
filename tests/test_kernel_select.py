"""How the token statistics choose their local pass (torch loop or Triton kernel), and the device-check record.

These run without Triton and without a GPU: the rule is a function of the
request (keyword, environment variable), the tensor's device and dtype, and the
record file that ``twinkle-megatron kernel-check`` writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from twinkle_megatron.ops import kernel_select, vocab_parallel_token_stats
from twinkle_megatron.ops.kernel_select import (
    DEFAULT_RECORD,
    ENV_KERNEL,
    ENV_RECORD,
    RECORD_FORMAT,
    choose_kernel,
    device_entry,
    kernel_fingerprint,
    load_record,
    requested_kernel,
    verification,
    write_record,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_caches():
    kernel_select.clear_caches()
    yield
    kernel_select.clear_caches()


def test_request_keyword_then_environment_then_auto(monkeypatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    assert requested_kernel(None) == "auto"
    monkeypatch.setenv(ENV_KERNEL, " Torch ")
    assert requested_kernel(None) == "torch"
    assert requested_kernel("triton") == "triton"  # the keyword wins over the variable
    monkeypatch.setenv(ENV_KERNEL, "")
    assert requested_kernel(None) == "auto"
    monkeypatch.setenv(ENV_KERNEL, "cuda")
    with pytest.raises(ValueError, match=ENV_KERNEL):
        requested_kernel(None)
    with pytest.raises(ValueError, match="kernel must be one of"):
        vocab_parallel_token_stats(torch.zeros(2, 4), kernel="fast")


def test_auto_never_picks_the_kernel_off_cuda(monkeypatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert choose_kernel(None, torch.zeros(2, 8, dtype=dtype)) == "torch"
        assert choose_kernel("torch", torch.zeros(2, 8, dtype=dtype)) == "torch"


def test_forcing_the_kernel_says_why_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(kernel_select, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        choose_kernel("triton", torch.zeros(2, 8))
    monkeypatch.setattr(kernel_select, "triton_installed", lambda: True)
    with pytest.raises(TypeError, match="torch.float64"):
        choose_kernel("triton", torch.zeros(2, 8, dtype=torch.float64))


def test_record_round_trip_keeps_other_devices(tmp_path: Path) -> None:
    path = tmp_path / "checks.json"
    assert load_record(path) == {"format": RECORD_FORMAT, "devices": {}}
    write_record(path, "NVIDIA H200", device_entry(True, speedup_vs_torch_min=4.0))
    write_record(path, "NVIDIA A100-SXM4-80GB", device_entry(False, failures=["kernel vs torch"]))
    record = load_record(path)
    assert sorted(record["devices"]) == ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"]
    entry = record["devices"]["NVIDIA H200"]
    assert entry["passed"] is True and entry["speedup_vs_torch_min"] == 4.0
    assert entry["kernel_sha256"] == kernel_fingerprint() and entry["torch"] == torch.__version__
    # A later failing check replaces the device's passing entry.
    write_record(path, "NVIDIA H200", device_entry(False))
    assert load_record(path)["devices"]["NVIDIA H200"]["passed"] is False
    assert not list(tmp_path.glob("*.tmp"))


def test_verification_needs_a_pass_of_this_kernel_and_this_triton() -> None:
    entry = device_entry(True)
    record = {"format": RECORD_FORMAT, "devices": {"NVIDIA H200": entry}}
    ok, why = verification("NVIDIA H200", record)
    assert ok and "verified" in why
    for device, devices, reason in [
        ("NVIDIA H100 80GB HBM3", record["devices"], "no device check recorded"),
        ("NVIDIA H200", {"NVIDIA H200": {**entry, "passed": False}}, "did not pass"),
        ("NVIDIA H200", {"NVIDIA H200": {**entry, "kernel_sha256": "0" * 64}}, "another kernel source"),
        ("NVIDIA H200", {"NVIDIA H200": {**entry, "triton": "0.0.1"}}, "Triton 0.0.1"),
    ]:
        ok, why = verification(device, {"format": RECORD_FORMAT, "devices": devices})
        assert not ok and reason in why, why


def test_fingerprint_is_the_kernel_source() -> None:
    import hashlib

    source = ROOT / "twinkle_megatron" / "ops" / "triton_token_stats.py"
    assert kernel_fingerprint() == hashlib.sha256(source.read_bytes()).hexdigest()


def test_bad_records_are_errors_and_auto_falls_back_with_a_warning(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_record(bad)
    bad.write_text(json.dumps({"format": 99, "devices": {}}))
    with pytest.raises(ValueError, match="expected"):
        load_record(bad)
    # The CUDA branch of auto: an unreadable record verifies nothing (before any device is queried).
    with pytest.warns(UserWarning, match="using the torch token-statistics path"):
        assert kernel_select._device_verified(0, str(bad)) is False


def test_record_path_default_and_override(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_RECORD, raising=False)
    assert kernel_select.record_path() == DEFAULT_RECORD
    monkeypatch.setenv(ENV_RECORD, str(tmp_path / "mine.json"))
    assert kernel_select.record_path() == tmp_path / "mine.json"


def test_shipped_record_is_a_record() -> None:
    record = load_record(DEFAULT_RECORD)
    assert record["format"] == 1 and isinstance(record["devices"], dict)
    # Empty as shipped: no GPU has run `twinkle-megatron kernel-check` for this project yet, so kernel="auto" keeps the
    # torch path on every device. An entry the check adds must carry its evidence:
    for name, entry in record["devices"].items():
        assert isinstance(name, str) and {"passed", "kernel_sha256", "triton"} <= set(entry)


def test_package_works_without_triton() -> None:
    """With Triton unimportable: the package imports, the ops run (torch loop), forcing the kernel explains."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        import twinkle_megatron
        from twinkle_megatron.ops import vocab_parallel_token_stats
        st = vocab_parallel_token_stats(torch.randn(3, 10), torch.tensor([1, 2, 3]))
        assert st.entropy.shape == (3,)
        try:
            vocab_parallel_token_stats(torch.randn(3, 10), kernel="triton")
        except RuntimeError as error:
            assert "Triton is not installed" in str(error), error
        else:
            raise AssertionError("forcing the kernel without Triton did not fail")
        assert "twinkle_megatron.ops.triton_token_stats" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
