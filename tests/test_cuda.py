"""On a CUDA device (``make gpu-check``; marker ``cuda``, skipped without one): the token statistics, the metrics
and the fused loss give on the GPU what they give on CPU and in float64.

* the ops test cases (``kit.ops_cases``) through the torch loop (chunks of 1, 7 and the default) and the Triton
  kernel against the float64 reference;
* the kernel check of ``twinkle-megatron kernel-check`` (``ops/kernel_check.py``): no problem found on bf16
  logits with padding, ties, NaN/inf rows and odd labels, its float64 reference equal to the kit's;
* Accuracy + TokenStatsMetric in a MetricCollection on CUDA, with either path, against the same on CPU;
* the fused loss against megatron-core's ``vocab_parallel_cross_entropy`` (loss, gradient, statistics; fp32, bf16);
* every launch configuration of the kernel gives the default's output.

``TWINKLE_MEGATRON_CUDA_TESTS_ON_CPU=1`` (with ``TRITON_INTERPRET=1``) runs them on CPU at small sizes, the
kernel interpreted: a dry run of the code, not a check of a GPU.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from kit import ops_cases as cases
from kit.references import full_vocab_stats

from twinkle_megatron import Accuracy, MetricCollection, TokenStatsMetric
from twinkle_megatron.ops import vocab_parallel_argmax, vocab_parallel_token_stats
from twinkle_megatron.ops.kernel_check import check_kernel, compare, float64_token_stats, special_logits
from twinkle_megatron.ops.kernel_select import ENV_KERNEL

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore")]
ON_GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def device() -> torch.device:
    pytest.importorskip("triton", reason="the kernel needs Triton")
    return torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_ops_cases_equal_float64(device, kernel):
    chunks = (1, 7, None) if kernel == "torch" else (None,)
    for case in cases.CASES:
        if kernel == "triton" and case.dtype == torch.float64:
            continue  # the kernel takes bf16/fp16/fp32
        full_flat, labels_flat = cases.make_inputs(case, 1)
        full, labels = cases.arrange(case, full_flat), cases.arrange(case, labels_flat)
        shard, labels = cases.local_shard(case, full, 0, 1).to(device), labels.to(device)
        vocab = case.vocab_size(1)
        results = {f"chunk={chunk}": tuple(t.cpu() for t in vocab_parallel_token_stats(
            shard, labels, vocab_size=vocab, chunk_size=chunk, kernel=kernel)) for chunk in chunks}
        results["argmax op"] = (vocab_parallel_argmax(shard, vocab_size=vocab, kernel=kernel).cpu(), None, None)
        cases.check_case(case, 1, [results])


def test_kernel_check_finds_no_problem(device):
    tokens, vocabs = (8192, [32768, 131072]) if ON_GPU else (16, [300])
    check = check_kernel(device, tokens, vocabs, repeats=2)
    assert check.problems == []
    assert len(check.speedups) == len(vocabs) and all(speedup > 0 for speedup in check.speedups)
    # Its float64 reference is the test kit's.
    x, labels, vocab_size = special_logits(256, vocabs[0], device)
    assert compare("check's float64 vs kit's", float64_token_stats(x, labels, vocab_size),
                   full_vocab_stats(x, labels, vocab_size), 1e-12) == []


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_metrics_on_cuda_equal_cpu(device, kernel, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 64, 1000, generator=generator) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 990, (4, 64), generator=generator)
    labels[0, :5] = -100
    mask = torch.rand(4, 64, generator=generator) < 0.9

    def run(where: torch.device) -> dict:
        collection = MetricCollection([Accuracy(vocab_size=990), TokenStatsMetric(vocab_size=990)])
        for rows in (slice(0, 2), slice(2, 4)):  # two accumulate calls
            collection.accumulate({"labels": labels[rows].to(where), "completion_mask": mask[rows].to(where)},
                                  {"logits": logits[rows].to(where)})
        return collection.calculate()

    monkeypatch.setenv(ENV_KERNEL, "torch")
    reference = run(torch.device("cpu"))
    monkeypatch.setenv(ENV_KERNEL, kernel)
    assert run(device) == pytest.approx(reference, rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def single_rank_group(device):
    """One rank (NCCL on a GPU, gloo on CPU) with megatron-core's parallel_state at TP = PP = 1."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as directory:
        dist.init_process_group("nccl" if ON_GPU else "gloo", store=dist.FileStore(os.path.join(directory, "store"),
                                                                                    1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield parallel_state.get_tensor_model_parallel_group()
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5)], ids=["fp32", "bf16"])
def test_fused_loss_equals_megatron_cross_entropy(device, single_rank_group, dtype, tolerance):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats

    tokens, vocab = (4096, 32768) if ON_GPU else (64, 512)
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(tokens // 2, 2, vocab, generator=generator) * 3).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab - 37, (tokens // 2, 2), generator=generator).to(device)
    labels[0, 0] = -100
    grad = torch.rand(tokens // 2, 2, generator=generator).to(device)
    theirs_in = logits.clone().requires_grad_()
    theirs = vocab_parallel_cross_entropy(theirs_in * 1, labels)
    theirs.backward(grad)
    ours_in = logits.clone().requires_grad_()
    loss, stats = vocab_parallel_cross_entropy_with_stats(ours_in * 1, labels, vocab_size=vocab - 37)
    loss.backward(grad)
    assert float(((loss - theirs).abs() / theirs.abs()).max()) <= tolerance
    difference = (ours_in.grad.float() - theirs_in.grad.float()).norm() / theirs_in.grad.float().norm()
    assert float(difference) <= tolerance
    reference = vocab_parallel_token_stats(logits, labels, vocab_size=vocab - 37, kernel="torch")
    assert compare("fused statistics vs vocab_parallel_token_stats", stats, reference, 1e-5) == []


def test_every_launch_configuration_gives_the_default_output(device):
    from twinkle_megatron.ops.triton_token_stats import launch_config, triton_local_pass

    sweep = [(1024, 4, 2), (2048, 8, 1), (2048, 8, 2), (2048, 8, 3), (4096, 8, 2), (4096, 16, 2), (8192, 16, 2)]
    tokens, vocab = (8192, 65536) if ON_GPU else (4, 256)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, vocab, generator=generator, device=device).mul_(4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=device)

    def run(config: tuple) -> tuple:
        sums = torch.zeros(3, tokens, device=device)
        return (*triton_local_pass(x, vocab, labels, sums, True, *config), sums)

    default = run(launch_config(vocab, 2))
    for config in sweep:
        got = run(config)
        assert torch.equal(got[0], default[0]) and torch.equal(got[1], default[1]), config
        assert torch.allclose(got[2][:2], default[2][:2], rtol=1e-5, atol=0), config
        assert torch.equal(got[2][2], default[2][2]), config
