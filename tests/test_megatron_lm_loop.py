"""The one line inside Megatron-LM's own loop: what reaches its writers and console, by key, value and iteration.

``instrument()`` without a model and ``pretrain(..., metrics.wrap(forward_step), **metrics.pretrain_hooks())``, driven
by the kit's line-for-line mirror of Megatron-LM's ``train()`` (``kit/megatron_lm.py``, tag ``core_v0.16.1``: its
``train_step``, ``training_log``, ``evaluate_and_print_results`` and ``megatron.training``'s writers, last rank
only) over real megatron-core (schedules, DDP, optimizer, ``finalize_model_grads``) on forked CPU ranks, for several
iterations with an evaluation between them. Each layout runs once and every check reads that run:

* the per-dataset loss-report keys Megatron-LM writes at each iteration equal a float64 reference of the
  single-process model trained the same way (its weights at that iteration);
* the evaluation prints and writes a perplexity of the loss only; the plugin's ``validation/<key>`` values equal the
  reference over the evaluation batch, written at the evaluation's iteration;
* Megatron's own numbers (its loss, grad norm, weights and gradients) are bitwise those of the same loop without
  the plugin.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
from dataclasses import dataclass

import pytest
import torch
from kit.megatron_gpt import GPTSpec, blended_batch, gpt_forward_step, reference_metrics
from kit.megatron_lm import (
    MegatronLMArgs,
    constant_lr_scheduler,
    install_megatron_training,
    train,
    train_data_iterator,
)
from kit.megatron_moe import MoESpec, init_parallel
from kit.megatron_training import build_trained_gpt
from megatron.core.utils import get_model_config

from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
# megatron-core 0.16's expert MLP cannot add a bias (kit.megatron_moe); two MoE layers.
MOE_SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8,
                   add_bias_linear=False)
# No router losses: the aux and z losses are computed per DP rank's tokens, so with them the gradients (and the
# weights after a step) would depend on the layout; the LM loss's do not.
MOE = MoESpec(num_experts=4, topk=2, aux_loss_coeff=0.0, z_loss_coeff=None)
TRUE_VOCAB = 60
GROUPS = ("web", "code", "math")  # kit.megatron_gpt.BLEND_IDS: the dataset_id of each sample
ITERS, EVAL_AT, LR = 3, 2, 1e-3  # iterations; the evaluation after iteration EVAL_AT (eval_interval)
MICRO_BATCH, GLOBAL_BATCH = 2, 8
RTOL = 1e-5
TIMEOUT = 240


@dataclass(frozen=True)
class Case:
    """One layout's run: its parallel sizes, the distributed optimizer, MoE layers (with expert parallelism)."""

    layout: Layout
    distributed_optimizer: bool = False
    ep: int = 1
    moe: bool = False

    def __str__(self) -> str:
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        return f"{self.layout}{ep}{'-distopt' if self.distributed_optimizer else ''}"


CASES = [Case(Layout(tp=2, pp=2)), Case(Layout(pp=2, dp=2, vpp=2), distributed_optimizer=True),
         Case(Layout(tp=2, cp=2)), Case(Layout(dp=2), ep=2, moe=True)]


def _spec(moe: bool) -> GPTSpec:
    return MOE_SPEC if moe else SPEC


def _batch_of(moe: bool):
    """The global batch of (0-based) training iteration ``i``, logged at ``i + 1``."""
    spec = _spec(moe)
    return lambda i: blended_batch(spec, TRUE_VOCAB, GLOBAL_BATCH, seed=20 + i)


def _valid_of(moe: bool):
    spec = _spec(moe)
    return lambda i: blended_batch(spec, TRUE_VOCAB, GLOBAL_BATCH, seed=100 + i)


def _args(moe: bool, **overrides) -> MegatronLMArgs:
    spec = _spec(moe)
    fields = dict(micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seq_length=spec.max_sequence_length,
                  train_iters=ITERS, lr=LR, eval_interval=EVAL_AT, eval_iters=1,
                  log_validation_ppl_to_tensorboard=True, tensorboard_dir="unused-by-the-recording-writer",
                  wandb_project="recorded", num_layers=spec.num_layers)
    if moe:
        fields.update(num_experts=MOE.num_experts, moe_z_loss_coeff=MOE.z_loss_coeff)
    fields.update(overrides)
    return MegatronLMArgs(**fields)


def _run_loop(case: Case, forward_step, hooks: dict, args, probe=None) -> dict:
    """Megatron-LM's train() over a fresh model; what this rank's writers, console and model hold afterwards."""
    writers = install_megatron_training(args)
    chunks, optimizer = build_trained_gpt(_spec(case.moe), distributed_optimizer=case.distributed_optimizer, lr=LR,
                                          moe=MOE if case.moe else None)
    valid = train_data_iterator(chunks, _valid_of(case.moe))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(forward_step, chunks, optimizer, constant_lr_scheduler(optimizer, args),
              train_data_iterator(chunks, _batch_of(case.moe)), valid, hooks.get("process_non_loss_data_func"),
              get_model_config(chunks[0]), hooks.get("non_loss_data_func"),
              after_iteration=probe and functools.partial(probe, chunks))
    return {"scalars": writers.tensorboard.scalars if writers.tensorboard else None,
            "wandb": writers.wandb.logged if writers.wandb else None, "printed": printed.getvalue(),
            "weights": [p.detach().clone() for c in chunks for p in c.module.parameters()],
            "grads": [p.main_grad.detach().clone() for c in chunks for p in c.module.parameters()]}


def _layout_worker(case: Case) -> dict:
    if case.ep > 1:
        init_parallel(ep=case.ep)
    with cpu_cuda_shim():
        plain = _run_loop(case, gpt_forward_step, {}, _args(case.moe))
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS)
        instrumented = _run_loop(case, metrics.wrap(gpt_forward_step), metrics.pretrain_hooks(), _args(case.moe))
    return {"plain": plain, "instrumented": instrumented}


def _reference_worker(moe: bool) -> dict:
    """World 1, the same loop without the plugin; float64 metrics of each iteration's batch at that iteration's
    weights ({iteration: metrics}), and of the evaluation batch at the evaluation's weights."""
    spec = _spec(moe)
    want: dict = {"train": {}, "valid": None}

    def measure(chunks, iteration: int) -> None:
        model = chunks[0].module
        if iteration < ITERS:
            want["train"][iteration + 1] = reference_metrics(spec, _batch_of(moe)(iteration), TRUE_VOCAB, GROUPS,
                                                             model=model)
        if iteration == EVAL_AT:
            want["valid"] = reference_metrics(spec, _valid_of(moe)(0), TRUE_VOCAB, GROUPS, model=model)

    with cpu_cuda_shim():
        # The first iteration's weights are the built model's (layout-independent: the same in every build).
        measure(build_trained_gpt(spec, lr=LR, moe=MOE if moe else None)[0], 0)
        _run_loop(Case(Layout(), moe=moe), gpt_forward_step, {}, _args(moe), probe=measure)
    return want


@functools.cache
def reference(moe: bool) -> dict:
    return run_distributed(_reference_worker, layout=Layout(), args=(moe,), timeout=TIMEOUT)[0]


def _by_key(records: list) -> dict[str, dict[int, float]]:
    """``{key: {step: value}}``, every (key, step) written once."""
    table: dict[str, dict[int, float]] = {}
    for key, value, step in records:
        assert step not in table.setdefault(key, {}), f"{key} written twice at {step}"
        table[key][step] = value
    return table


REPORT_KEYS = ["accuracy", "logprob", "entropy"] + [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy")
                                                     for g in GROUPS]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_megatron_lm_writes_the_per_dataset_reports_and_validation_values(case):
    want = reference(case.moe)
    per_rank = run_distributed(_layout_worker, layout=case.layout, args=(case,), timeout=TIMEOUT)
    last = per_rank[-1]["instrumented"]
    tensorboard, wandb = _by_key(last["scalars"]), _by_key(last["wandb"])
    assert all(r["instrumented"]["scalars"] is None for r in per_rank[:-1]), "writers live on the last rank only"

    # Per-dataset reports, pooled by train_step and written by training_log at every iteration.
    for iteration in range(1, ITERS + 1):
        expected = want["train"][iteration]
        for key in REPORT_KEYS:
            assert tensorboard[key][iteration] == pytest.approx(expected[key], rel=RTOL), (key, iteration)
            assert wandb[key][iteration] == tensorboard[key][iteration], key
        for group in GROUPS:
            assert tensorboard[f"lm loss/{group}"][iteration] == pytest.approx(expected[f"loss/{group}"], rel=RTOL)
        assert tensorboard["lm loss"][iteration] == pytest.approx(expected["loss"], rel=RTOL)

    # The evaluation: a perplexity of the loss only (console and writers); the plugin's values at its iteration.
    printed = last["printed"]
    validation_line = next(line for line in printed.splitlines() if "validation loss at" in line)
    assert f"validation loss at iteration {EVAL_AT} |" in validation_line
    assert set(re.findall(r"\| ([^|]+?) PPL:", " | " + validation_line)) == {"lm loss"}, validation_line
    assert {key for key in tensorboard if "ppl" in key} == {"lm loss validation ppl",
                                                            "lm loss validation ppl vs samples"}
    assert tensorboard["lm loss validation"] == {EVAL_AT: pytest.approx(want["valid"]["loss"], rel=RTOL)}
    for key in ["accuracy", "logprob", "entropy", "loss"] + [f"{k}/{g}" for k in ("accuracy", "loss") for g in GROUPS]:
        assert tensorboard[f"validation/{key}"] == {EVAL_AT: pytest.approx(want["valid"][key], rel=RTOL)}, key
        assert wandb[f"validation/{key}"] == tensorboard[f"validation/{key}"], key

    # Megatron's console line at every iteration: each key's average when it is > 0 (core_v0.16.1's rule: never
    # a log-prob), as written.
    lines = [line for line in printed.splitlines() if " iteration " in line and "consumed samples" in line]
    assert [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in lines] == list(range(1, ITERS + 1))
    for iteration, line in enumerate(lines, start=1):
        shown = dict(re.findall(r"\| ([^|:]+): (\S+) (?=\|)", line))
        for key in ["lm loss", *REPORT_KEYS]:
            value = tensorboard[key][iteration]
            assert (key in shown) == (value > 0), (key, line)
            assert key not in shown or float(shown[key]) == pytest.approx(value, rel=1e-6), (key, line)

    # Megatron's own numbers are those of the same loop without the plugin, bitwise.
    for rank, result in enumerate(per_rank):
        plain, instrumented = result["plain"], result["instrumented"]
        assert all(torch.equal(a, b) for a, b in zip(plain["weights"], instrumented["weights"])), rank
        assert all(torch.equal(a, b) for a, b in zip(plain["grads"], instrumented["grads"])), rank
    plain = _by_key(per_rank[-1]["plain"]["scalars"])
    for key in ("lm loss", "grad-norm", "learning-rate", "loss-scale", "lm loss validation"):
        assert tensorboard[key] == plain[key], key
