"""Vocab-parallel token statistics (``twinkle_megatron.ops``) against a float64 full-vocabulary reference.

The input families, the reference and the check are the kit's (``kit.ops_cases``,
``kit.references``): every worker builds the same full logits from a seed, takes
its own vocabulary shard and returns its results, which the parent compares bit
for bit across ranks and with ``argmax`` / ``log_softmax`` / ``-(p log p).sum()``
computed in float64 from the same values. Tolerance for log-probs and entropy:
``|ours - ref| <= 1e-5 + 1e-5·|ref|`` (absolute 1e-5 plus relative 1e-5,
``torch.testing`` style); argmax exact. Multi-rank cases fork gloo workers
(``twinkle_megatron.testing.distributed``); collectives are counted and host syncs forbidden by the
kit's dispatch-level guard (``twinkle_megatron.testing.guards``).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from kit.ops_cases import (
    CASES,
    CHUNKS,
    Case,
    assert_close,
    assert_same_on_ranks,
    case_inputs,
    check_case,
    local_shard,
    make_inputs,
    tokens,
)
from kit.references import IGNORE_INDEX, full_vocab_stats

from twinkle_megatron.ops import (
    vocab_parallel_argmax,
    vocab_parallel_argmax_stats,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
)
from twinkle_megatron.ops.shard import decode_key, encode_key
from twinkle_megatron.ops.torch_local_pass import first_max_column, torch_local_pass
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import HostSyncError, count_collectives, forbid_host_sync


def op_results(shard: torch.Tensor, labels: torch.Tensor, vocab_size, group=None, chunks=(None,),
               no_host_sync: bool = False) -> dict:
    """Every op on one shard, as ``(argmax, logprobs, entropy)`` triples (None where an op has no such output):
    the statistics for each chunk size, the statistics without labels, the argmax, log-prob and entropy ops
    (with ``no_host_sync``, inside ``forbid_host_sync``); ``unchanged``: whether the shard was left intact."""
    before = shard.clone()
    with forbid_host_sync() if no_host_sync else contextlib.nullcontext():
        results = {f"stats chunk={chunk}": tuple(vocab_parallel_token_stats(shard, labels, group, vocab_size,
                                                                             chunk_size=chunk)) for chunk in chunks}
        without_labels = vocab_parallel_token_stats(shard, None, group, vocab_size, chunk_size=3)
        results["stats no labels"] = tuple(without_labels)
        results["argmax op"] = (vocab_parallel_argmax(shard, group, vocab_size), None, None)
        results["logprobs op"] = (None, vocab_parallel_logprobs(shard, labels, group, vocab_size), None)
        results["entropy op"] = (None, None, vocab_parallel_entropy(shard, group, vocab_size))
    assert without_labels.logprobs is None
    results["unchanged"] = torch.equal(shard.view(torch.uint8), before.view(torch.uint8))
    return results


def _cases_worker(cases: list) -> list:
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for case in cases:
        full, labels = case_inputs(case, tp)
        out.append(op_results(local_shard(case, full, rank, tp), labels, case.vocab_size(tp), group, CHUNKS))
    return out


# ----------------------------------------------------------------------------- single process (group=None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_whole_vocab_local(case: Case) -> None:
    """group=None: the whole vocabulary is local (TP = 1); every layout, dtype, chunk size and edge case."""
    full, labels = case_inputs(case, 1)
    check_case(case, 1, [op_results(local_shard(case, full, 0, 1), labels, case.vocab_size(1), chunks=CHUNKS)])


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
        ref = full_vocab_stats(full, labels, vocab)
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
    ref = full_vocab_stats(x, labels, 5)
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
        ref = full_vocab_stats(x, labels, 32768)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_local_pass_keeping_the_exponentials(dtype: torch.dtype) -> None:
    """The fused loss's local pass (exponentials kept: for fp32 in the rows themselves), in chunks of 3 tokens:
    the real columns' maximum and first column are the statistics' pass's, read before the rows are
    overwritten; the reference is the maximum over every column, padding included; the exponentials, S0, S1
    and the padding's share are relative to it; the label's logit is read wherever the label's column is local."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 4, (11, 300), generator=gen).to(dtype)  # many ties
    n_real = 290
    x[0, 295] = 9.0  # a padding column above every real one
    x[1, 289] = 8.0  # the last real column
    labels = torch.tensor([295, 289, -5, 0, 300, 17, 299, 290, 3, 4, 5])
    plain_stats = torch.zeros(3, 11)
    plain = torch_local_pass(x, n_real, labels, plain_stats, torch.float32, 3, True)
    rows = x.clone()
    exps = rows if dtype == torch.float32 else torch.empty(rows.shape)
    stats = torch.zeros(4, 11)
    kept = torch_local_pass(rows, n_real, labels, stats, torch.float32, 3, True, exps=exps)

    real = x[:, :n_real].double()
    assert torch.equal(kept.max, plain.max) and torch.equal(kept.max.double(), real.amax(-1))
    assert torch.equal(kept.column, plain.column) and torch.equal(kept.column, real.argmax(-1))
    reference = x.double().amax(-1, keepdim=True)
    assert torch.equal(kept.reference.double(), reference[:, 0]) and kept.reference[0] == 9.0
    e = (x.double() - reference).exp()
    torch.testing.assert_close(exps.double(), e, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats[0].double(), e[:, :n_real].sum(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(stats[1].double(), (e * (x.double() - reference))[:, :n_real].sum(-1), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(stats[3].double(), e[:, n_real:].sum(-1), rtol=1e-6, atol=0)
    owned = (labels >= 0) & (labels < 300)
    label_logit = torch.where(owned, x.float().gather(1, labels.clamp(0, 299)[:, None])[:, 0], torch.tensor(0.0))
    assert torch.equal(stats[2], label_logit)
    assert torch.equal(plain_stats[2], torch.where(labels < n_real, label_logit, torch.tensor(0.0)))


def test_nonfinite_token_is_isolated() -> None:
    """A NaN in one token does not touch its neighbours; NaN only in padding is ignored."""
    x = torch.randn(4, 300)
    x[1, 7] = float("nan")
    x[2, 299] = float("nan")  # padding column when vocab_size = 299
    labels = torch.tensor([0, 1, 2, IGNORE_INDEX])
    st = vocab_parallel_token_stats(x, labels, vocab_size=299)
    assert torch.isnan(st.entropy).tolist() == [False, True, False, False]
    assert torch.isnan(st.logprobs).tolist() == [False, True, False, False]
    assert st.argmax[1].item() == 7 and st.logprobs[3].item() == 0.0
    ref = full_vocab_stats(x, labels, 299)
    assert_close("entropy", st.entropy, ref.entropy)


def test_one_dimensional_logits() -> None:
    """A single token without leading dims: scalar results."""
    x = torch.tensor([0.5, 2.0, -1.0, 2.0])
    st = vocab_parallel_token_stats(x, torch.tensor(2), chunk_size=3)
    ref = full_vocab_stats(x, torch.tensor(2), 4)
    assert st.argmax.shape == () and st.argmax.item() == 1
    assert_close("entropy", st.entropy, ref.entropy)
    assert_close("logprobs", st.logprobs, ref.logprobs)


def test_empty_returns_empty() -> None:
    for shape in [(0, 32), (2, 0, 32), (0, 0, 32)]:
        st = vocab_parallel_token_stats(torch.zeros(shape), torch.zeros(shape[:-1], dtype=torch.long))
        assert st.argmax.shape == st.logprobs.shape == st.entropy.shape == shape[:-1]
        assert st.argmax.dtype == torch.int64 and st.entropy.dtype == torch.float32


# ----------------------------------------------------------------------------- collectives, groups, syncs


def _collectives_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Create every group before counting (new_group itself talks to the store on all ranks).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    tp_group, own = pairs[rank // 2], singles[rank]
    case = Case("pair", "bsv", 192, pad=11, seed=10 + rank // 2)  # each TP pair has its own data
    full, labels = case_inputs(case, 2)
    shard = local_shard(case, full, dist.get_rank(tp_group), 2)
    vocab = case.vocab_size(2)
    # A group of one rank, and no group: the whole (unpadded) vocabulary is local, no collective.
    whole = full[..., :vocab].contiguous()
    calls = {f"stats chunk={chunk}": lambda c=chunk: vocab_parallel_token_stats(shard, labels, tp_group, vocab,
                                                                                chunk_size=c)
             for chunk in (1, 4, 21, None)}
    calls.update({
        "stats no labels": lambda: vocab_parallel_token_stats(shard, None, tp_group, vocab),
        "argmax op": lambda: vocab_parallel_argmax(shard, tp_group, vocab),
        "logprobs op": lambda: vocab_parallel_logprobs(shard, labels, tp_group, vocab),
        "entropy op": lambda: vocab_parallel_entropy(shard, tp_group, vocab),
        "empty": lambda: vocab_parallel_token_stats(shard[:0], labels[:0], tp_group, vocab),
        "group of one": lambda: vocab_parallel_token_stats(whole, labels, own, chunk_size=5),
        "group None": lambda: vocab_parallel_token_stats(whole, labels),
    })
    counts, results = {}, {}
    for key, call in calls.items():
        with count_collectives() as counted:
            results[key] = call()
        counts[key] = dict(counted)
    checked = {key: tuple(results[key]) for key in calls if key.startswith("stats")}
    checked.update({"argmax op": (results["argmax op"], None, None),
                    "logprobs op": (None, results["logprobs op"], None),
                    "entropy op": (None, None, results["entropy op"])})
    return {"counts": counts, "results": checked, "group of one": tuple(results["group of one"]), "pair": rank // 2}


def test_collective_count_and_subgroups() -> None:
    """Exactly 2 all-reduces per stats call (1 for argmax) whatever the chunking; none for T=0, one rank
    or no group. Two TP=2 groups inside a world of 4 with different data, each matching its reference."""
    per_rank = run_distributed(_collectives_worker, 4)
    for rank, r in enumerate(per_rank):
        for key, counts in r["counts"].items():
            n = 1 if key == "argmax op" else 0 if key in ("empty", "group of one", "group None") else 2
            assert counts == ({"all_reduce": n} if n else {}), f"rank {rank} {key}: {counts}"
    for pair in (0, 1):
        ranks = [r for r in per_rank if r["pair"] == pair]
        case = Case("pair", "bsv", 192, pad=11, seed=10 + pair)
        check_case(case, 2, [r["results"] for r in ranks])
        full, labels = case_inputs(case, 2)
        ref = full_vocab_stats(full, labels, case.vocab_size(2))
        for r in ranks:
            argmax, lp, ent = r["group of one"]
            assert torch.equal(argmax, ref.argmax)
            assert_close("group of one logprobs", lp, ref.logprobs)
            assert_close("group of one entropy", ent, ref.entropy)


# ----------------------------------------------------------------------------- the argmax-only pass


def argmax_stats_and_full_pass(shard: torch.Tensor, labels: torch.Tensor, vocab_size, group=None) -> dict:
    """The argmax-only statistics (their collectives counted, host syncs forbidden) next to the full pass's."""
    with forbid_host_sync(), count_collectives() as counted:
        light = vocab_parallel_argmax_stats(shard, group, vocab_size)
    full = vocab_parallel_token_stats(shard, labels, group, vocab_size)
    return {"light": tuple(light), "full": tuple(full), "collectives": dict(counted)}


def check_argmax_stats(name: str, result: dict, n_tokens: int, vocab: int, tp: int) -> None:
    """``finite`` is the full pass's ``isfinite(entropy)`` (NaN, +inf, -inf on any shard; padding never
    read); the argmax is the full pass's wherever the logits are finite; one all-reduce on several ranks."""
    argmax, finite, vocab_size = result["light"]
    full_argmax, _, entropy = result["full"]
    assert vocab_size == vocab, name
    assert finite.dtype == torch.bool and torch.equal(finite, torch.isfinite(entropy)), name
    assert torch.equal(argmax[finite], full_argmax[finite]), name
    assert result["collectives"] == ({"all_reduce": 1} if tp > 1 and n_tokens else {}), name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_argmax_stats_say_what_the_full_pass_says_whole_vocab(case: Case) -> None:
    full, labels = case_inputs(case, 1)
    result = argmax_stats_and_full_pass(local_shard(case, full, 0, 1), labels, case.vocab_size(1))
    check_argmax_stats(case.name, result, tokens(case), case.vocab(1), 1)
    if tokens(case):
        assert not bool(result["light"][1].all()), "the cases hold non-finite tokens"


def _argmax_stats_worker(cases: list) -> list:
    tp, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for case in cases:
        full, labels = case_inputs(case, tp)
        out.append(argmax_stats_and_full_pass(local_shard(case, full, rank, tp), labels, case.vocab_size(tp),
                                              dist.group.WORLD))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_argmax_stats_under_tensor_parallelism_in_one_all_reduce(world: int) -> None:
    """NaN in the last shard, +inf in shard 0, -inf in shard 1 (``kit.ops_cases``): every rank says the token is
    not finite, as the full pass does, after one all-reduce of the keys."""
    per_rank = run_distributed(_argmax_stats_worker, world, args=(CASES,))
    for i, case in enumerate(CASES):
        for rank, r in enumerate(per_rank):
            check_argmax_stats(f"{case.name} tp={world} rank {rank}", r[i], tokens(case), case.vocab(world), world)
        assert_same_on_ranks(f"{case.name} argmax stats", [r[i]["light"][:2] for r in per_rank])


def _no_sync_worker(cases: list) -> list:
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(), dist.get_rank()
    prepared = []
    for case in cases:
        full, labels = case_inputs(case, tp)
        prepared.append((local_shard(case, full, rank, tp), labels, case.vocab_size(tp)))
    return [op_results(shard, labels, vocab, group, chunks=(4,), no_host_sync=True)
            for shard, labels, vocab in prepared]


def test_no_host_sync() -> None:
    """With every host sync raising (``twinkle_megatron.testing.guards``), every op still runs (TP=2) and is right."""
    cases = [CASES[1], CASES[2], CASES[3], CASES[6]]
    with pytest.raises(HostSyncError, match="host sync"), forbid_host_sync():
        bool(torch.ones(1))  # the guard itself works
    per_rank = run_distributed(_no_sync_worker, 2, args=(cases,))
    for i, case in enumerate(cases):
        check_case(case, 2, [r[i] for r in per_rank])


def _megatron_worker(case: Case) -> dict:
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full, labels = case_inputs(case, tp)
    return op_results(local_shard(case, full, rank, tp), labels, case.vocab_size(tp),
                      ps.get_tensor_model_parallel_group())


def test_megatron_tensor_parallel_group() -> None:
    """Megatron's own TP group (TP=2 x DP=2, [s,b,v] logits, bf16, padded vocabulary)."""
    pytest.importorskip("megatron.core")
    case = CASES[2]
    per_rank = run_distributed(_megatron_worker, layout=Layout(tp=2, dp=2), args=(case,))
    check_case(case, 2, per_rank)
