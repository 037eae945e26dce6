"""The fused loss op against megatron-core's own ``vocab_parallel_cross_entropy`` and our statistics op.

Every worker builds the same full logits from a seed and takes its TP shard; the loss and the gradient of
the logits must equal Megatron's (fp32: relative 1e-6 per token for the loss, 1e-6 of the norm for the
gradient; bf16 logits: the same tolerances, both sides computing in fp32 from the same bf16 values), the
statistics must equal ``vocab_parallel_token_stats`` (1e-5), with a padded vocabulary, labels outside the
vocabulary and ``-100``, in exactly two collectives (Megatron's loss alone takes three) and no host sync.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from twinkle_megatron.ops import vocab_parallel_token_stats
from twinkle_megatron.ops.fused_cross_entropy import vocab_parallel_cross_entropy_with_stats
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, forbid_host_sync

SEQ, BATCH = 7, 3


def full_inputs(vocab: int, dtype: torch.dtype, seed: int = 0, scale: float = 4.0):
    generator = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(SEQ, BATCH, vocab, generator=generator, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, (SEQ, BATCH), generator=generator)
    labels[0, 0] = -100  # ignored
    labels[1, 1] = vocab - 1  # the last (padding, when padded) column
    grad = torch.rand(SEQ, BATCH, generator=generator)
    return logits, labels, grad


def _compare(vocab: int, true_vocab: int, dtype: torch.dtype, chunk_size) -> dict:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    logits, labels, grad = full_inputs(vocab, dtype)
    shard = logits.chunk(tp, -1)[rank].contiguous()

    theirs_in = shard.clone().requires_grad_()
    theirs = vocab_parallel_cross_entropy(theirs_in, labels)
    theirs.backward(grad)

    ours_in = shard.clone().requires_grad_()
    with count_collectives() as collectives:
        with forbid_host_sync():
            loss, stats = vocab_parallel_cross_entropy_with_stats(ours_in.clone(), labels, group, true_vocab,
                                                                  chunk_size=chunk_size)
    loss.backward(grad)
    reference = vocab_parallel_token_stats(shard, labels, group, true_vocab)
    return {"loss": (loss.detach(), theirs.detach()), "grad": (ours_in.grad, theirs_in.grad),
            "stats": (stats, reference), "collectives": dict(collectives)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("true_vocab", [None, 37], ids=["unpadded", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_megatron_loss_gradient_and_our_statistics(tp, true_vocab, dtype):
    results = run_distributed(_compare, layout=Layout(tp=tp), args=(48, true_vocab, dtype, 2), timeout=120)
    for rank, result in enumerate(results):
        (loss, megatron_loss), (grad, megatron_grad) = result["loss"], result["grad"]
        torch.testing.assert_close(loss, megatron_loss, rtol=1e-6, atol=0)
        assert _rel(grad, megatron_grad) <= 1e-6, f"rank {rank}: gradient off by {_rel(grad, megatron_grad):.2e}"
        ours, reference = result["stats"]
        assert torch.equal(ours.argmax, reference.argmax)
        torch.testing.assert_close(ours.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(ours.entropy, reference.entropy, rtol=1e-5, atol=1e-5)
        assert result["collectives"] == ({"all_reduce": 2} if tp > 1 else {})
        assert torch.equal(result["loss"][0], results[0]["loss"][0]), "every TP rank gets the same loss"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ranks_holding_only_padding_columns(dtype):
    """TP4 over 48 columns, 20 tokens: ranks 2 and 3 hold only padding, which Megatron's loss still covers."""
    results = run_distributed(_compare, layout=Layout(tp=4), args=(48, 20, dtype, 2), timeout=120)
    for rank, result in enumerate(results):
        (loss, megatron_loss), (grad, megatron_grad) = result["loss"], result["grad"]
        torch.testing.assert_close(loss, megatron_loss, rtol=1e-6, atol=0)
        assert _rel(grad, megatron_grad) <= 1e-6, f"rank {rank}: gradient off by {_rel(grad, megatron_grad):.2e}"
        ours, reference = result["stats"]
        assert torch.equal(ours.argmax, reference.argmax) and bool((ours.argmax < 20).all())
        torch.testing.assert_close(ours.logprobs, reference.logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(ours.entropy, reference.entropy, rtol=1e-5, atol=1e-5)
        assert result["collectives"] == {"all_reduce": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_microbatch_without_tokens(dtype):
    logits = torch.randn(0, 3, 16, dtype=dtype, requires_grad=True)
    loss, stats = vocab_parallel_cross_entropy_with_stats(logits * 1, torch.zeros(0, 3, dtype=torch.long),
                                                          vocab_size=10)
    loss.sum().backward()
    assert loss.shape == stats.argmax.shape == stats.entropy.shape == (0, 3)
    assert logits.grad.shape == logits.shape and logits.grad.dtype == dtype


def test_fp32_logits_are_overwritten_like_megatrons_and_memory_is_the_logits():
    logits, labels, _ = full_inputs(16, torch.float32)
    work = logits.clone()
    loss, _ = vocab_parallel_cross_entropy_with_stats(work, labels)
    assert not torch.equal(work, logits), "the exponentials are saved in the logits' own buffer"
    torch.testing.assert_close(work, torch.exp(logits - logits.amax(-1, keepdim=True)))


def test_layouts_and_bad_inputs():
    logits, labels, grad = full_inputs(16, torch.float32)
    sbv = logits.clone().requires_grad_()
    loss, _ = vocab_parallel_cross_entropy_with_stats(sbv.clone(), labels)
    loss.backward(grad)
    bsv = logits.transpose(0, 1).contiguous().requires_grad_()  # [b, s, v] seen as [s, b, v]
    loss_t, _ = vocab_parallel_cross_entropy_with_stats(bsv.clone().transpose(0, 1), labels)
    loss_t.backward(grad)
    torch.testing.assert_close(loss_t, loss)
    torch.testing.assert_close(bsv.grad.transpose(0, 1), sbv.grad)
    with pytest.raises(ValueError, match=r"labels has shape \(7, 1\) but logits has shape \(7, 3, 16\)"):
        vocab_parallel_cross_entropy_with_stats(logits.clone(), labels[:, :1])
    with pytest.raises(TypeError, match="floating-point"):
        vocab_parallel_cross_entropy_with_stats(logits.long(), labels)
    with pytest.raises(TypeError, match="integer"):
        vocab_parallel_cross_entropy_with_stats(logits.clone(), labels.float())
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_cross_entropy_with_stats(logits.clone(), labels, vocab_size=17)


def test_one_collective_pair_on_world_groups():
    def worker():
        logits, labels, _ = full_inputs(32, torch.float32)
        shard = logits.chunk(2, -1)[dist.get_rank()].contiguous()
        with count_collectives() as counted:
            vocab_parallel_cross_entropy_with_stats(shard, labels, dist.group.WORLD, 30)
        return dict(counted)

    assert run_distributed(worker, 2) == [{"all_reduce": 2}] * 2
