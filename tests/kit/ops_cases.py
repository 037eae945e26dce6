"""The input families of the vocab-parallel ops (``twinkle_megatron.ops``) and their check against float64.

Every case builds the same full logits from a seed for a TP size, with the
special tokens the ops must get right (ties across shards, NaN and ±inf,
padding columns that would win if read, labels ignored or out of range); a
rank takes its vocabulary columns (``local_shard``) in the case's memory
layout. :func:`check_case` compares what the ops returned on every rank, bit
for bit across ranks, with ``kit.references.full_vocab_stats``: argmax exact,
log-probs and entropy within ``|ours − ref| <= tol + tol·|ref|`` (``tol`` 1e-5,
1e-9 for float64 input; bf16/fp16 values are exact in float64, so they get the
same tolerance). Used by ``tests/test_ops.py``, ``tests/test_triton_token_stats.py``
and ``tests/test_cuda.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kit.references import IGNORE_INDEX, full_vocab_stats
from twinkle_megatron.testing.batches import RankView

ATOL = RTOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One input family. ``layout``: tv | bsv | sbv | transposed ([s,b,v] storage seen as [b,s,v]) |
    strided (a leading-dim slice no view can flatten) | empty."""

    name: str
    layout: str
    v_local: int
    pad: int = 0  # true vocab = v_local * tp - pad
    dtype: torch.dtype = torch.float32
    seed: int = 0
    b: int = 3
    s: int = 7

    def vocab(self, tp: int) -> int:
        """The true vocabulary size (``pad`` wraps round one shard when it would not fit, e.g. for TP = 1)."""
        pad = self.pad if self.pad < self.v_local * tp else self.pad % self.v_local
        return self.v_local * tp - pad

    def vocab_size(self, tp: int) -> Optional[int]:
        """What the ops are told: None when nothing is padded."""
        return self.vocab(tp) if self.vocab(tp) < self.v_local * tp else None


CASES = [
    Case("fp32_tv", "tv", 160),
    Case("fp32_bsv_padded", "bsv", 160, pad=13, seed=1),
    Case("bf16_sbv_padded", "sbv", 1000, pad=150, dtype=torch.bfloat16, seed=2),
    Case("fp32_transposed_pad_whole_shard", "transposed", 24, pad=30, seed=3),
    Case("fp16_strided", "strided", 160, pad=5, dtype=torch.float16, seed=4),
    Case("fp64_bsv", "bsv", 100, dtype=torch.float64, seed=5),
    Case("fp32_empty", "empty", 160, pad=7, seed=6),
]
CHUNKS = (1, 5, 7, 21, 24, None)  # T = 21: chunks that divide it, that do not, = T, > T, default


def tokens(case: Case) -> int:
    """How many tokens the case has."""
    return 0 if case.layout == "empty" else case.b * case.s


def make_inputs(case: Case, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits ``[T, V_global]`` (float32 before the cast) and labels ``[T]``, with special tokens."""
    v_local = case.v_local
    v_global, vocab = v_local * tp, case.vocab(tp)
    n = tokens(case)
    gen = torch.Generator().manual_seed(case.seed * 100 + tp)
    x = torch.randn(n, v_global, generator=gen) * 4
    labels = torch.randint(0, vocab, (n,), generator=gen)
    if n == 0:
        return x.to(case.dtype), labels
    x[:, vocab:] = 1e3  # padding that would win everything if it were read
    x[1, vocab:] = float("nan")  # ... or poison the token
    top = 20.0  # exact in every dtype
    # 0: the same maximum in every shard (and twice in shard 0): the lowest global column wins
    for shard in range(tp):
        for off in (3, 1) if shard else (5, 3):
            if shard * v_local + off < vocab:
                x[0, shard * v_local + off] = top
    # 2: ties inside the last shard that has real columns, the earlier one wins
    last = (vocab - 1) // v_local
    lo, hi = last * v_local + 2, min(vocab - 1, last * v_local + 10)
    x[2, hi] = x[2, lo] = top
    # 3: all equal -> argmax 0, entropy log V, log p = -log V
    x[3, :vocab] = 1.5
    # 4, 5, 6: NaN in the last real shard, +inf in shard 0, -inf in shard 1
    x[4, vocab - 1] = float("nan")
    x[5, 1] = float("inf")
    x[6, min(v_local + 1, vocab - 1)] = float("-inf")
    # 7: +-1e4; 8: near 1e4 (fp32 ulp 1e-3); 9: -1e4 everywhere but one column
    x[7, :vocab] = torch.where(torch.rand(vocab, generator=gen) > 0.5, 1e4, -1e4)
    x[8, :vocab] = 1e4 + torch.randn(vocab, generator=gen)
    x[9, :vocab] = -1e4
    x[9, vocab // 2] = 3.0
    # 10: the maximum on the last real column (next to the padding)
    x[10, vocab - 1] = top
    # 15: a tie won by a later shard (shard 1, or shard 0 for TP = 1) over the shards after it
    first = v_local if vocab > v_local + 9 else 0
    for col in (first + 9, first + 7, *(shard * v_local for shard in range(2, tp))):
        if col < vocab:
            x[15, col] = top
    # labels: ignored (also on a NaN token), below 0, on the first padding column / past V, far out
    labels[11] = IGNORE_INDEX
    labels[12] = -5
    labels[13] = vocab
    labels[14] = v_global + 7
    labels[4] = IGNORE_INDEX if tp == 2 else labels[4]  # TP=2: ignore_index wins over a NaN logit
    labels[9] = vocab // 2
    labels[7] = vocab - 1
    return x.to(case.dtype), labels


def arrange(case: Case, flat: torch.Tensor) -> torch.Tensor:
    """Put a ``[T, ...]`` tensor into the case's leading layout ([b,s,...], [s,b,...] or [T,...])."""
    rest = flat.shape[1:]
    if case.layout in ("tv", "empty"):
        return flat.view(tokens(case), *rest) if case.layout == "tv" else flat.view(0, case.s, *rest)
    if case.layout in ("bsv", "strided"):
        return flat.view(case.b, case.s, *rest)
    if case.layout == "sbv":
        return flat.view(case.s, case.b, *rest)
    if case.layout == "transposed":  # token (b, s) lives at storage [s, b]
        return flat.view(case.b, case.s, *rest)
    raise AssertionError(case.layout)


def case_inputs(case: Case, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's full logits and labels for TP = ``tp``, in the case's leading layout."""
    full, labels = make_inputs(case, tp)
    return arrange(case, full), arrange(case, labels)


def local_shard(case: Case, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's columns of ``full`` (already arranged) in the memory layout the case asks for."""
    columns = RankView(tp_rank=rank, tp_size=tp).vocab(full)
    if case.layout == "transposed":
        return columns.transpose(0, 1).contiguous().transpose(0, 1)  # [b,s,v] view of [s,b,v] data
    if case.layout == "strided":  # leading dims no view can merge: the rows are copied
        longer = torch.zeros(case.b, case.s + 1, case.v_local, dtype=full.dtype)
        longer[:, :case.s] = columns
        return longer[:, :case.s]
    return columns.contiguous()


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL,
                 rtol: float = RTOL) -> None:
    """NaN exactly where ``ref`` has NaN; elsewhere finite and ``|ours − ref| <= atol + rtol·|ref|``."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    nan_ours, nan_ref = torch.isnan(ours), torch.isnan(ref)
    assert torch.equal(nan_ours, nan_ref), f"{name}: NaN at {nan_ours.nonzero().tolist()}, " \
                                           f"expected at {nan_ref.nonzero().tolist()}"
    ok = ~nan_ref
    assert torch.isfinite(ours[ok]).all(), f"{name}: non-finite {ours}"
    err = (ours[ok].double() - ref[ok]).abs()
    bound = atol + rtol * ref[ok].abs()
    assert (err <= bound).all(), f"{name}: max error {err.max().item():.3g} (bound {atol}+{rtol}|ref|)"


def assert_same_on_ranks(name: str, per_rank: list) -> None:
    """Every rank's tensors (a triple each) have rank 0's dtype, shape and bits."""
    first = per_rank[0]
    for rank, other in enumerate(per_rank[1:], start=1):
        for a, b in zip(first, other):
            if a is None or b is None:
                assert a is None and b is None, name
                continue
            same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                a.view(torch.uint8) if a.is_floating_point() else a,
                b.view(torch.uint8) if b.is_floating_point() else b)
            assert same, f"{name}: rank {rank} differs from rank 0"


def tolerance(dtype: torch.dtype) -> float:
    """The log-prob and entropy tolerance for logits of ``dtype``."""
    return 1e-9 if dtype == torch.float64 else ATOL


def check_case(case: Case, tp: int, per_rank: list) -> None:
    """Check the ops' results for ``case`` on TP = ``tp``: ``per_rank[r]`` maps a name to a TokenStats-like
    ``(argmax, logprobs, entropy)`` triple (None where not computed), or ``'unchanged'`` to whether the logits
    were left intact. Every rank bit for bit the same; argmax exact; the rest within ``tolerance``."""
    full, labels = case_inputs(case, tp)
    vocab = case.vocab(tp)
    ref = full_vocab_stats(full, labels, vocab)
    tol = tolerance(case.dtype)
    for key in per_rank[0]:
        name = f"{case.name} tp={tp} {key}"
        if key == "unchanged":
            assert all(r[key] for r in per_rank), f"{name}: logits were modified"
            continue
        assert_same_on_ranks(name, [r[key] for r in per_rank])
        argmax, lp, ent = per_rank[0][key]
        if argmax is not None:
            assert argmax.dtype == torch.int64 and torch.equal(argmax, ref.argmax), \
                f"{name}: argmax {argmax.tolist()} != {ref.argmax.tolist()}"
        if lp is not None:
            assert_close(f"{name} logprobs", lp, ref.logprobs, tol, tol)
        if ent is not None:
            assert_close(f"{name} entropy", ent, ref.entropy, tol, tol)


