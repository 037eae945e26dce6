"""The CPU-runnable parts of ``make gpu-check``: ``twinkle-megatron kernel-check`` (``ops/kernel_check.py``),
``benchmarks/gpu_timings.py`` and ``benchmarks/step_overhead.py``.

What needs a GPU (timing with CUDA events, the compiled kernel, NCCL, TE) runs
only in ``make gpu-check`` itself. Here: the no-CUDA exits, the kernel check
with the kernel interpreted and the record it writes read back by the selection,
the timings' arguments, table and bandwidth arithmetic, reading a real tracker
JSONL log, and the step-overhead harness through real megatron-core on a CPU
rank (CUDA-to-CPU shim), with the token statistics' local pass forced to the
torch loop and to the Triton kernel (interpreted) inside a real ``GPTModel`` step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kit.fork_server import python_executable, run_python

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_timings  # noqa: E402
from gpu_timings import (  # noqa: E402
    Row,
    copy_bandwidth,
    effective_bandwidth,
    exit_code,
    format_table,
    goal_status,
    parse_args,
    shard_bytes,
    summarise_train_log,
)

from twinkle_megatron.cli import NO_CUDA_MESSAGE, main  # noqa: E402

# The harness tests force the kernel on CPU tensors: possible only in Triton's interpreter, which
# tests/conftest.py turns on where there is no CUDA. On a GPU make gpu-check runs the same code on CUDA.
INTERPRETED = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="CUDA present: the kernel is compiled, not "
                                       "interpreted (make gpu-check runs these sections on the GPU)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_each_part_says_so_and_exits_0(tmp_path: Path, capsys) -> None:
    record = tmp_path / "record.json"
    assert main(["kernel-check", "--record", str(record)]) == 0
    assert capsys.readouterr().out.strip() == NO_CUDA_MESSAGE and not record.exists()
    # Both as a user runs them, each Python forked from the fork server (imports paid once per session).
    out = run_python(["benchmarks/gpu_timings.py"], cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == gpu_timings.NO_CUDA_MESSAGE
    out = subprocess.run(["make", "-s", "gpu-check", f"PY={python_executable()}", "STAMP="], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("gpu-check: no CUDA device"), out.stdout + out.stderr


def test_arguments() -> None:
    args = parse_args([])
    assert args.tokens == 8192 and args.vocab == [32768, 65536, 131072] and args.repeats == 10
    assert not args.skip_train and args.json is None
    args = parse_args(["--tokens", "512", "--vocab", "1000, 2000", "--skip-train"])
    assert args.tokens == 512 and args.vocab == [1000, 2000] and args.skip_train
    for bad in (["--vocab", "32k"], ["--vocab", "0"], ["--tokens", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    for bad in (["--vocab", "32k"], ["--vocab", ","], ["--tokens", "0"], ["--record", "x", "--no-record"]):
        with pytest.raises(SystemExit):
            main(["kernel-check", *bad])


@needs_interpreter
def test_kernel_check_on_cpu_and_the_record_the_selection_reads(tmp_path: Path) -> None:
    """The kernel check with the kernel interpreted: no problem found; its verdict written as the device's entry,
    read back by the selection's rule. In the interpreter the kernel is slower than the torch loop: not passed."""
    pytest.importorskip("triton", reason="Triton is not installed (`make kernel-test` installs it)")
    from twinkle_megatron.ops.kernel_check import check_kernel, record_check
    from twinkle_megatron.ops.kernel_select import load_record, verification

    check = check_kernel(torch.device("cpu"), tokens=16, vocabs=[300, 700], repeats=1)
    assert check.problems == [] and check.device == "cpu" and len(check.speedups) == 2
    assert check.passed is (min(check.speedups) > 1.0)
    path = tmp_path / "kernel_checks.json"
    entry = record_check(check, path)
    assert entry["passed"] is check.passed and entry["vocab"] == [300, 700] and entry["reason"] == check.reason
    record = load_record(path)
    assert record["devices"] == {"cpu": entry}
    assert verification("cpu", record)[0] is check.passed
    check.kernel_seconds = [seconds / 1e6 for seconds in check.torch_seconds]  # as if on a GPU: 1e6x faster
    record_check(check, path)
    assert check.passed and verification("cpu", load_record(path))[0]
    check.problems.append("V=300 kernel vs float64: entropy max relative error 1e-3 > 1e-05")
    record_check(check, path)
    assert not check.passed and "1 correctness problems" in load_record(path)["devices"]["cpu"]["reason"]
    assert not verification("cpu", load_record(path))[0]


def test_bandwidth_arithmetic() -> None:
    assert shard_bytes(8192, 131072, 2) == 2 * 2**30  # 2 GiB of bf16
    assert effective_bandwidth(2 * 2**30, 0.5e-3) == 4 * 2**30 / 1e-3  # read once: 4.29e12 B/s
    assert copy_bandwidth(2**30, 0.5e-3) == 2 * 2**30 / 0.5e-3  # read + write
    # A kernel reading a 2 GiB shard in 0.5 ms against a copy of 1 GiB in 0.5 ms: the same byte rate.
    assert effective_bandwidth(2 * 2**30, 0.5e-3) / copy_bandwidth(2**30, 0.5e-3) == 1.0
    assert gpu_timings.gbs(4.8e12) == "4,800 GB/s"
    assert goal_status(0.81, 0.8) == "ok" and goal_status(0.79, 0.8) == "below goal"
    assert goal_status(0.004, 0.01, higher_is_better=False) == "ok"
    assert goal_status(math.nan, 0.8) == "below goal"


def test_table_and_exit_status() -> None:
    rows = [Row("device", "device", "NVIDIA H200 (sm_90, 140 GiB)"),
            Row("bandwidth", "kernel 8192x32768 bf16", "0.130 ms, 4,130 GB/s, 86% of copy", ">= 80% of copy", "ok"),
            Row("correctness", "kernel vs torch path", "2 problems", "argmax =", "FAIL", ["argmax differs at [3]"])]
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["section", "check", "value", "goal", "status"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    starts = [lines[0].index(h) for h in ("check", "value", "goal", "status")]
    for line in lines[2:5]:  # every column starts where its header does
        assert all(line[s - 2:s] == "  " and line[s] != " " for s in starts[:2]), line
    assert lines[4].rstrip().endswith("FAIL")
    assert "FAIL correctness: kernel vs torch path" in table and "  argmax differs at [3]" in table
    assert exit_code(rows) == 1 and exit_code(rows[:2]) == 0


def test_summary_of_a_real_tracker_log(tmp_path: Path) -> None:
    """A JSONL written by the real MetricsTracker (CPU: no memory keys), read back as gpu-check reads it."""
    from twinkle_megatron import MetricsTracker, TrackerConfig

    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=("jsonl",), log_dir=str(tmp_path),
                                                  flops_per_step=1e9))
    for step in range(1, 7):
        with tracker.step(step) as values:
            values.update(loss=[{"lm loss": torch.tensor([12.0 - step, 4.0])}], grad_norm=1.0, lr=1e-3)
    tracker.close()
    log = next(tmp_path.rglob("*.jsonl"))
    summary = summarise_train_log(log)
    assert summary["records"] == 4 and summary["steps"] == [1, 6]  # step 1, then every 2 steps
    assert summary["loss"] == [pytest.approx(11.0 / 4), pytest.approx((6.0 + 7.0) / 8)]  # steps 5-6 pooled
    assert summary["step_time"] > 0 and summary["tokens_per_second"] > 0 and summary["tflops_per_gpu"] > 0
    assert "mfu" not in summary  # a CPU has no peak in the table
    assert summary["memory"] == {}  # CPU: no device memory statistics


def _overhead_worker(spec_kwargs: dict) -> dict:
    from step_overhead import StepSpec, measure, overhead

    from twinkle_megatron.ops import token_stats
    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    calls = {"triton": 0}
    real = token_stats.triton_local_pass

    def counting():
        calls["triton"] += 1
        return real()

    token_stats.triton_local_pass = counting  # count kernel launches through our own entry point
    try:
        with cpu_cuda_shim():
            results, setup = measure(StepSpec(**spec_kwargs), torch.device("cpu"))
    finally:
        token_stats.triton_local_pass = real
    return {"results": {m: (r.step_seconds, r.metrics) for m, r in results.items()}, "setup": setup,
            "triton_calls": calls["triton"], "overheads": {m: overhead(results, m) for m in results}}


@needs_interpreter
def test_step_overhead_harness_on_a_cpu_rank() -> None:
    """Real GPTModel steps (Megatron's DDP and Adam) through Megatron's schedule: plain, instrumented with the torch
    loop, instrumented with the (interpreted) Triton kernel on the [s, b, v] logits of the output layer, the fused
    loss."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton", reason="Triton is not installed (`make kernel-test` installs it)")
    from twinkle_megatron.testing.distributed import Layout, run_distributed

    spec = dict(hidden_size=32, layers=2, heads=4, seq_length=8, micro_batch_size=2, microbatches=2,
                vocab_size=100, steps_per_block=1, rounds=2, warmup=0, te=False)
    out = run_distributed(_overhead_worker, layout=Layout(), args=(spec,), timeout=300)[0]
    results = out["results"]
    assert set(results) == {"plain", "plugin (torch)", "plugin (triton)", "fused loss"}
    for mode, (seconds, metrics) in results.items():
        assert len(seconds) == 2 and all(s > 0 for s in seconds), mode
        if mode == "plain":
            assert metrics == {}
        else:
            assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["total_tokens"] == 2 * 2 * 8
            assert math.isfinite(metrics["entropy"]) and metrics["entropy"] > 0 and metrics["logprob"] < 0
    # One kernel launch per microbatch of the triton blocks: 2 rounds x 1 step x 2 microbatches.
    assert out["triton_calls"] == 2 * 1 * 2
    assert out["setup"]["tokens_per_step"] == 32 and out["setup"]["transformer_engine"] is False
    assert out["overheads"]["plain"] == 0.0


def _sections_worker() -> list:
    """The timings' sections on a CPU rank at tiny sizes: the same code paths, perf_counter timing."""
    from megatron.core import parallel_state
    from step_overhead import StepSpec

    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    device = torch.device("cpu")
    group = parallel_state.get_tensor_model_parallel_group()
    rows = gpu_timings.section_fused_loss(device, tokens=64, vocab=512)
    bandwidth_rows, facts = gpu_timings.section_bandwidth(device, 8, [256], repeats=1, group=group, copy_bytes=1 << 20)
    rows += bandwidth_rows
    rows += gpu_timings.section_sweep(device, 4, 256, repeats=1, copy_bw=facts["copy_bandwidth"])[0]
    with cpu_cuda_shim():
        rows += gpu_timings.section_step_overhead(device, StepSpec(
            hidden_size=32, layers=1, heads=4, seq_length=8, micro_batch_size=1, microbatches=2, vocab_size=60,
            steps_per_block=1, rounds=1, warmup=0, te=False))
    return [rows, facts]


@needs_interpreter
def test_gpu_sections_dry_run_on_cpu() -> None:
    """Every section but the torchrun subprocess, on CPU (the kernel interpreted): the fused loss and the peer
    code run, every launch configuration of the sweep is timed, the step's metrics are finite, the table prints."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("triton", reason="Triton is not installed (`make kernel-test` installs it)")
    from twinkle_megatron.testing.distributed import Layout, run_distributed

    rows, facts = run_distributed(_sections_worker, layout=Layout(), timeout=600)[0]
    failed = [r for r in rows if r.status == "FAIL"]
    assert not failed, format_table(failed)
    checks = [r.check for r in rows]
    assert sum(c.startswith("forward + backward") for c in checks) == 2
    assert any(c.startswith("peer code 8x256") for c in checks) and not any(r.status == "skipped" for r in rows)
    from twinkle_megatron.ops.triton_token_stats import launch_config

    configs = set(gpu_timings.SWEEP) | {launch_config(256, 2)}
    assert sum(c.startswith("local pass block=") for c in checks) == len(configs)
    assert len(facts["speedups"]) == 1 and facts["speedups"][0] > 0 and facts["copy_bandwidth"] > 0
    assert sum(r.section == "correctness" and r.check.startswith("metrics of the ") for r in rows) == 3
    assert exit_code(rows) == 0
    print(format_table(rows))
