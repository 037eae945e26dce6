"""``make gpu-check``'s timings on one CUDA device, in one table: what the kernel and the plugin cost on a GPU.

Run: ``python benchmarks/gpu_timings.py [--tokens 8192] [--vocab 32768,65536,131072] [--repeats 10]
[--skip-train] [--json PATH]`` (``make gpu-check`` runs it after the ``cuda`` tests and
``twinkle-megatron kernel-check``). Without a CUDA device it says so and exits 0. With one:

1. **bandwidth** -- CUDA-event medians (methods taking turns, ``ops/kernel_check.py``'s ``time_methods``) at
   ``--tokens`` x V bf16 for each V: the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB: 2 GiB moved),
   the kernel's effective bandwidth (bytes of the shard read per second, the whole
   ``vocab_parallel_token_stats`` call), the torch path and the peer code (``bench_token_stats.py``'s
   ``anchors``: Megatron's cross-entropy on a copy, a 3-all-reduce entropy, a 2-all-gather argmax, on a
   one-rank group); a sweep of the kernel's launch configurations; the fused loss against Megatron's
   ``vocab_parallel_cross_entropy`` (time and peak memory of forward + backward, fp32 and bf16);
2. **train** -- ``examples/train_gpt.py`` under ``torchrun`` on this GPU (TE layers when TE is installed), its
   tracker's CUDA-event step times, throughput, MFU and memory statistics from its JSONL log; then
   ``step_overhead.py`` (the one step-overhead harness, which ``make bench`` runs on CPU ranks): the same
   megatron-core steps (Megatron's DDP and Adam) with and without ``instrument()`` (torch loop, Triton kernel,
   ``fused_loss=True``), interleaved, per-step overhead (median ratio to the plain block of the same round) and
   peak memory.

Goals printed next to the numbers: kernel >= 80 % of copy bandwidth, >= 3x the torch path, step overhead
<= 1 % (hidden 2048). A missed goal does not change the exit status; a section that crashes, or a training
run that fails, makes it 1. Correctness is the ``cuda`` tests' job (``tests/test_cuda.py``).
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

import torch

from twinkle_megatron.cli import positive_int, positive_ints
from twinkle_megatron.ops.kernel_check import time_methods

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA_MESSAGE = "gpu-timings: no CUDA device (torch.cuda.is_available() is False): nothing was timed."
GOAL_BANDWIDTH_FRACTION = 0.8
GOAL_SPEEDUP_VS_TORCH = 3.0
GOAL_STEP_OVERHEAD = 0.01
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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=8192, help="tokens of the bandwidth shards")
    parser.add_argument("--vocab", type=positive_ints, default=[32768, 65536, 131072],
                        help="comma-separated local vocabulary sizes (bf16)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per method")
    parser.add_argument("--skip-train", action="store_true", help="do not run the training sections")
    parser.add_argument("--train-timeout", type=positive_int, default=240, help="seconds for train_gpt.py")
    parser.add_argument("--json", type=Path, default=None, help="also write every row as JSON here")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- sections


def section_fused_loss(device: torch.device, tokens: int = 4096, vocab: int = 32768) -> list[Row]:
    """The fused loss and megatron-core's ``vocab_parallel_cross_entropy`` on this device (one rank): the time and
    peak memory of forward + backward of each, fp32 and bf16 (their agreement: ``tests/test_cuda.py``)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats

    rows = []
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(tokens // 2, 2, vocab, generator=generator) * 3
    labels = torch.randint(0, vocab - 37, (tokens // 2, 2), generator=generator).to(device)
    grad = torch.rand(tokens // 2, 2, generator=generator).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        logits = base.to(device=device, dtype=dtype)

        def megatron(logits=logits):
            x = logits.clone().requires_grad_()
            vocab_parallel_cross_entropy(x, labels).backward(grad)

        def fused(logits=logits):
            x = logits.clone().requires_grad_()
            loss, _ = vocab_parallel_cross_entropy_with_stats(x * 1, labels, vocab_size=vocab - 37)
            loss.backward(grad)

        times = time_methods({"megatron": megatron, "fused": fused}, 5, device)
        memory = ""
        if device.type == "cuda":
            peaks = {}
            for name, fn in (("megatron", megatron), ("fused", fused)):
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                fn()
                peaks[name] = torch.cuda.max_memory_allocated(device) - before
            memory = f"; peak above the logits {peaks['fused'] / 2**20:,.0f} vs {peaks['megatron'] / 2**20:,.0f} MiB"
        rows.append(Row("fused loss", f"forward + backward, {tokens}x{vocab} {str(dtype)[6:]}",
                        f"fused {times['fused'] * 1e3:.2f} ms (loss + statistics) vs Megatron's loss alone "
                        f"{times['megatron'] * 1e3:.2f} ms{memory}"))
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
    """The kernel's local pass under each launch configuration (their agreement: ``tests/test_cuda.py``)."""
    from twinkle_megatron.ops.triton_token_stats import launch_config, triton_local_pass

    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, vocab, generator=generator, device=device).mul_(4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    nbytes = shard_bytes(tokens, vocab, 2)
    default = launch_config(vocab, 2)

    def run(config):
        triton_local_pass(x, vocab, labels, torch.zeros(3, tokens, device=device), True, *config)

    rows, best = [], None
    for config in [default] + [c for c in SWEEP if c != default]:
        seconds = time_methods({"run": lambda c=config: run(c)}, repeats, device)["run"]
        fraction = effective_bandwidth(nbytes, seconds) / copy_bw
        if best is None or fraction > best[1]:
            best = (config, fraction)
        rows.append(Row("sweep", f"local pass block={config[0]} warps={config[1]} stages={config[2]}"
                        + (" (default)" if config == default else ""), f"{seconds * 1e3:.3f} ms, {fraction:.0%} "
                        f"of copy"))
    rows.append(Row("sweep", "best configuration", f"block={best[0][0]} warps={best[0][1]} stages={best[0][2]}:"
                    f" {best[1]:.0%} of copy" + (" (the default)" if best[0] == default else "")))
    return rows, {"best_config": list(best[0]), "default_config": list(default)}


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
    import warnings

    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    rows, facts = environment_rows(device)
    if facts["triton"] is None:
        rows.append(Row("device", "triton", "not installed: the kernel cannot be timed", "installed", "FAIL"))
        print(format_table(rows))
        return 1

    def run_section(name: str, fn: Callable[[], object]):
        begin = time.perf_counter()
        print(f"gpu-timings: {name} ...", flush=True)
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - a crashed section is a failure, the others still run
            import traceback

            rows.append(Row(name, "section crashed", f"{type(error).__name__}: {error}"[:200], "", "FAIL",
                            traceback.format_exc().splitlines()[-30:]))
            return None
        finally:
            print(f"gpu-timings: {name} done in {time.perf_counter() - begin:.0f} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        group = init_single_rank(tmp)
        rows += run_section("fused loss", lambda: section_fused_loss(device)) or []
        result = run_section("bandwidth", lambda: section_bandwidth(device, args.tokens, args.vocab, args.repeats,
                                                                    group))
        if result:
            rows += result[0]
            middle = args.vocab[len(args.vocab) // 2]
            copy_bw = result[1]["copy_bandwidth"]
            rows += (run_section("sweep", lambda: section_sweep(device, args.tokens, middle, args.repeats, copy_bw))
                     or [[]])[0]
        if not args.skip_train:
            rows += run_section("train", lambda: section_train_example(args.train_timeout)) or []
            rows += run_section("overhead", lambda: section_step_overhead(device)) or []
    rows.append(Row("device", "gpu-timings wall time", f"{time.perf_counter() - started:.0f} s", "< 300 s",
                    goal_status(time.perf_counter() - started, 300, higher_is_better=False)))
    print()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "rows": [asdict(r) for r in rows]}, indent=2, default=str))
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
