"""``make gpu-check``: everything that needs a GPU, on one CUDA device, in one table (under 8 minutes).

Run: ``python benchmarks/gpu_check.py [--tokens 8192] [--vocab 32768,65536,131072] [--repeats 10]
[--skip-tests] [--skip-train] [--record PATH | --no-record] [--json PATH]``.

Without a CUDA device it prints that there is none and exits 0. With one:

1. **tests** -- ``pytest tests/test_triton_token_stats.py tests/test_kernel_select.py`` in a
   subprocess (on a GPU the kernel tests compile the kernel instead of interpreting it).
2. **correctness** -- the cases of ``tests/kit/ops_cases.py`` on CUDA tensors through the torch
   path (chunk sizes 1, 7 and the 64 MiB GPU default) and the Triton kernel, against the
   float64 reference; the kernel against the torch path on ``--tokens`` x V bf16 logits with
   padding, ties, NaN/inf rows, ignored and out-of-range labels (all tokens), and against
   float64 (256 tokens); Accuracy + TokenStatsMetric in a MetricCollection on CUDA against
   the same on CPU, with either path; the fused loss (``ops/fused_cross_entropy.py``) against
   megatron-core's ``vocab_parallel_cross_entropy`` on CUDA (loss, gradient, statistics; fp32 and
   bf16), with the time and peak memory of each.
3. **bandwidth** -- CUDA-event medians (methods taking turns) at ``--tokens`` x V bf16 for
   each V: the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB: 2 GiB moved), the
   kernel's effective bandwidth (bytes of the shard read per second, the whole
   ``vocab_parallel_token_stats`` call), the torch path and the peer code
   (``benchmarks/bench_token_stats.py``'s ``anchors``: Megatron's cross-entropy on a copy,
   a 3-all-reduce entropy, a 2-all-gather argmax, on a one-rank group); and a sweep of
   kernel launch configurations (each checked against the default's output first).
4. **train** -- ``examples/train_gpt.py`` under ``torchrun`` on this GPU (TE layers when TE is
   installed), its tracker's CUDA-event step times, throughput, MFU and memory statistics
   from its JSONL log; then ``benchmarks/step_overhead.py``: the same megatron-core steps
   with and without ``instrument()`` (and with ``fused_loss=True``), interleaved, per-step
   overhead and peak memory.

Goals printed next to the numbers: kernel >= 80 % of copy bandwidth, >= 3x the torch path,
step overhead <= 1 % (hidden 2048). A correctness failure (a FAIL row) makes the exit
status 1; a missed speed goal does not.

The result is recorded for the kernel selection (``twinkle_megatron/ops/kernel_select.py``):
an entry for this device name in ``--record`` (default: ``twinkle_megatron/ops/
kernel_checks.json``, or ``$TWINKLE_MEGATRON_KERNEL_RECORD``), ``passed`` when every
correctness row passed and the kernel was faster than the torch path at every V. Commit
that file to let ``kernel="auto"`` use the kernel on this device kind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

NO_CUDA_MESSAGE = ("gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing was checked. "
                   "Run `make gpu-check` on a machine with an NVIDIA GPU; on CPU the kernel is tested under "
                   "Triton's interpreter by `make kernel-test`.")
GOAL_BANDWIDTH_FRACTION = 0.8
GOAL_SPEEDUP_VS_TORCH = 3.0
GOAL_STEP_OVERHEAD = 0.01
F64_TOKENS = 256
SWEEP = [(1024, 4, 2), (2048, 8, 1), (2048, 8, 2), (2048, 8, 3), (4096, 8, 2), (4096, 16, 2), (8192, 16, 2)]
TRAIN_FLAGS = ["--tp", "1", "--pp", "1", "--dp", "1", "--steps", "20", "--log-interval", "5", "--hidden-size", "2048",
               "--layers", "4", "--heads", "16", "--seq-length", "2048", "--micro-batch-size", "2",
               "--microbatches", "4", "--vocab-size", "32000", "--backends", "jsonl"]


# ----------------------------------------------------------------------------- rows, table, arithmetic


@dataclass
class Row:
    """One line of the table. ``status``: ok, FAIL (correctness), below goal, info, skipped."""

    section: str
    check: str
    value: str
    goal: str = ""
    status: str = "info"
    details: list = field(default_factory=list)  # printed under the table for FAIL rows


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table, one line per row, then the details of every failing row."""
    headers = ("section", "check", "value", "goal", "status")
    cells = [headers] + [(r.section, r.check, r.value, r.goal, r.status) for r in rows]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(headers))]
    lines = []
    for index, cell in enumerate(cells):
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(cell, widths)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        if r.status == "FAIL" and r.details:
            lines.append(f"\nFAIL {r.section}: {r.check}")
            lines.extend(f"  {d}" for d in r.details[:20])
    return "\n".join(lines)


def exit_code(rows: Sequence[Row]) -> int:
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def effective_bandwidth(bytes_read: int, seconds: float) -> float:
    """Bytes per second of a pass that reads ``bytes_read`` once."""
    return bytes_read / seconds


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second of ``dst.copy_(src)`` of ``nbytes``: each byte is read and written (2 x nbytes)."""
    return 2 * nbytes / seconds


def shard_bytes(tokens: int, vocab: int, element_size: int) -> int:
    return tokens * vocab * element_size


def goal_status(value: float, goal: float, higher_is_better: bool = True) -> str:
    if not math.isfinite(value):
        return "below goal"
    met = value >= goal if higher_is_better else value <= goal
    return "ok" if met else "below goal"


def gbs(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:,.0f} GB/s"


def record_verdict(rows: Sequence[Row], speedups: Sequence[float]) -> tuple[bool, str]:
    """Whether the device check passed: every correctness row ok and the kernel faster than torch everywhere."""
    failed = [f"{r.section}: {r.check}" for r in rows if r.status == "FAIL"]
    if failed:
        return False, "correctness failures: " + "; ".join(failed)
    if not speedups:
        return False, "the kernel's speed was not measured"
    if min(speedups) < 1.0:
        return False, f"the kernel was slower than the torch path (min speed-up {min(speedups):.2f}x)"
    return True, f"all correctness checks passed; min speed-up over the torch path {min(speedups):.2f}x"


def parse_vocab_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--vocab takes comma-separated integers, got {text!r}") from error
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--vocab takes positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=8192, help="tokens of the bandwidth shards")
    parser.add_argument("--vocab", type=parse_vocab_list, default=[32768, 65536, 131072],
                        help="comma-separated local vocabulary sizes (bf16)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per method")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the pytest subprocess")
    parser.add_argument("--skip-train", action="store_true", help="do not run the training sections")
    parser.add_argument("--train-timeout", type=positive_int, default=240, help="seconds for train_gpt.py")
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--record", type=Path, default=None,
                        help="the kernel check record to update (default: the selection's record path)")
    record.add_argument("--no-record", action="store_true", help="do not write the record")
    parser.add_argument("--json", type=Path, default=None, help="also write every row as JSON here")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- timing


def time_methods(methods: dict[str, Callable[[], object]], repeats: int, device: torch.device,
                 warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each method; the methods take turns (a, b, c, a, b, c, ...).

    CUDA events around each call on a GPU; ``time.perf_counter`` on CPU (the dry run of the tests).
    """
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- sections


def section_tests(timeout: int = 600) -> list[Row]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files = ["tests/test_triton_token_stats.py", "tests/test_kernel_select.py"]
    begin = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=timeout)
    summary = (out.stdout.strip().splitlines() or ["(no output)"])[-1]
    status = "ok" if out.returncode == 0 else "FAIL"
    details = (out.stdout + out.stderr).splitlines()[-40:] if status == "FAIL" else []
    return [Row("tests", "pytest " + " ".join(Path(f).name for f in files) + " (compiled kernel)",
                f"{summary} ({time.perf_counter() - begin:.0f} s)", "all pass", status, details)]


def section_ops_cases(device: torch.device) -> list[Row]:
    from kit import ops_cases as cases

    from twinkle_megatron.ops import vocab_parallel_argmax, vocab_parallel_token_stats

    rows = []
    for kernel, chunks in (("torch", (1, 7, None)), ("triton", (None,))):
        failures, checked = [], 0
        for case in cases.CASES:
            if kernel == "triton" and case.dtype == torch.float64:
                continue  # the kernel takes bf16/fp16/fp32
            full_flat, labels_flat = cases.make_inputs(case, 1)
            full, labels = cases.arrange(case, full_flat), cases.arrange(case, labels_flat)
            shard = cases.local_shard(case, full, 0, 1).to(device)
            vocab = case.vocab_size(1)
            results = {}
            try:
                for chunk in chunks:
                    st = vocab_parallel_token_stats(shard, labels.to(device), vocab_size=vocab, chunk_size=chunk,
                                                    kernel=kernel)
                    results[f"chunk={chunk}"] = tuple(t.cpu() for t in st)
                results["argmax op"] = (vocab_parallel_argmax(shard, vocab_size=vocab, kernel=kernel).cpu(),
                                        None, None)
                cases.check_case(case, 1, [results])
            except Exception as error:  # noqa: BLE001 - every failure becomes a FAIL row
                failures.append(f"{case.name}: {type(error).__name__}: {error}"[:2000])
            checked += 1
        rows.append(Row("correctness", f"ops test cases on CUDA, {kernel} path", f"{checked - len(failures)}/"
                        f"{checked} cases", "= float64 reference", "FAIL" if failures else "ok", failures))
    return rows


def special_logits(tokens: int, vocab: int, device: torch.device, seed: int = 0):
    """bf16 ``[tokens, vocab]`` with padding (the last 37 columns), ties, NaN/inf rows, odd labels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, vocab, generator=gen, device=device).mul_(4)
    vocab_size = vocab - 37
    x[:, vocab_size:] = 1e3  # padding that would win every argmax if it were read
    x[0, [5, vocab_size - 3]] = 30.0  # a tie across far-apart blocks: the lower column wins
    x[1, [7, vocab_size // 2]] = float("nan")
    x[2, 3] = float("inf")
    x[3, 9] = float("-inf")
    x[4, :vocab_size] = 1.5
    labels = torch.randint(0, vocab_size, (tokens,), generator=gen, device=device)
    labels[5], labels[6], labels[7] = -100, vocab_size + 3, -7
    return x.to(torch.bfloat16), labels, vocab_size


def compare(name: str, ours: tuple, ref: tuple, tol: float) -> list[str]:
    """Argmax equal, NaN at the same tokens, ``|a - b| <= tol (1 + |b|)`` elsewhere; the problems found."""
    problems = []
    if not torch.equal(ours[0], ref[0].to(ours[0].dtype)):
        bad = (ours[0] != ref[0]).nonzero().flatten()[:5].tolist()
        problems.append(f"{name}: argmax differs at tokens {bad}")
    for what, a, b in (("logprobs", ours[1], ref[1]), ("entropy", ours[2], ref[2])):
        a, b = a.double(), b.double()
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            problems.append(f"{name}: {what} NaN at different tokens")
            continue
        ok = ~torch.isnan(b)
        err = ((a[ok] - b[ok]).abs() / (1 + b[ok].abs())).max().item() if ok.any() else 0.0
        if not err <= tol:
            problems.append(f"{name}: {what} max relative error {err:.2e} > {tol:.0e}")
    return problems


def section_kernel_vs_torch(device: torch.device, tokens: int, vocabs: Sequence[int]) -> list[Row]:
    from kit.references import full_vocab_stats

    from twinkle_megatron.ops import vocab_parallel_token_stats

    rows = []
    for vocab in vocabs:
        x, labels, vocab_size = special_logits(tokens, vocab, device, seed=vocab)
        problems = []
        kernel = tuple(vocab_parallel_token_stats(x, labels, vocab_size=vocab_size, kernel="triton"))
        torch_path = tuple(vocab_parallel_token_stats(x, labels, vocab_size=vocab_size, kernel="torch"))
        problems += compare("kernel vs torch path", kernel, torch_path, 2e-5)
        exact = tuple(full_vocab_stats(x[:F64_TOKENS], labels[:F64_TOKENS], vocab_size))
        problems += compare("kernel vs float64", tuple(t[:F64_TOKENS] for t in kernel), exact, 1e-5)
        problems += compare("torch path vs float64", tuple(t[:F64_TOKENS] for t in torch_path), exact, 1e-5)
        rows.append(Row("correctness", f"kernel vs torch path vs float64, {tokens}x{vocab} bf16",
                        "equal" if not problems else f"{len(problems)} problems", "argmax =, 1e-5 rel",
                        "FAIL" if problems else "ok", problems))
    return rows


def section_metrics(device: torch.device) -> list[Row]:
    from twinkle_megatron import Accuracy, MetricCollection, TokenStatsMetric
    from twinkle_megatron.ops.kernel_select import ENV_KERNEL

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 64, 1000, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 990, (4, 64), generator=gen)
    labels[0, :5] = -100
    mask = torch.rand(4, 64, generator=gen) < 0.9

    def run(where: torch.device, kernel: str) -> dict:
        saved = os.environ.get(ENV_KERNEL)
        os.environ[ENV_KERNEL] = kernel
        try:
            collection = MetricCollection([Accuracy(vocab_size=990), TokenStatsMetric(vocab_size=990)])
            for part in range(2):  # two accumulate calls
                rows = slice(2 * part, 2 * part + 2)
                collection.accumulate({"labels": labels[rows].to(where), "completion_mask": mask[rows].to(where)},
                                      {"logits": logits[rows].to(where)})
            return collection.calculate()
        finally:
            if saved is None:
                os.environ.pop(ENV_KERNEL, None)
            else:
                os.environ[ENV_KERNEL] = saved

    reference = run(torch.device("cpu"), "torch")
    rows = []
    for kernel in ("torch", "triton"):
        problems = []
        try:
            got = run(device, kernel)
            if set(got) != set(reference):
                problems.append(f"keys {sorted(got)} != {sorted(reference)}")
            for key, value in reference.items():
                other = got.get(key)
                if not isinstance(other, (int, float)) or abs(other - value) > 1e-5 * (1 + abs(value)):
                    problems.append(f"{key}: CUDA {other!r} vs CPU {value!r}")
        except Exception as error:  # noqa: BLE001
            problems.append(f"{type(error).__name__}: {error}")
        rows.append(Row("correctness", f"Accuracy + TokenStatsMetric on CUDA ({kernel}) vs CPU",
                        "equal" if not problems else f"{len(problems)} problems", "1e-5 rel",
                        "FAIL" if problems else "ok", problems))
    return rows


def section_fused_loss(device: torch.device, tokens: int = 4096, vocab: int = 32768) -> list[Row]:
    """The fused loss against megatron-core's ``vocab_parallel_cross_entropy`` on this device (one rank): loss,
    logits gradient and statistics, fp32 and bf16; the time and peak memory of forward + backward of each."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from twinkle_megatron.ops import vocab_parallel_token_stats
    from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats

    rows = []
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(tokens // 2, 2, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab - 37, (tokens // 2, 2), generator=gen).to(device)
    labels[0, 0] = -100
    grad = torch.rand(tokens // 2, 2, generator=gen).to(device)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-5)):
        logits = base.to(device=device, dtype=dtype)

        def megatron(logits=logits):
            x = logits.clone().requires_grad_()
            vocab_parallel_cross_entropy(x, labels).backward(grad)
            return x

        def fused(logits=logits):
            x = logits.clone().requires_grad_()
            loss, stats = vocab_parallel_cross_entropy_with_stats(x * 1, labels, vocab_size=vocab - 37)
            loss.backward(grad)
            return x, loss, stats

        problems = []
        try:
            theirs_in = logits.clone().requires_grad_()
            theirs = vocab_parallel_cross_entropy(theirs_in * 1, labels)
            theirs.backward(grad)
            ours_in, loss, stats = fused()
            loss_rel = float(((loss - theirs).abs() / theirs.abs()).max().detach())
            grad_rel = float((ours_in.grad.float() - theirs_in.grad.float()).norm() / theirs_in.grad.float().norm())
            if not loss_rel <= tol:
                problems.append(f"loss off by {loss_rel:.2e} (relative, per token)")
            if not grad_rel <= tol:
                problems.append(f"gradient off by {grad_rel:.2e} (relative, norm)")
            reference = vocab_parallel_token_stats(logits, labels, vocab_size=vocab - 37, kernel="torch")
            problems += compare("statistics vs vocab_parallel_token_stats", tuple(stats), tuple(reference), 1e-5)
            times = time_methods({"megatron": megatron, "fused": lambda: fused()[0]}, 5, device)
            memory = ""
            if device.type == "cuda":
                peaks = {}
                for name, fn in (("megatron", megatron), ("fused", fused)):
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                    fn()
                    peaks[name] = torch.cuda.max_memory_allocated(device) - before
                memory = (f"; peak above the logits {peaks['fused'] / 2**20:,.0f} vs "
                          f"{peaks['megatron'] / 2**20:,.0f} MiB")
            rows.append(Row("fused loss", f"forward + backward, {tokens}x{vocab} {str(dtype)[6:]}",
                            f"fused {times['fused'] * 1e3:.2f} ms (loss + statistics) vs Megatron's loss alone "
                            f"{times['megatron'] * 1e3:.2f} ms{memory}"))
        except Exception as error:  # noqa: BLE001 - a crash is a failure row
            problems.append(f"{type(error).__name__}: {error}")
        rows.append(Row("correctness", f"fused loss vs megatron-core vocab_parallel_cross_entropy, {str(dtype)[6:]}",
                        "equal" if not problems else f"{len(problems)} problems", f"{tol:g} rel",
                        "FAIL" if problems else "ok", problems))
    return rows


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_methods({"copy": lambda: dst.copy_(src)}, repeats, device)["copy"]
    return copy_bandwidth(nbytes, seconds)


def time_token_stats(device: torch.device, tokens: int, vocab: int, repeats: int, group) -> tuple[dict, int]:
    """Median seconds of the kernel, the torch path and the peer code on one bf16 shard, and its bytes."""
    from bench_token_stats import anchors

    from twinkle_megatron.ops import vocab_parallel_token_stats

    gen = torch.Generator(device=device).manual_seed(vocab)
    x = torch.randn(tokens, vocab, generator=gen, device=device).mul_(4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    methods = {
        "kernel": lambda: vocab_parallel_token_stats(x, labels, kernel="triton"),
        "torch": lambda: vocab_parallel_token_stats(x, labels, kernel="torch"),
        "peer": lambda: anchors(x, labels, group),
    }
    try:
        seconds = time_methods(methods, repeats, device)
    except torch.cuda.OutOfMemoryError:  # the peer code needs several fp32 copies of the shard
        methods.pop("peer")
        torch.cuda.empty_cache()
        seconds = time_methods(methods, repeats, device)
    return seconds, shard_bytes(tokens, vocab, x.element_size())


def section_bandwidth(device: torch.device, tokens: int, vocabs: Sequence[int], repeats: int, group,
                      copy_bytes: int = 1 << 30) -> tuple[list[Row], dict]:
    rows, facts = [], {"speedups": [], "fractions": [], "by_vocab": {}}
    copy_bw = measure_copy_bandwidth(device, copy_bytes, repeats)
    facts["copy_bandwidth"] = copy_bw
    rows.append(Row("bandwidth", f"device copy (dst.copy_(src), {copy_bytes / 2**20:,.0f} MiB, read + write)",
                    gbs(copy_bw)))
    for vocab in vocabs:
        seconds, nbytes = time_token_stats(device, tokens, vocab, repeats, group)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        kernel_bw = effective_bandwidth(nbytes, seconds["kernel"])
        fraction = kernel_bw / copy_bw
        speedup = seconds["torch"] / seconds["kernel"]
        facts["speedups"].append(speedup)
        facts["fractions"].append(fraction)
        facts["by_vocab"][vocab] = seconds
        label = f"{tokens}x{vocab} bf16 ({nbytes / 2**20:,.0f} MiB)"
        rows.append(Row("bandwidth", f"kernel {label}", f"{seconds['kernel'] * 1e3:.3f} ms, {gbs(kernel_bw)}, "
                        f"{fraction:.0%} of copy", f">= {GOAL_BANDWIDTH_FRACTION:.0%} of copy",
                        goal_status(fraction, GOAL_BANDWIDTH_FRACTION)))
        rows.append(Row("bandwidth", f"torch path {label}", f"{seconds['torch'] * 1e3:.3f} ms, "
                        f"{gbs(effective_bandwidth(nbytes, seconds['torch']))}; kernel {speedup:.1f}x faster",
                        f"kernel >= {GOAL_SPEEDUP_VS_TORCH:.0f}x", goal_status(speedup, GOAL_SPEEDUP_VS_TORCH)))
        if "peer" in seconds:
            rows.append(Row("bandwidth", f"peer code {label}", f"{seconds['peer'] * 1e3:.3f} ms; kernel "
                            f"{seconds['peer'] / seconds['kernel']:.1f}x faster"))
        else:
            rows.append(Row("bandwidth", f"peer code {label}", "out of memory", "", "skipped"))
    return rows, facts


def section_sweep(device: torch.device, tokens: int, vocab: int, repeats: int, copy_bw: float) -> tuple[list, dict]:
    from twinkle_megatron.ops.triton_token_stats import launch_config, triton_local_pass

    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, vocab, generator=gen, device=device).mul_(4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    nbytes = shard_bytes(tokens, vocab, 2)
    default = launch_config(vocab, 2)

    def run(config):
        stats = torch.zeros(3, tokens, device=device)
        out = triton_local_pass(x, vocab, labels, stats, True, *config)
        return (*out, stats)

    reference = run(default)
    rows, problems, best = [], [], None
    for config in [default] + [c for c in SWEEP if c != default]:
        got = run(config)
        same = (torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
                and torch.allclose(got[2][:2], reference[2][:2], rtol=1e-5, atol=0)
                and torch.equal(got[2][2], reference[2][2]))
        if not same:
            problems.append(f"block={config[0]} warps={config[1]} stages={config[2]}: output differs from default")
            continue
        seconds = time_methods({"run": lambda c=config: run(c)}, repeats, device)["run"]
        fraction = effective_bandwidth(nbytes, seconds) / copy_bw
        if best is None or fraction > best[1]:
            best = (config, fraction)
        rows.append(Row("sweep", f"local pass block={config[0]} warps={config[1]} stages={config[2]}"
                        + (" (default)" if config == default else ""), f"{seconds * 1e3:.3f} ms, {fraction:.0%} "
                        f"of copy"))
    rows.append(Row("correctness", f"launch configurations agree ({len(SWEEP)} + default)",
                    "equal" if not problems else f"{len(problems)} differ", "same output",
                    "FAIL" if problems else "ok", problems))
    if best is not None:
        rows.append(Row("sweep", "best configuration", f"block={best[0][0]} warps={best[0][1]} stages={best[0][2]}:"
                        f" {best[1]:.0%} of copy" + (" (the default)" if best[0] == default else "")))
    return rows, {"best_config": list(best[0]) if best else None, "default_config": list(default)}


def summarise_train_log(path: Path) -> dict:
    """What the tracker logged: median step time (records after the first), throughput, MFU, memory, loss."""
    from twinkle_megatron.logging.runlog import load_run

    log = load_run(str(path))
    records = log.records
    later = records[1:] or records

    def values(key):
        return [r[key] for r in later if key in r and math.isfinite(r[key])]

    summary: dict = {"records": len(records), "steps": [int(records[0]["step"]), int(records[-1]["step"])]}
    from twinkle_megatron import keys

    for name, key in (("step_time", keys.STEP_TIME), ("tokens_per_second", keys.TOKENS_PER_SECOND),
                      ("tflops_per_gpu", keys.TFLOPS_PER_GPU), ("mfu", keys.MFU)):
        found = values(key)
        if found:
            summary[name] = statistics.median(found)
    last = records[-1]
    summary["memory"] = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("memory/")}
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        summary["loss"] = [losses[0], losses[-1]]
    for key in ("accuracy", "entropy", "logprob"):
        if key in last:
            summary[key] = last[key]
    return summary


def section_train_example(timeout: int) -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "examples/train_gpt.py", *TRAIN_FLAGS, "--run-name", "gpu-check", "--log-dir", tmp]
        begin = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [Row("train", "examples/train_gpt.py on this GPU", f"timed out after {timeout} s", "runs", "FAIL")]
        wall = time.perf_counter() - begin
        log = Path(tmp) / "gpu-check" / "metrics.jsonl"
        if out.returncode != 0 or not log.exists():
            return [Row("train", "examples/train_gpt.py on this GPU", f"exit {out.returncode}", "runs", "FAIL",
                        (out.stdout + out.stderr).splitlines()[-40:])]
        summary = summarise_train_log(log)
    loss = summary.get("loss", [math.nan, math.nan])
    ok = all(math.isfinite(v) for v in loss)
    rows = [Row("train", "examples/train_gpt.py (" + " ".join(TRAIN_FLAGS[:14]) + " ...)",
                f"{summary['records']} log records in {wall:.0f} s; loss {loss[0]:.3f} -> {loss[1]:.3f}",
                "runs, finite loss", "ok" if ok else "FAIL")]
    rows.append(Row("train", "tracker step time (CUDA events, median)", f"{summary.get('step_time', math.nan):.4f} s"))
    rows.append(Row("train", "tracker throughput", f"{summary.get('tokens_per_second', math.nan):,.0f} tokens/s, "
                    f"{summary.get('tflops_per_gpu', math.nan):.1f} TFLOP/s/GPU"))
    rows.append(Row("train", "tracker MFU (exact device name in the peak table)",
                    f"{summary['mfu']:.1%}" if "mfu" in summary else "none (device not in the peak table)"))
    memory = summary["memory"]
    if memory:
        shown = ", ".join(f"{k} {v:.3g}" for k, v in sorted(memory.items()))
        rows.append(Row("train", "tracker memory (last log step)", shown))
    else:
        rows.append(Row("train", "tracker memory (last log step)", "no memory/* keys logged", "present", "FAIL"))
    return rows


def gib(nbytes: Optional[int]) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def section_step_overhead(device: torch.device, spec=None) -> list[Row]:
    from step_overhead import StepSpec, measure, overhead

    spec = spec or StepSpec()
    begin = time.perf_counter()
    results, setup = measure(spec, device)
    rows = [Row("overhead", f"megatron-core GPTModel {setup['parameters'] / 1e6:,.1f}M params, hidden "
                f"{spec.hidden_size}, {setup['tokens_per_step']} tokens/step, "
                f"{'TE' if setup['transformer_engine'] else 'local'} layers",
                f"{spec.rounds} rounds x {spec.steps_per_block} steps per mode ({time.perf_counter() - begin:.0f} s)")]
    plain = results["plain"]
    rows.append(Row("overhead", "step time without the plugin (median)", f"{plain.median * 1e3:.2f} ms, "
                    f"peak {gib(plain.peak_allocated)}"))
    for mode in spec.modes[1:]:
        r = results[mode]
        extra = overhead(results, mode)
        more = "" if r.peak_allocated is None or plain.peak_allocated is None else \
            f" ({(r.peak_allocated - plain.peak_allocated) / 2**20:+,.0f} MiB)"
        rows.append(Row("overhead", f"step time {mode}", f"{r.median * 1e3:.2f} ms ({extra:+.2%}), peak "
                        f"{gib(r.peak_allocated)}{more}", f"<= {GOAL_STEP_OVERHEAD:.0%}",
                        goal_status(extra, GOAL_STEP_OVERHEAD, False)))
        floats = {k: v for k, v in sorted(r.metrics.items()) if isinstance(v, float)}
        ok = "accuracy" in floats and all(math.isfinite(v) for v in floats.values())
        rows.append(Row("correctness", f"metrics of the {mode} steps",
                        ", ".join(f"{k} {v:.4f}" for k, v in floats.items()) or "none", "finite, present",
                        "ok" if ok else "FAIL"))
    return rows


# ----------------------------------------------------------------------------- main


def environment_rows(device: torch.device) -> tuple[list[Row], dict]:
    props = torch.cuda.get_device_properties(device)
    name = torch.cuda.get_device_name(device)
    facts = {"device": name, "capability": f"{props.major}.{props.minor}", "memory": props.total_memory,
             "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = None
    try:
        import transformer_engine

        facts["transformer_engine"] = getattr(transformer_engine, "__version__", "installed")
    except (ImportError, RuntimeError, OSError):
        facts["transformer_engine"] = None
    rows = [Row("device", "device", f"{name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"),
            Row("device", "software", f"torch {facts['torch']} (CUDA {facts['cuda']}), triton {facts['triton']}, "
                f"transformer-engine {facts['transformer_engine']}")]
    return rows, facts


def init_single_rank(tmp: str):
    """A one-rank NCCL group and megatron-core's parallel_state (TP=PP=1), for the peer code and the step."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return parallel_state.get_tensor_model_parallel_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import warnings

    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    rows, facts = environment_rows(device)
    if facts["triton"] is None:
        rows.append(Row("device", "triton", "not installed: the kernel cannot be checked", "installed", "FAIL"))
        print(format_table(rows))
        return 1

    def run_section(name: str, fn: Callable[[], object]):
        begin = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - a crashed section is a failure, the others still run
            import traceback

            rows.append(Row(name, "section crashed", f"{type(error).__name__}: {error}"[:200], "", "FAIL",
                            traceback.format_exc().splitlines()[-30:]))
            return None
        finally:
            print(f"gpu-check: {name} done in {time.perf_counter() - begin:.0f} s", flush=True)

    if not args.skip_tests:
        rows += run_section("tests", section_tests) or []
    bandwidth_facts, sweep_facts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        group = init_single_rank(tmp)
        rows += run_section("correctness", lambda: section_ops_cases(device) + section_kernel_vs_torch(
            device, args.tokens, args.vocab) + section_metrics(device)) or []
        rows += run_section("fused loss", lambda: section_fused_loss(device)) or []
        result = run_section("bandwidth", lambda: section_bandwidth(device, args.tokens, args.vocab, args.repeats,
                                                                    group))
        if result:
            rows += result[0]
            bandwidth_facts = result[1]
            middle = args.vocab[len(args.vocab) // 2]
            result = run_section("sweep", lambda: section_sweep(device, args.tokens, middle, args.repeats,
                                                                bandwidth_facts["copy_bandwidth"]))
            if result:
                rows += result[0]
                sweep_facts = result[1]
        if not args.skip_train:
            rows += run_section("train", lambda: section_train_example(args.train_timeout)) or []
            rows += run_section("overhead", lambda: section_step_overhead(device)) or []
    rows.append(Row("device", "gpu-check wall time", f"{time.perf_counter() - started:.0f} s", "< 480 s",
                    goal_status(time.perf_counter() - started, 480, higher_is_better=False)))

    passed, why = record_verdict(rows, bandwidth_facts.get("speedups", []))
    print()
    print(format_table(rows))
    print(f"\nkernel device check on {facts['device']!r}: {'PASSED' if passed else 'NOT PASSED'} ({why})")
    if not args.no_record:
        from twinkle_megatron.ops.kernel_select import device_entry, record_path, write_record

        path = args.record or record_path()
        entry = device_entry(passed, reason=why, capability=facts["capability"], cuda=facts["cuda"],
                             tokens=args.tokens, vocab=list(args.vocab),
                             speedup_vs_torch=[round(s, 3) for s in bandwidth_facts.get("speedups", [])],
                             bandwidth_fraction=[round(f, 3) for f in bandwidth_facts.get("fractions", [])],
                             copy_bandwidth_gbs=round(bandwidth_facts.get("copy_bandwidth", 0) / 1e9, 1),
                             **sweep_facts)
        write_record(path, facts["device"], entry)
        use = "now uses the kernel" if passed else "keeps the torch path"
        print(f"wrote {path}: kernel='auto' {use} on {facts['device']!r}; commit this file to share the result.")
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "rows": [asdict(r) for r in rows], "passed": passed},
                                        indent=2, default=str))
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
