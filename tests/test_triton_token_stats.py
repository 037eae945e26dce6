"""The fused Triton local pass (``ops/triton_token_stats.py``) against float64 and the torch path.

Without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
which ``tests/conftest.py`` sets before anything imports Triton) on CPU tensors: the same kernel
source, executed block by block with NumPy, so the masking, the online
rescaling, the argmax order and the NaN/inf handling are checked here; speed
and the compiled code's rounding are not (``make gpu-check`` runs this file on
a GPU, where the kernel is compiled). A separate test compiles the kernel for
sm_80 and sm_90 with Triton's real compiler and ptxas, which needs no GPU.

The cases are those of ``tests/test_ops.py`` (``kit.ops_cases``: same inputs, same float64
reference, same tolerance) plus rows built against the kernel's structure:
ties and NaNs in different column blocks, a maximum that moves in every block,
rows that are all ``-inf``. Blocks are shrunk (``_BLOCK_BYTES``) so that rows of
a hundred columns span several blocks; the interpreter runs one program per
row, so the inputs stay small (CI has two cores).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from kit.ops_cases import CASES, Case, assert_close, assert_same_on_ranks, case_inputs, check_case, local_shard
from kit.references import IGNORE_INDEX, full_vocab_stats

from twinkle_megatron.ops import (
    vocab_parallel_argmax,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
)
from twinkle_megatron.ops.kernel_select import ENV_KERNEL, choose_kernel
from twinkle_megatron.ops.torch_local_pass import torch_local_pass
from twinkle_megatron.testing.distributed import run_distributed
from twinkle_megatron.testing.guards import count_collectives

triton = pytest.importorskip("triton", reason="Triton is not installed (`make kernel-test` installs the pinned one)")

# Compiled on a GPU unless told to interpret; interpreted on CPU.
ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")


def _kernel_module():
    module = importlib.import_module("twinkle_megatron.ops.triton_token_stats")
    if module.is_interpreted() != (not ON_CUDA):
        pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it on CPU): "
                    "the kernel cannot run in the interpreter in this process", pytrace=False)
    return module


tts = _kernel_module()
KERNEL_CASES = [c for c in CASES if c.dtype != torch.float64]


@pytest.fixture
def small_blocks(monkeypatch):
    """512-byte blocks (128 fp32 or 256 bf16/fp16 columns): the wider ops cases span several blocks."""
    monkeypatch.setattr(tts, "_BLOCK_BYTES", 512)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """The smallest blocks (16 columns): ties and NaNs land in different blocks of 100-column rows."""
    monkeypatch.setattr(tts, "_BLOCK_BYTES", 1)


def on_device(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


def to_cpu(triple):
    return tuple(None if t is None else t.cpu() for t in triple)


def assert_same_as_torch_path(name: str, ours: tuple, torch_path: tuple, tol: float = 1e-5) -> None:
    """Argmax equal; log-prob and entropy within ``tol`` of the torch path, NaN exactly where it has NaN."""
    for what, a, b in zip(("argmax", "logprobs", "entropy"), ours, torch_path):
        if a is None or b is None:
            assert a is None and b is None, f"{name} {what}"
            continue
        if what == "argmax":
            assert torch.equal(a, b), f"{name}: argmax {a.tolist()} != torch path {b.tolist()}"
        else:
            assert_close(f"{name} {what} vs torch path", a, b.double(), tol, tol)


# ----------------------------------------------------------------------------- the ops cases, one rank


def _op_results(shard: torch.Tensor, labels: torch.Tensor, vocab, group, kernel: str, every_op: bool) -> dict:
    """The full statistics and the argmax-only pass; with ``every_op`` the log-prob and entropy ops too
    (the same kernel call as the full statistics, so one case is enough for them)."""
    results = {
        "stats": tuple(vocab_parallel_token_stats(shard, labels, group, vocab, kernel=kernel)),
        "argmax op": (vocab_parallel_argmax(shard, group, vocab, kernel=kernel), None, None),
    }
    if every_op:
        results["stats no labels"] = tuple(vocab_parallel_token_stats(shard, None, group, vocab, kernel=kernel))
        results["logprobs op"] = (None, vocab_parallel_logprobs(shard, labels, group, vocab, kernel=kernel), None)
        results["entropy op"] = (None, None, vocab_parallel_entropy(shard, group, vocab, kernel=kernel))
    return results


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_ops_cases_whole_vocab(case: Case, small_blocks) -> None:
    """group=None: every layout, dtype, padding and special token of the ops tests, by the kernel."""
    full, labels = case_inputs(case, 1)
    shard = on_device(local_shard(case, full, 0, 1))
    labels_dev = on_device(labels)
    before = shard.clone()
    vocab = case.vocab_size(1)
    every_op = case is KERNEL_CASES[1]
    kernel = {k: to_cpu(v) for k, v in _op_results(shard, labels_dev, vocab, None, "triton", every_op).items()}
    kernel["unchanged"] = torch.equal(shard.view(torch.uint8), before.view(torch.uint8))
    check_case(case, 1, [kernel])
    torch_path = {k: to_cpu(v) for k, v in _op_results(shard, labels_dev, vocab, None, "torch", every_op).items()}
    for key in torch_path:
        assert_same_as_torch_path(f"{case.name} {key}", kernel[key], torch_path[key])


def test_float64_is_refused_by_the_kernel_and_auto_uses_torch() -> None:
    x = torch.randn(3, 40, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        vocab_parallel_token_stats(x, kernel="triton")
    assert choose_kernel("auto", x) == "torch"
    st = vocab_parallel_token_stats(x, kernel="auto")
    assert st.entropy.dtype == torch.float64


# ----------------------------------------------------------------------------- rows against the kernel's blocks


def adversarial_rows(n_cols: int = 100) -> tuple[torch.Tensor, list[str]]:
    """Rows whose answer depends on getting the block structure right (16-column blocks)."""
    rows, names = [], []

    def row(name: str) -> torch.Tensor:
        x = torch.linspace(-3.0, 2.0, n_cols)[torch.randperm(n_cols, generator=gen)]
        rows.append(x)
        names.append(name)
        return x

    gen = torch.Generator().manual_seed(11)
    row("tie: block 1 lane 4 beats block 2 lane 5")[[20, 37]] = 9.0
    row("tie: block 0 lane 13 beats block 1 lane 2")[[13, 18]] = 9.0
    row("tie in every block")[list(range(3, n_cols, 16))] = 9.0
    row("two NaNs, later block first in lane")[[70, 33]] = float("nan")
    x = row("NaN beats an earlier +inf")
    x[5], x[33] = float("inf"), float("nan")
    row("two +inf")[[80, 40]] = float("inf")
    row("one -inf")[50] = float("-inf")
    rows.append(torch.full((n_cols,), float("-inf")))
    names.append("all -inf")
    x = torch.full((n_cols,), float("-inf"))
    x[77] = 1.0
    rows.append(x)
    names.append("-inf but one")
    rows.append(torch.arange(n_cols, dtype=torch.float32) * 0.25)
    names.append("increasing: the maximum moves in every block")
    rows.append(-torch.arange(n_cols, dtype=torch.float32) * 0.25)
    names.append("decreasing")
    x = torch.full((n_cols,), -5.0)
    x[3], x[1] = -0.0, 0.0
    rows.append(x)
    names.append("-0.0 ties +0.0")
    rows.append(torch.where(torch.rand(n_cols, generator=gen) > 0.5, 1e4, -1e4))
    names.append("+-1e4")
    x = torch.zeros(n_cols)
    x[[2, 60]] = 1.5e38
    x[90] = -1.5e38
    rows.append(x)
    names.append("spread 3e38")
    x = torch.full((n_cols,), -1.5e38)
    x[90] = 1.5e38
    rows.append(x)
    names.append("a -1.5e38 plateau, then 1.5e38: the rescale of S1 must not overflow")
    row("maximum in the last, partial block")[n_cols - 1] = 9.0
    rows.append(torch.full((n_cols,), 1.5))
    names.append("all equal")
    return torch.stack(rows), names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_block_structure_edge_cases(dtype: torch.dtype, tiny_blocks) -> None:
    full, names = adversarial_rows()
    x = full.to(dtype)
    if dtype == torch.float16:  # 1e4 and 1.5e38 do not fit: keep what fp16 can hold
        x = torch.where(torch.isinf(x) & torch.isfinite(full), torch.full_like(x, 6e4).copysign(x), x)
    labels = torch.randint(0, x.shape[1], (x.shape[0],), generator=torch.Generator().manual_seed(3))
    labels[0], labels[1] = IGNORE_INDEX, x.shape[1] + 2
    got = to_cpu(vocab_parallel_token_stats(on_device(x), on_device(labels), kernel="triton"))
    ref = full_vocab_stats(x, labels, x.shape[1])
    assert torch.equal(got[0], ref.argmax), [
        (n, int(a), int(b)) for n, a, b in zip(names, got[0], ref.argmax) if a != b]
    assert_close("logprobs", got[1], ref.logprobs)
    assert_close("entropy", got[2], ref.entropy)
    torch_path = to_cpu(vocab_parallel_token_stats(on_device(x), on_device(labels), kernel="torch"))
    assert_same_as_torch_path(f"{dtype}", got, torch_path)


def test_local_outputs_match_the_torch_loop(tiny_blocks) -> None:
    """The kernel's own outputs: local max bit for bit, first column, label logit; S0, S1 vs float64."""
    x, names = adversarial_rows()
    n_real = 93  # the last 7 columns are padding, never read
    x[:, n_real:] = float("nan")
    labels = torch.tensor([(i * 37) % 110 - 5 for i in range(x.shape[0])])
    stats = torch.zeros(3, x.shape[0], device=DEVICE)
    local_max, local_col = tts.triton_local_pass(on_device(x), n_real, on_device(labels), stats, True)
    ref_stats = torch.zeros(3, x.shape[0])
    ref_max, ref_col, _ = torch_local_pass(x, n_real, labels, ref_stats, torch.float32, None, True)
    local_max, local_col, stats = local_max.cpu(), local_col.cpu(), stats.cpu()
    assert torch.equal(local_col, ref_col), [(n, int(a), int(b)) for n, a, b in zip(names, local_col, ref_col)
                                             if a != b]
    nan = torch.isnan(ref_max)
    assert torch.equal(torch.isnan(local_max), nan) and torch.equal(local_max[~nan], ref_max[~nan])
    torch.testing.assert_close(stats[2], ref_stats[2], rtol=0, atol=0, equal_nan=True)  # a NaN label logit too
    real = x[:, :n_real].double()
    finite = torch.isfinite(real).all(-1)
    d = real[finite] - real[finite].amax(-1, keepdim=True)
    assert_close("S0", stats[0][finite], d.exp().sum(-1))
    assert_close("S1", stats[1][finite], (d.exp() * d).sum(-1))
    # A row with a non-finite real column carries NaN sums into the epilogue.
    assert torch.isnan(stats[0][~finite]).all() and torch.isnan(stats[1][~finite]).all()


def test_argmax_only_pass(tiny_blocks) -> None:
    """need_sums=False (vocab_parallel_argmax): no stats buffer, same argmax."""
    x, _ = adversarial_rows()
    max_, col = tts.triton_local_pass(on_device(x), x.shape[1], None, None, False)
    assert torch.equal(col.cpu(), x.argmax(-1))
    assert torch.equal(vocab_parallel_argmax(on_device(x.bfloat16()), kernel="triton").cpu(),
                       x.bfloat16().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_realistic_rows_default_blocks(dtype: torch.dtype) -> None:
    """Default launch configuration (2 blocks of a 4096-column fp32 row), several logit scales."""
    gen = torch.Generator().manual_seed(5)
    for scale in (1.0, 30.0):
        x = (torch.randn(4, 4096, generator=gen) * scale + 50.0).to(dtype)
        labels = torch.randint(0, 4096, (4,), generator=gen)
        st = to_cpu(vocab_parallel_token_stats(on_device(x), on_device(labels), kernel="triton"))
        ref = full_vocab_stats(x, labels, 4096)
        assert torch.equal(st[0], ref.argmax)
        assert_close(f"scale {scale} entropy", st[2], ref.entropy)
        assert_close(f"scale {scale} logprobs", st[1], ref.logprobs)


def test_empty_input_launches_nothing() -> None:
    st = vocab_parallel_token_stats(torch.zeros(0, 7, 32, device=DEVICE), torch.zeros(0, 7, dtype=torch.long),
                                    kernel="triton")
    assert st.argmax.shape == st.logprobs.shape == st.entropy.shape == (0, 7)


def test_environment_variable_selects_the_kernel(monkeypatch) -> None:
    x = torch.randn(2, 64, device=DEVICE)
    monkeypatch.setenv(ENV_KERNEL, "triton")
    assert choose_kernel(None, x) == "triton"
    assert choose_kernel("torch", x) == "torch"  # the keyword wins
    ref = vocab_parallel_token_stats(x, torch.tensor([1, 2], device=DEVICE), kernel="torch")
    st = vocab_parallel_token_stats(x, torch.tensor([1, 2], device=DEVICE))  # the kernel, through the variable
    assert torch.equal(st.argmax, ref.argmax)
    assert_close("entropy", st.entropy.cpu(), ref.entropy.cpu().double())


# ----------------------------------------------------------------------------- tensor parallel (forked gloo ranks)


def _tp_worker(cases: list, kernels: tuple) -> dict:
    """Every case through the real collectives, ``kernels[rank]`` choosing this rank's local pass."""
    group = dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    kernel = kernels[rank]
    out = {"cases": [], "counts": {}}
    for case in cases:
        full, labels = case_inputs(case, tp)
        shard = local_shard(case, full, rank, tp)
        before = shard.clone()
        res = _op_results(shard, labels, case.vocab_size(tp), group, kernel, every_op=False)
        res["unchanged"] = torch.equal(shard.view(torch.uint8), before.view(torch.uint8))
        out["cases"].append(res)
    case = cases[0]
    full, labels = case_inputs(case, tp)
    shard = local_shard(case, full, rank, tp)
    with count_collectives() as counts:
        vocab_parallel_token_stats(shard, labels, group, case.vocab_size(tp), kernel=kernel)
    out["counts"]["stats"] = dict(counts)
    with count_collectives() as counts:
        vocab_parallel_argmax(shard, group, case.vocab_size(tp), kernel=kernel)
    out["counts"]["argmax"] = dict(counts)
    return out


@pytest.mark.skipif(ON_CUDA, reason="forked CPU ranks on gloo: the CPU (interpreter) run covers TP")
@pytest.mark.parametrize("kernels", [("triton", "triton"), ("triton", "torch")], ids=["both kernel", "mixed"])
def test_tensor_parallel_through_the_collectives(kernels: tuple, small_blocks) -> None:
    """TP=2 over gloo: every case (including a rank holding only padding) right and identical on both
    ranks, with the kernel on both ranks or on one; still exactly 2 collectives (argmax: 1)."""
    cases = KERNEL_CASES if kernels[0] == kernels[1] else KERNEL_CASES[1:4]  # mixed: the padded layouts
    per_rank = run_distributed(_tp_worker, 2, args=(cases, kernels), timeout=300)
    for i, case in enumerate(cases):
        check_case(case, 2, [r["cases"][i] for r in per_rank])
    for rank, r in enumerate(per_rank):
        assert r["counts"] == {"stats": {"all_reduce": 2}, "argmax": {"all_reduce": 1}}, (rank, r["counts"])
    for i, case in enumerate(cases):
        for key in per_rank[0]["cases"][i]:
            if key != "unchanged":
                assert_same_on_ranks(f"{case.name} {key}", [r["cases"][i][key] for r in per_rank])


# ----------------------------------------------------------------------------- the compiled kernel


def test_kernel_compiles_for_gpus_without_spills() -> None:
    """The real compiler and ptxas (no GPU needed, in a process without the interpreter): the default
    configurations for bf16 and fp32 build for sm_80 and sm_90 with 16-byte vector loads or cp.async
    copies and no local memory (no register spills)."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel has no ptxas")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_resources.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script), "--arch", "80", "90", "--dtype", "bf16", "fp32",
                          "--defaults-only", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {(r["arch"], r["dtype"], r["need_sums"]) for r in rows} == {
        (a, d, s) for a in (80, 90) for d in ("bf16", "fp32") for s in (True, False)}
    for r in rows:
        assert r["local"] == 0, r
        assert r["vector_loads"] + r["cp_async"] > 0, r
        assert r["registers"] <= 128, r  # at least two 256-thread programs per SM


# ----------------------------------------------------------------------------- CUDA only (make gpu-check)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device (make gpu-check)")
def test_no_host_sync_on_cuda() -> None:
    """The kernel path issues no synchronising CUDA call (torch's sync debug mode raises on one)."""
    x = torch.randn(64, 50000, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 50000, (64,), device="cuda")
    vocab_parallel_token_stats(x, labels, vocab_size=49999, kernel="triton")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = vocab_parallel_token_stats(x, labels, vocab_size=49999, kernel="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = full_vocab_stats(x.cpu(), labels.cpu(), 49999)
    assert torch.equal(st.argmax.cpu(), ref.argmax)
    assert_close("entropy", st.entropy.cpu(), ref.entropy)
    assert math.isfinite(st.logprobs.float().sum().item())
