"""A NaN in one sample: that sample is named, the healthy samples of its microbatch still count.

A real megatron-core GPT (kit.megatron_gpt) runs one forward-backward step of a global batch through
Megatron's schedule with ``instrument()`` (LossMetric per dataset, Accuracy, SampleLosses). One token id's
input embedding is NaN and one sample (row ``PLANTED``) is made of that token only, so every position of that
sample, and of no other, is NaN from the first layer on; its microbatch's ``[sum, count]`` loss report is NaN.

Under DP, PP with virtual stages and CP: SampleLosses names the planted sample first (non-finite, its counted
tokens), the LossMetric's ``loss`` and ``loss/<dataset>`` equal a float64 single-process reference over the
healthy samples only (its microbatch neighbour included), the non-finite counts equal the planted sample's
counted tokens, and Megatron's own loss reports and gradients are bitwise those of the same step without
``instrument()``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    gpt_forward_step,
    make_batch,
    reference_forward,
    run_forward_backward,
)

from twinkle_megatron import Accuracy, LossMetric
from twinkle_megatron.megatron import instrument
from twinkle_megatron.metric import SampleLosses
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
GLOBAL_BATCH, MICRO_BATCH, PLANTED = 8, 2, 5  # the planted sample shares its microbatch with row 4
POISON = SPEC.vocab_size - 1  # the token whose input embedding is NaN
DATASETS = ("even", "odd")


def _batch() -> dict:
    batch = make_batch(SPEC, global_batch_size=GLOBAL_BATCH, seed=3)
    batch["tokens"] = batch["tokens"] % POISON  # no healthy sample holds the poisoned token
    batch["tokens"][PLANTED] = POISON
    batch["sample_index"] = torch.arange(1000, 1000 + GLOBAL_BATCH)
    batch["dataset_id"] = torch.arange(GLOBAL_BATCH) % 2
    return batch


def _poisoned_model() -> list:
    """This rank's chunks with the NaN input embedding of ``POISON`` (in the TP shard that holds it)."""
    chunks = build_gpt_model(SPEC)
    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is None:
            continue
        words = embedding.word_embeddings
        if words.vocab_start_index <= POISON < words.vocab_end_index:
            with torch.no_grad():
                words.weight[POISON - words.vocab_start_index] = math.nan
    return chunks


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 bits of a tensor: NaNs compare too."""
    return tensor.detach().float().contiguous().view(torch.int32)


def _step(instrumented: bool) -> dict:
    chunks = _poisoned_model()
    samples = SampleLosses(top_k=GLOBAL_BATCH, dataset_names=DATASETS)  # every sample: all complete under CP
    metrics = instrument(chunks, [LossMetric(group_names=DATASETS), Accuracy(vocab_size=SPEC.vocab_size),
                                  samples]) if instrumented else None
    step = metrics.wrap(gpt_forward_step) if instrumented else gpt_forward_step
    reports = run_forward_backward(chunks, _batch(), micro_batch_size=MICRO_BATCH, forward_step_func=step)
    result = {"reports": [_bits(report["lm loss"]) for report in reports],
              "grads": [_bits(p.grad) for chunk in chunks for p in chunk.parameters() if p.grad is not None]}
    if instrumented:
        samples.end_step(1)
        result["metrics"] = metrics.calculate()
        result["top"] = samples.gather_top()
        metrics.detach()
    return result


def _run() -> dict:
    with cpu_cuda_shim():
        plain, observed = _step(False), _step(True)
    assert plain["grads"], "the step computed gradients"
    for name in ("reports", "grads"):
        assert len(plain[name]) == len(observed[name])
        assert all(torch.equal(a, b) for a, b in zip(plain[name], observed[name])), name
    return {"metrics": observed["metrics"], "top": observed["top"]}


@functools.cache
def _reference() -> dict:
    """World 1, float64 per-token losses of the whole batch: the healthy samples' pooled losses, the planted
    sample's counted tokens, each sample's loss."""

    def one_rank() -> dict:
        with cpu_cuda_shim():
            (model,) = _poisoned_model()
            batch = _batch()
            logits = reference_forward(model, batch).detach().double()
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC.vocab_size), batch["labels"].reshape(-1),
                                                   reduction="none").reshape(batch["labels"].shape)
        counted = batch["loss_mask"].bool()
        healthy = torch.arange(GLOBAL_BATCH) != PLANTED
        assert torch.isnan(losses[PLANTED]).all() and torch.isfinite(losses[healthy]).all()
        pooled = {"loss": float(losses[counted & healthy[:, None]].mean())}
        for index, name in enumerate(DATASETS):
            rows = healthy & (batch["dataset_id"] == index)
            pooled[f"loss/{name}"] = float(losses[counted & rows[:, None]].mean())
        per_sample = {1000 + row: float(losses[row][counted[row]].mean()) for row in range(GLOBAL_BATCH)}
        return {"pooled": pooled, "planted_tokens": int(counted[PLANTED].sum()), "per_sample": per_sample,
                "tokens": [int(n) for n in counted.sum(1)]}

    return run_distributed(one_rank, layout=Layout(), timeout=120)[0]


LAYOUTS = [Layout(dp=2), Layout(pp=2, vpp=2, dp=2), Layout(cp=2, dp=2), Layout(tp=2, cp=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_nan_sample_is_named_and_its_healthy_neighbours_still_count(layout):
    want = _reference()
    results = run_distributed(_run, layout=layout, timeout=240)
    assert all(repr(result) == repr(results[0]) for result in results)  # repr: NaN equals NaN
    metrics, top = results[0]["metrics"], results[0]["top"]
    for key, value in want["pooled"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), (key, metrics)
    planted = want["planted_tokens"]
    assert metrics["nonfinite_losses"] == planted  # the planted sample's counted tokens, never averaged in
    assert metrics["nonfinite_tokens"] == planted  # its NaN logits, counted by Accuracy
    first = top[0]
    assert (first["sample_index"], first["dataset"], first["nonfinite_tokens"], first["tokens"]) == \
        (1000 + PLANTED, "odd", planted, planted), top
    assert math.isnan(first["loss"]) and first["complete"], top
    # Then every healthy sample, highest loss first, with its reference loss.
    healthy = sorted((loss, index) for index, loss in want["per_sample"].items() if index != 1000 + PLANTED)
    assert len(top) == GLOBAL_BATCH
    for sample, (loss, index) in zip(top[1:], reversed(healthy)):
        assert sample["sample_index"] == index and sample["complete"] and sample["nonfinite_tokens"] == 0, top
        assert sample["loss"] == pytest.approx(loss, rel=1e-5)
        assert sample["tokens"] == want["tokens"][index - 1000]

