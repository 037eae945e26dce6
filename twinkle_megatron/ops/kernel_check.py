"""The device check behind ``kernel="auto"``: the Triton kernel against the torch loop on one CUDA device.

``twinkle-megatron kernel-check`` runs :func:`check_kernel` and writes its
verdict as this device's entry of the record :mod:`.kernel_select` reads. For
each local vocabulary size V, on ``tokens × V`` bf16 logits with padding
columns, ties, NaN/inf rows, and ignored and out-of-range labels
(:func:`special_logits`):

1. **correctness**: the kernel's argmax, label log-probs and entropies through
   ``vocab_parallel_token_stats`` against the torch loop's on every token
   (relative 2e-5) and both against float64 on the first 256 tokens (relative
   1e-5): the argmax equal, NaN at the same tokens, ``|a − b| ≤ tol·(1 + |b|)``
   elsewhere (:func:`compare`);
2. **speed**: the median seconds of the whole call through each path, timed
   with CUDA events around each call, the two paths taking turns
   (:func:`time_methods`).

The check passes when every comparison holds and the kernel is faster than the
torch loop at every V. ``make gpu-check`` runs it after the ``cuda`` tests.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, Union

import torch

from .kernel_select import device_entry, write_record
from .token_stats import TokenStats, vocab_parallel_token_stats

__all__ = ["KernelCheck", "check_kernel", "compare", "float64_token_stats", "record_check", "special_logits",
           "time_methods"]

FLOAT64_TOKENS = 256
TOLERANCE_VS_TORCH = 2e-5
TOLERANCE_VS_FLOAT64 = 1e-5
IGNORE_INDEX = -100


@dataclass
class KernelCheck:
    """The check's result: per V the kernel's and the torch loop's seconds per call, and every problem found."""

    device: str
    tokens: int
    vocabs: list[int]
    kernel_seconds: list[float] = field(default_factory=list)
    torch_seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def speedups(self) -> list[float]:
        """The torch loop's time over the kernel's, per V."""
        return [slow / fast for slow, fast in zip(self.torch_seconds, self.kernel_seconds)]

    @property
    def passed(self) -> bool:
        return not self.problems and len(self.speedups) == len(self.vocabs) and min(self.speedups) > 1.0

    @property
    def reason(self) -> str:
        """Why the check passed or did not, in one line (the record's ``reason``)."""
        if self.problems:
            return f"{len(self.problems)} correctness problems: " + "; ".join(self.problems[:3])
        if not self.speedups:
            return "the kernel's speed was not measured"
        if min(self.speedups) <= 1.0:
            return f"the kernel was not faster than the torch path (min speed-up {min(self.speedups):.2f}x)"
        return f"the kernel agrees with the torch path and float64; min speed-up {min(self.speedups):.2f}x"


def special_logits(tokens: int, vocab: int, device: torch.device, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """bf16 ``[tokens, vocab]`` logits, labels and the true vocabulary size: the last 37 columns padding (logit
    1e3, which must never win), a tie across far-apart blocks (row 0), NaN (row 1), +inf (row 2), -inf (row 3)
    and a constant row (row 4); labels -100 (row 5) and out of range (rows 6 and 7)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, vocab, generator=generator, device=device).mul_(4)
    vocab_size = vocab - 37
    x[:, vocab_size:] = 1e3
    x[0, [5, vocab_size - 3]] = 30.0
    x[1, [7, vocab_size // 2]] = float("nan")
    x[2, 3] = float("inf")
    x[3, 9] = float("-inf")
    x[4, :vocab_size] = 1.5
    labels = torch.randint(0, vocab_size, (tokens,), generator=generator, device=device)
    labels[5], labels[6], labels[7] = IGNORE_INDEX, vocab_size + 3, -7
    return x.to(torch.bfloat16), labels, vocab_size


def float64_token_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> TokenStats:
    """The statistics in float64 over columns ``[0, vocab_size)``: ``torch.argmax``; ``log_softmax(x)[label]``,
    0 for label -100, NaN for a label out of range or a token with a non-finite logit; ``−Σ p log p``."""
    x = logits[..., :vocab_size].double()
    log_p = torch.log_softmax(x, dim=-1)
    picked = log_p.gather(-1, labels.clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    passes_checks = torch.isfinite(x).all(-1) & (labels >= 0) & (labels < vocab_size)
    logprobs = torch.where(labels == IGNORE_INDEX, 0.0, torch.where(passes_checks, picked, math.nan))
    return TokenStats(x.argmax(-1), logprobs, -(log_p.exp() * log_p).sum(-1))


def compare(name: str, ours: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], tolerance: float
            ) -> list[str]:
    """(argmax, logprobs, entropy) against a reference: argmax equal, NaN at the same tokens, and
    ``|a − b| ≤ tolerance·(1 + |b|)`` elsewhere. The problems found, each a line naming ``name``."""
    problems = []
    if not torch.equal(ours[0], reference[0].to(ours[0].dtype)):
        different = (ours[0] != reference[0]).nonzero().flatten()[:5].tolist()
        problems.append(f"{name}: argmax differs at tokens {different}")
    for what, a, b in (("logprobs", ours[1], reference[1]), ("entropy", ours[2], reference[2])):
        a, b = a.double(), b.double()
        if not torch.equal(torch.isnan(a), torch.isnan(b)):
            problems.append(f"{name}: {what} NaN at different tokens")
            continue
        finite = ~torch.isnan(b)
        error = ((a[finite] - b[finite]).abs() / (1 + b[finite].abs())).max().item() if finite.any() else 0.0
        if not error <= tolerance:
            problems.append(f"{name}: {what} max relative error {error:.2e} > {tolerance:.0e}")
    return problems


def time_methods(methods: dict[str, Callable[[], object]], repeats: int, device: torch.device,
                 warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each method, the methods taking turns (a, b, a, b, ...): CUDA events around
    each call on a GPU, ``time.perf_counter`` elsewhere."""
    for method in methods.values():
        for _ in range(warmup):
            method()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, method in methods.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                method()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                method()
                times[name].append(time.perf_counter() - begin)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def check_kernel(device: torch.device, tokens: int = 8192, vocabs: Sequence[int] = (32768, 65536, 131072),
                 repeats: int = 10) -> KernelCheck:
    """Check the kernel on ``device`` (see the module docstring); on CPU only in Triton's interpreter."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    result = KernelCheck(name, tokens, list(vocabs))
    for vocab in vocabs:
        problems, seconds = _check_one_size(device, tokens, vocab, repeats)
        result.problems += problems
        result.kernel_seconds.append(seconds["kernel"])
        result.torch_seconds.append(seconds["torch"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def _check_one_size(device: torch.device, tokens: int, vocab: int, repeats: int) -> tuple[list[str], dict]:
    """The comparisons and the timings of :func:`check_kernel` at one vocabulary size."""
    x, labels, vocab_size = special_logits(tokens, vocab, device, seed=vocab)
    kernel = vocab_parallel_token_stats(x, labels, vocab_size=vocab_size, kernel="triton")
    torch_loop = vocab_parallel_token_stats(x, labels, vocab_size=vocab_size, kernel="torch")
    exact = float64_token_stats(x[:FLOAT64_TOKENS], labels[:FLOAT64_TOKENS], vocab_size)
    problems = compare(f"V={vocab} kernel vs torch path", kernel, torch_loop, TOLERANCE_VS_TORCH)
    for name, stats in (("kernel", kernel), ("torch path", torch_loop)):
        problems += compare(f"V={vocab} {name} vs float64", [t[:FLOAT64_TOKENS] for t in stats], exact,
                            TOLERANCE_VS_FLOAT64)
    seconds = time_methods({path: lambda path=path: vocab_parallel_token_stats(x, labels, vocab_size=vocab_size,
                                                                               kernel=path)
                            for path in ("triton", "torch")}, repeats, device)
    return problems, {"kernel": seconds["triton"], "torch": seconds["torch"]}


def record_check(check: KernelCheck, path: Union[str, os.PathLike]) -> dict:
    """Write ``check`` as its device's entry of the record at ``path`` (other devices kept); the entry."""
    entry = device_entry(check.passed, reason=check.reason, tokens=check.tokens, vocab=check.vocabs,
                         speedup_vs_torch=[round(speedup, 3) for speedup in check.speedups],
                         kernel_ms=[round(seconds * 1e3, 4) for seconds in check.kernel_seconds],
                         torch_ms=[round(seconds * 1e3, 4) for seconds in check.torch_seconds])
    write_record(Path(path), check.device, entry)
    return entry
