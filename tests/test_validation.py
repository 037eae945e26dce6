"""Validation under Megatron-LM's own evaluate(): no perplexity of a non-loss key; the plugin's values its own.

``instrument()`` without a model (Megatron-LM's ``pretrain()``) and the wrapped step, through
megatron-core's schedules on forked CPU ranks, driven by a mirror of Megatron-LM's ``evaluate`` and
``evaluate_and_print_results`` (``kit/megatron_lm.py``, tag ``core_v0.16.1``) between two
training steps: the validation pass prints and writes a perplexity of the loss only, the plugin's
``validation/<key>`` values (through ``pretrain()``'s ``non_loss_data_func`` /
``process_non_loss_data_func``) equal a single-process float64 reference over the evaluation batches
and are written at the evaluation's iteration, and the training reports around it are unchanged.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from kit.megatron_gpt import (
    GPTSpec,
    blended_batch,
    build_gpt_model,
    gpt_forward_step,
    pool_loss_reports,
    reference_metrics,
    run_forward_backward,
)
from kit.megatron_lm import MegatronLMArgs, evaluate_and_print_results, install_megatron_training, train_data_iterator

from twinkle_megatron import Accuracy, LossMetric, ParallelContext
from twinkle_megatron.megatron import instrument
from twinkle_megatron.megatron.validation import is_evaluation
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB = 60
GROUPS = ("web", "code", "math")
TIMEOUT = 120
ITERATION = 7  # the training iteration the evaluation runs at
TRAIN_SEED, EVAL_SEEDS = 4, (5, 6)  # the training batch; the evaluation's two batches (eval_iters = 2)


def _eval_batches() -> list[dict]:
    return [blended_batch(SPEC, TRUE_VOCAB, seed=seed) for seed in EVAL_SEEDS]


@functools.cache
def references() -> dict:
    """float64, one rank: the training batch's metrics and the evaluation batches' (both batches as one)."""
    def one_rank() -> dict:
        with cpu_cuda_shim():
            batches = _eval_batches()
            evaluated = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
            return {"train": reference_metrics(SPEC, blended_batch(SPEC, TRUE_VOCAB, seed=TRAIN_SEED), TRUE_VOCAB,
                                               GROUPS),
                    "eval": reference_metrics(SPEC, evaluated, TRUE_VOCAB, GROUPS)}

    return run_distributed(one_rank, layout=Layout(), timeout=TIMEOUT)[0]


def _train_evaluate_train() -> dict:
    """A training step, Megatron-LM's evaluation at ITERATION, a training step; what each rank saw."""
    import torch.distributed as dist

    last_rank = dist.get_rank() == dist.get_world_size() - 1
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS)
        step = metrics.wrap(gpt_forward_step)
        train_batch = blended_batch(SPEC, TRUE_VOCAB, seed=TRAIN_SEED)

        def train_step() -> dict:
            return pool_loss_reports(run_forward_backward(chunks, train_batch, micro_batch_size=2,
                                                          forward_only=True, forward_step_func=step))

        before = train_step()
        # Megatron-LM's globals: its args (eval_iters = 2) and the writers, which live on the last rank.
        writers = install_megatron_training(MegatronLMArgs(
            micro_batch_size=2, global_batch_size=8, seq_length=SPEC.max_sequence_length, train_iters=ITERATION,
            eval_iters=len(EVAL_SEEDS), log_validation_ppl_to_tensorboard=True), wandb=False)
        writer = writers.tensorboard
        collected = []
        hooks = metrics.pretrain_hooks()
        non_loss = hooks["non_loss_data_func"]
        eval_batches = _eval_batches()
        printed = evaluate_and_print_results(
            f"iteration {ITERATION}", step, train_data_iterator(chunks, lambda index: eval_batches[index]), chunks,
            ITERATION, hooks["process_non_loss_data_func"], None,
            non_loss_data_func=lambda model: collected.append(non_loss(model)) or collected[-1])
        after = train_step()
        return {"before": before, "after": after, "printed": printed, "collected": collected,
                "scalars": writer.scalars if writer else None, "calculated": metrics.calculate(),
                "validation_again": metrics.calculate_validation(), "last_rank": last_rank,
                "training_mode_after": all(chunk.training for chunk in chunks)}


LAYOUTS = [Layout(tp=2, pp=2), Layout(pp=2, dp=2, vpp=2), Layout(tp=2, cp=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_evaluation_prints_no_perplexity_of_a_non_loss_key_and_reports_validation_values(layout):
    want = references()
    per_rank = run_distributed(_train_evaluate_train, layout=layout, timeout=TIMEOUT)
    last = next(r for r in per_rank if r["last_rank"])

    # Megatron-LM's validation line and writer: the loss only (its PPL is a perplexity); nothing of ours.
    assert set(re.findall(r"\| ([^|]+?) PPL:", " | " + last["printed"])) == {"lm loss"}, last["printed"]
    megatron_keys = {key for key, _, _ in last["scalars"] if not key.startswith("validation/")}
    assert megatron_keys == {"lm loss validation", "lm loss validation ppl", "lm loss validation vs samples",
                             "lm loss validation ppl vs samples"}, megatron_keys
    printed_loss = float(re.search(r"lm loss value: (\S+)", last["printed"]).group(1))
    assert printed_loss == pytest.approx(want["eval"]["loss"], rel=1e-5)

    # The plugin's validation values: the same on every rank, equal to the reference over the evaluation batches.
    (values,) = per_rank[0]["collected"]
    assert all(r["collected"] == [values] for r in per_rank)
    for key in ["accuracy", "logprob", "entropy", "loss", "total_tokens"] + \
               [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy", "loss") for g in GROUPS]:
        assert values[f"validation/{key}"] == pytest.approx(want["eval"][key], rel=1e-5), key
    # ... written at the evaluation's iteration, every value once.
    ours = {key: (value, step) for key, value, step in last["scalars"] if key.startswith("validation/")}
    assert len(ours) == len([s for s in last["scalars"] if s[0].startswith("validation/")]) == len(values)
    for key, value in values.items():
        assert ours[key][1] == ITERATION
        assert ours[key][0] == pytest.approx(value, rel=1e-6), key  # TensorBoard stores float32
    assert all(r["validation_again"] == {} for r in per_rank), "each evaluation starts afresh"

    # Training reports unchanged around the evaluation, equal to the reference; calculate() holds training only.
    pooled = [(r["before"], r["after"]) for r in per_rank if r["before"] is not None]
    assert pooled and all(before == after == pooled[0][0] for before, after in pooled)
    train = pooled[0][0]
    assert set(train) == {"lm loss", "accuracy", "entropy", "logprob"} | \
        {f"{k}/{g}" for k in ("accuracy", "entropy", "logprob", "lm loss") for g in GROUPS}
    for key in ["accuracy", "logprob", "entropy"]:
        assert train[key] == pytest.approx(want["train"][key], rel=1e-5), key
        assert per_rank[0]["calculated"][key] == pytest.approx(want["train"][key], rel=1e-5), key
    assert per_rank[0]["calculated"]["total_tokens"] == 2 * want["train"]["total_tokens"]
    assert all(r["training_mode_after"] for r in per_rank)


def test_an_evaluation_microbatch_is_eval_mode_with_autograd_off():
    chunk = torch.nn.Linear(1, 1)
    assert not is_evaluation(chunk)  # a training step: train mode, autograd on
    with torch.no_grad():
        assert not is_evaluation(chunk), "a forward-only pass in train mode is a training pass"
        chunk.eval()
        assert is_evaluation(chunk) and is_evaluation([chunk]) and is_evaluation(None, [chunk])
        assert not is_evaluation(None), "no model to read: training"
    assert not is_evaluation(chunk), "eval mode with autograd on (dropout off while training) is training"


def test_with_a_model_given_an_evaluation_pass_feeds_calculate_as_before():
    """loss_reports off (a loop you own): no validation copy; eval-mode passes stay the caller's (RL log-prob
    passes run in eval mode and read calculate())."""
    metrics = instrument(torch.nn.Linear(2, 2))
    assert metrics.validation is None
    assert metrics.calculate_validation() == {} and metrics.pretrain_hooks() == {}


def _instrument_with_resolved_contexts() -> bool:
    context = ParallelContext.from_megatron()  # metrics given a context resolve it at construction
    metrics = [LossMetric(device_mesh=context), Accuracy(device_mesh=context, vocab_size=TRUE_VOCAB)]
    instrumented = instrument(metrics=metrics)
    copies = instrumented.validation.metrics.metrics
    return all(copy is not metric and copy.context is metric.context for copy, metric in zip(copies, metrics))


def test_the_validation_copy_shares_the_metrics_process_groups():
    """Metrics built with a resolved context (process groups cannot be copied) get a validation copy that reduces
    over the same groups."""
    assert all(run_distributed(_instrument_with_resolved_contexts, layout=Layout(tp=2), timeout=TIMEOUT))
