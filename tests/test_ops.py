"""Vocab-parallel token statistics (``twinkle_megatron.ops``) against a float64 full-vocabulary reference.

Multi-rank cases fork gloo workers (``tests/distributed.py``); every worker builds
the same full logits from a seed, takes its own vocabulary shard and returns its
results, which the parent compares bit for bit across ranks and with
``argmax`` / ``log_softmax`` / ``-(p log p).sum()`` computed in float64 from the
same values (bf16/fp16 values are exact in float64, so they get the same
tolerance). Tolerance for log-probs and entropy: ``|ours - ref| <= 1e-5 + 1e-5·|ref|``
(absolute 1e-5 plus relative 1e-5, ``torch.testing`` style); argmax exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
from distributed import Layout, run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

from twinkle_megatron.ops import (
    TokenStats,
    vocab_parallel_argmax,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
)
from twinkle_megatron.ops.shard import decode_key, encode_key
from twinkle_megatron.ops.token_stats import first_max_column

IGNORE = -100
ATOL = RTOL = 1e-5


# ----------------------------------------------------------------------------- inputs and reference


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
    labels[11] = IGNORE
    labels[12] = -5
    labels[13] = vocab
    labels[14] = v_global + 7
    labels[4] = IGNORE if tp == 2 else labels[4]  # TP=2: ignore_index wins over a NaN logit
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


def local_shard(case: Case, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's columns of ``full`` (already arranged) in the memory layout the case asks for."""
    cols = slice(rank * case.v_local, (rank + 1) * case.v_local)
    if case.layout == "transposed":
        return full[..., cols].transpose(0, 1).contiguous().transpose(0, 1)  # [b,s,v] view of [s,b,v] data
    if case.layout == "strided":  # leading dims no view can merge: the rows are copied
        longer = torch.zeros(case.b, case.s + 1, case.v_local, dtype=full.dtype)
        longer[:, :case.s] = full[..., cols]
        return longer[:, :case.s]
    return full[..., cols].contiguous()


def reference(full: torch.Tensor, labels: torch.Tensor, vocab: int) -> TokenStats:
    x = full[..., :vocab].double()
    lsm = torch.log_softmax(x, dim=-1)
    entropy = -(lsm.exp() * lsm).sum(-1)
    lp = lsm.gather(-1, labels.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(torch.isfinite(x).all(-1) & (labels >= 0) & (labels < vocab), lp, math.nan)
    lp = torch.where(labels == IGNORE, 0.0, lp)
    return TokenStats(x.argmax(-1), lp, entropy)


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL,
                 rtol: float = RTOL) -> None:
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
    return 1e-9 if dtype == torch.float64 else ATOL


def check_case(case: Case, tp: int, per_rank: list) -> None:
    """``per_rank[r]`` = {key: TokenStats-like triple} from :func:`_cases_worker`."""
    full_flat, labels_flat = make_inputs(case, tp)
    full, labels = arrange(case, full_flat), arrange(case, labels_flat)
    vocab = case.vocab(tp)
    ref = reference(full, labels, vocab)
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


# ----------------------------------------------------------------------------- workers


def _cases_worker(cases: list) -> list:
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for case in cases:
        full_flat, labels_flat = make_inputs(case, tp)
        full, labels = arrange(case, full_flat), arrange(case, labels_flat)
        shard = local_shard(case, full, rank, tp)
        before = shard.clone()
        vocab = case.vocab_size(tp)
        res: dict = {}
        for chunk in CHUNKS:
            st = vocab_parallel_token_stats(shard, labels, group=group, vocab_size=vocab, chunk_size=chunk)
            res[f"stats chunk={chunk}"] = tuple(st)
        st = vocab_parallel_token_stats(shard, group=group, vocab_size=vocab, chunk_size=3)
        assert st.logprobs is None
        res["stats no labels"] = tuple(st)
        res["argmax op"] = (vocab_parallel_argmax(shard, group=group, vocab_size=vocab), None, None)
        res["logprobs op"] = (None, vocab_parallel_logprobs(shard, labels, group, vocab_size=vocab), None)
        res["entropy op"] = (None, None, vocab_parallel_entropy(shard, group=group, vocab_size=vocab))
        res["unchanged"] = torch.equal(shard.view(torch.uint8), before.view(torch.uint8))
        out.append(res)
    return out


# ----------------------------------------------------------------------------- single process (group=None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_whole_vocab_local(case: Case) -> None:
    """group=None: the whole vocabulary is local (TP = 1); every layout, dtype, chunk size and edge case."""
    full_flat, labels_flat = make_inputs(case, 1)
    full, labels = arrange(case, full_flat), arrange(case, labels_flat)
    logits = local_shard(case, full, 0, 1)
    before = logits.clone()
    vocab = case.vocab_size(1)
    results = {f"chunk={c}": tuple(vocab_parallel_token_stats(logits, labels, vocab_size=vocab, chunk_size=c))
               for c in CHUNKS}
    results["argmax op"] = (vocab_parallel_argmax(logits, vocab_size=vocab), None, None)
    results["logprobs op"] = (None, vocab_parallel_logprobs(logits, labels, vocab_size=vocab), None)
    results["entropy op"] = (None, None, vocab_parallel_entropy(logits, vocab_size=vocab))
    results["unchanged"] = torch.equal(logits.view(torch.uint8), before.view(torch.uint8))
    check_case(case, 1, [results])


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel(world: int) -> None:
    """TP = 2 and 4 over the world group: all cases, chunk sizes and ops; identical on every rank."""
    per_rank = run_distributed(_cases_worker, world, args=(CASES,))
    for i, case in enumerate(CASES):
        check_case(case, world, [r[i] for r in per_rank])


def test_special_tokens_are_what_they_claim() -> None:
    """Guard the fixtures: the reference sees the ties, NaNs and out-of-range labels the cases describe."""
    case = CASES[1]
    for tp in (1, 2, 4):
        full, labels = make_inputs(case, tp)
        vocab = case.vocab(tp)
        ref = reference(full, labels, vocab)
        assert ref.argmax[0] == 3 and ref.argmax[2] == ((vocab - 1) // case.v_local) * case.v_local + 2
        assert ref.argmax[10] == vocab - 1 and ref.argmax[3] == 0
        assert ref.argmax[15] == (case.v_local if tp > 1 else 0) + 7
        assert torch.isnan(ref.entropy[[4, 5, 6]]).all()
        assert torch.isfinite(ref.entropy[[0, 1, 2, 3, 7, 8, 9]]).all()
        assert torch.isnan(ref.logprobs[[5, 6, 12, 13, 14]]).all() and ref.logprobs[11] == 0
        assert ref.entropy[3].item() == pytest.approx(math.log(vocab))
        assert (full[:, vocab:].float() >= 1e3).any()


def test_extreme_logits_do_not_overflow() -> None:
    x = torch.tensor([[1e4, -1e4, 1e4 - 1, -1e4, 0.0], [1.5e38, -1.5e38, 1.5e38, 0.0, 1.0]])
    labels = torch.tensor([1, 3])
    st = vocab_parallel_token_stats(x, labels)
    ref = reference(x, labels, 5)
    assert torch.isfinite(st.entropy).all() and torch.isfinite(st.logprobs).all()
    assert_close("extreme entropy", st.entropy, ref.entropy)
    assert_close("extreme logprobs", st.logprobs, ref.logprobs)
    assert st.argmax.tolist() == [0, 0]


def test_entropy_accuracy_against_float64_at_scale() -> None:
    """A realistic vocabulary (32k) and several logit scales: fp32 stays within 1e-5 of float64."""
    gen = torch.Generator().manual_seed(7)
    for scale in (1.0, 5.0, 30.0):
        x = torch.randn(16, 32768, generator=gen) * scale + 50.0
        labels = torch.randint(0, 32768, (16,), generator=gen)
        st = vocab_parallel_token_stats(x, labels, chunk_size=5)
        ref = reference(x, labels, 32768)
        assert_close(f"scale {scale} entropy", st.entropy, ref.entropy)
        assert_close(f"scale {scale} logprobs", st.logprobs, ref.logprobs)


def test_shape_errors_name_both_shapes() -> None:
    logits = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match=r"labels has shape \(2, 5\) but logits has shape \(2, 4, 16\) "
                                         r"\(expected labels of shape \(2, 4\)\)"):
        vocab_parallel_token_stats(logits, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        vocab_parallel_logprobs(logits, torch.zeros(4, 2, dtype=torch.long))


def test_bad_arguments() -> None:
    logits = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_token_stats(logits, vocab_size=9)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_argmax(logits, vocab_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_token_stats(logits, chunk_size=0)
    with pytest.raises(TypeError, match="floating-point"):
        vocab_parallel_token_stats(torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        vocab_parallel_token_stats(logits, torch.zeros(3))
    with pytest.raises(ValueError, match="vocabulary"):
        vocab_parallel_entropy(torch.zeros(3, 0))


def test_requires_grad_input_gives_plain_results() -> None:
    logits = torch.randn(4, 50, requires_grad=True)
    st = vocab_parallel_token_stats(logits, torch.arange(4))
    assert not st.entropy.requires_grad and not st.logprobs.requires_grad and logits.grad is None


def test_key_order_and_round_trip() -> None:
    """The int64 key sorts exactly like (value, -column), and decodes bit for bit."""
    specials = [float("-inf"), -3.4e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.1754942e-38, 1.0, 1.0000001, 3.4e38,
                float("inf")]
    values = torch.tensor(specials, dtype=torch.float32)
    for vocab in (1, 2, 3, 50257, 2**20 + 3, 2**32):
        col_list = [(i * 7919) % vocab for i in range(len(specials))]
        cols = torch.tensor(col_list)
        keys = encode_key(values, cols, vocab).tolist()
        vals = values.tolist()  # float32-rounded
        for i in range(len(specials)):
            for j in range(len(specials)):
                # (value, -column) in lexicographic order, -0.0 == +0.0
                lex = (vals[i] > vals[j]) - (vals[i] < vals[j]) or (col_list[j] > col_list[i]) - (
                    col_list[j] < col_list[i])
                assert (keys[i] > keys[j]) - (keys[i] < keys[j]) == lex, (specials[i], specials[j])
        keys = torch.tensor(keys)
        back, back_cols = decode_key(keys, vocab)
        assert torch.equal(back_cols, cols)
        assert torch.equal(back, values + 0.0)  # -0.0 comes back as +0.0
        # equal values: the lower column gets the larger key
        tie = encode_key(torch.tensor([2.5, 2.5]), torch.tensor([0, vocab - 1]), vocab)
        assert vocab == 1 or tie[0] > tie[1]
        nan_key = encode_key(torch.tensor([float("nan"), -float("nan")]), torch.tensor([0, 0]), vocab)
        assert (nan_key > keys.max()).all() and torch.isnan(decode_key(nan_key, vocab)[0]).all()


@pytest.mark.parametrize("n_cols", [5, 63, 64, 65, 200, 513, 1024, 3000])
def test_two_level_argmax_matches_torch(n_cols: int) -> None:
    gen = torch.Generator().manual_seed(n_cols)
    x = torch.randint(-3, 4, (40, n_cols), generator=gen).float()  # many ties
    x[0] = 0.0
    x[1, n_cols - 1] = 9.0
    x[2, [n_cols // 3, n_cols - 1]] = float("nan")
    x[3, [n_cols // 2, n_cols - 1]] = float("inf")
    x[4] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        got = vocab_parallel_argmax(x.to(dtype))
        assert torch.equal(got, x.to(dtype).argmax(-1)), dtype
        assert torch.equal(vocab_parallel_token_stats(x.to(dtype), chunk_size=3).argmax, got)
    for width in (16, 32):
        if n_cols >= width:
            n_blocks = -(-n_cols // width)
            table = torch.stack([x[:, i * width:(i + 1) * width].amax(-1) for i in range(n_blocks)], dim=1)
            assert torch.equal(first_max_column(x, table, width, 4), x.argmax(-1))


def test_nonfinite_token_is_isolated() -> None:
    """A NaN in one token does not touch its neighbours; NaN only in padding is ignored."""
    x = torch.randn(4, 300)
    x[1, 7] = float("nan")
    x[2, 299] = float("nan")  # padding column when vocab_size = 299
    labels = torch.tensor([0, 1, 2, IGNORE])
    st = vocab_parallel_token_stats(x, labels, vocab_size=299)
    assert torch.isnan(st.entropy).tolist() == [False, True, False, False]
    assert torch.isnan(st.logprobs).tolist() == [False, True, False, False]
    assert st.argmax[1].item() == 7 and st.logprobs[3].item() == 0.0
    ref = reference(x, labels, 299)
    assert_close("entropy", st.entropy, ref.entropy)


def test_one_dimensional_logits() -> None:
    """A single token without leading dims: scalar results."""
    x = torch.tensor([0.5, 2.0, -1.0, 2.0])
    st = vocab_parallel_token_stats(x, torch.tensor(2), chunk_size=3)
    ref = reference(x, torch.tensor(2), 4)
    assert st.argmax.shape == () and st.argmax.item() == 1
    assert_close("entropy", st.entropy, ref.entropy)
    assert_close("logprobs", st.logprobs, ref.logprobs)


def test_empty_returns_empty() -> None:
    for shape in [(0, 32), (2, 0, 32), (0, 0, 32)]:
        st = vocab_parallel_token_stats(torch.zeros(shape), torch.zeros(shape[:-1], dtype=torch.long))
        assert st.argmax.shape == st.logprobs.shape == st.entropy.shape == shape[:-1]
        assert st.argmax.dtype == torch.int64 and st.entropy.dtype == torch.float32


# ----------------------------------------------------------------------------- collectives, groups, syncs

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "all_gather_object", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "gather_object",
                "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                "barrier", "all_reduce_coalesced", "all_gather_coalesced", "monitored_barrier")


class _C10dOps(TorchDispatchMode):
    """Counts c10d dispatcher ops (every collective, however it is called)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "wait" not in func.name():
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


class _CountCollectives:
    """Wrap every torch.distributed collective entry point (both namespaces) and count calls by name."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._saved: list = []

    def __enter__(self) -> _CountCollectives:
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            for name in _COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self._saved.append((module, name, fn))
                setattr(module, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)


def _count(fn: Callable[[], object]) -> tuple[list, list]:
    with _CountCollectives() as api, _C10dOps() as ops:
        fn()
    # A nested API call (all_gather_into_tensor -> all_gather_single) counts once in c10d ops.
    return api.calls, ops.ops


def _collectives_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Create every group before counting (new_group itself talks to the store on all ranks).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    tp_group, own = pairs[rank // 2], singles[rank]
    case = Case("pair", "bsv", 192, pad=11, seed=10 + rank // 2)  # each TP pair has its own data
    full_flat, labels_flat = make_inputs(case, 2)
    full, labels = arrange(case, full_flat), arrange(case, labels_flat)
    shard = local_shard(case, full, dist.get_rank(tp_group), 2)
    vocab = case.vocab_size(2)
    counts, results = {}, {}
    for chunk in (1, 4, 21, None):
        counts[f"stats chunk={chunk}"] = _count(lambda c=chunk: results.__setitem__(
            f"chunk={c}", tuple(vocab_parallel_token_stats(shard, labels, tp_group, vocab, chunk_size=c))))
    counts["stats no labels"] = _count(lambda: vocab_parallel_token_stats(shard, None, tp_group, vocab))
    counts["argmax"] = _count(lambda: results.__setitem__(
        "argmax op", (vocab_parallel_argmax(shard, tp_group, vocab), None, None)))
    counts["logprobs"] = _count(lambda: vocab_parallel_logprobs(shard, labels, tp_group, vocab))
    counts["entropy"] = _count(lambda: vocab_parallel_entropy(shard, tp_group, vocab))
    counts["empty"] = _count(lambda: vocab_parallel_token_stats(shard[:0], labels[:0], tp_group, vocab))
    # A group of one rank, and no group: the whole (unpadded) vocabulary is local, no collective.
    whole = full[..., :vocab].contiguous()
    counts["group of one"] = _count(lambda: results.__setitem__(
        "group of one", tuple(vocab_parallel_token_stats(whole, labels, own, chunk_size=5))))
    counts["group None"] = _count(lambda: vocab_parallel_token_stats(whole, labels))
    return {"counts": counts, "results": results, "pair": rank // 2}


def test_collective_count_and_subgroups() -> None:
    """Exactly 2 collectives per stats call (1 for argmax) whatever the chunking; none for T=0, one rank
    or no group. Two TP=2 groups inside a world of 4 with different data, each matching its reference."""
    per_rank = run_distributed(_collectives_worker, 4)
    for rank, r in enumerate(per_rank):
        for key, (api, ops) in r["counts"].items():
            n = 1 if key == "argmax" else 0 if key in ("empty", "group of one", "group None") else 2
            assert len(api) == n and len(ops) == n, f"rank {rank} {key}: {api} / {ops}"
            if n == 2:
                assert api == ["all_reduce"] * 2 and ops == ["c10d::allreduce_"] * 2
    for pair in (0, 1):
        ranks = [r for r in per_rank if r["pair"] == pair]
        case = Case("pair", "bsv", 192, pad=11, seed=10 + pair)
        check_case(case, 2, [{k: v for k, v in r["results"].items() if k != "group of one"} for r in ranks])
        full, labels = make_inputs(case, 2)
        vocab = case.vocab_size(2)
        ref = reference(arrange(case, full), arrange(case, labels), vocab)
        for r in ranks:
            argmax, lp, ent = r["results"]["group of one"]
            assert torch.equal(argmax, ref.argmax)
            assert_close("group of one logprobs", lp, ref.logprobs)
            assert_close("group of one entropy", ent, ref.entropy)


class _NoHostSync:
    """Make every tensor -> host value conversion raise."""

    NAMES = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__",
             "__repr__", "__str__", "__format__", "__array__")

    def __enter__(self) -> _NoHostSync:
        self._saved = {name: torch.Tensor.__dict__.get(name) for name in self.NAMES}

        def forbid(name: str) -> Callable:
            def raiser(*args, **kwargs):
                raise AssertionError(f"host sync: Tensor.{name}")
            return raiser
        for name in self.NAMES:
            setattr(torch.Tensor, name, forbid(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            if fn is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, fn)


def _no_sync_worker(cases: list) -> list:
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    prepared = []
    for case in cases:
        full_flat, labels_flat = make_inputs(case, tp)
        full, labels = arrange(case, full_flat), arrange(case, labels_flat)
        prepared.append((local_shard(case, full, rank, tp), labels, case.vocab_size(tp)))
    out = []
    with _NoHostSync():
        for shard, labels, vocab in prepared:
            res = {"stats": tuple(vocab_parallel_token_stats(shard, labels, group, vocab, chunk_size=4)),
                   "argmax op": (vocab_parallel_argmax(shard, group, vocab), None, None),
                   "logprobs op": (None, vocab_parallel_logprobs(shard, labels, group, vocab), None),
                   "entropy op": (None, None, vocab_parallel_entropy(shard, group, vocab))}
            out.append(res)
    return out


def test_no_host_sync() -> None:
    """With item/tolist/__bool__/__float__/__int__/... raising, every op still runs (TP=2) and is right."""
    cases = [CASES[1], CASES[2], CASES[3], CASES[6]]
    with _NoHostSync(), pytest.raises(AssertionError, match="host sync"):
        bool(torch.ones(1))  # the guard itself works
    per_rank = run_distributed(_no_sync_worker, 2, args=(cases,))
    for i, case in enumerate(cases):
        check_case(case, 2, [r[i] for r in per_rank])


def _megatron_worker(case: Case) -> tuple:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full_flat, labels_flat = make_inputs(case, tp)
    full, labels = arrange(case, full_flat), arrange(case, labels_flat)
    shard = local_shard(case, full, rank, tp)
    return {"stats": tuple(vocab_parallel_token_stats(shard, labels, group, case.vocab_size(tp)))}


def test_megatron_tensor_parallel_group() -> None:
    """Megatron's own TP group (TP=2 x DP=2, [s,b,v] logits, bf16, padded vocabulary)."""
    pytest.importorskip("megatron.core")
    case = CASES[2]
    per_rank = run_distributed(_megatron_worker, layout=Layout(tp=2, dp=2), args=(case,))
    check_case(case, 2, per_rank)
