"""The one line inside Megatron-LM's own loop: what reaches its writers and console, by key, value and iteration.

``instrument()`` without a model and ``pretrain(..., metrics.wrap(forward_step), **metrics.pretrain_hooks())``, driven
by the kit's line-for-line mirror of Megatron-LM's ``train()`` (``kit/megatron_lm.py``, tag ``core_v0.16.1``: its
``train_step``, ``training_log``, ``evaluate_and_print_results`` and ``megatron.training``'s writers, last rank
only) over real megatron-core (schedules, DDP, optimizer, ``finalize_model_grads``) on forked CPU ranks: a run
resumed at iteration 10 (Megatron's ``args.iteration`` and ``consumed_train_samples``) for four iterations,
TensorBoard every second one, the console every one, an evaluation after every second, and in the last a planted
bad sample (its logits scaled up: a huge loss, a loss spike). Each layout runs the same loop three times in one
worker — without the plugin, with the plugin and nothing turned on, with everything on (``layer_norms``,
``incidents``, ``position_buckets``, MoE routing) — and every check reads those runs:

* the per-dataset loss-report keys Megatron-LM writes, the per-layer norms, the position buckets' keys and the MoE
  keys the plugin writes, each at its iteration, equal a float64 reference of the single-process model trained by
  the same loop (its weights and gradients at that iteration; MoE: the routers' own routing maps);
  ``grad_norm/total`` equals Megatron's logged ``grad-norm``;
* the evaluation prints and writes a perplexity of the loss only; ``validation/<key>`` equals the reference;
* the planted sample is named in ``incidents.jsonl`` (the TensorBoard directory) by its index in Megatron's sampler
  order and its dataset, and on the console;
* Megatron's own numbers (its loss, grad norm, weights, gradients) are bitwise those of the loop without the plugin,
  its reports those of the plugin with nothing on; everything on adds a fixed number of collectives per step.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import torch
from kit.megatron_gpt import BLEND_IDS, GPTSpec, blended_batch, gpt_forward_step, make_batch, reference_metrics
from kit.megatron_lm import (
    MegatronLMArgs,
    constant_lr_scheduler,
    install_megatron_training,
    train,
    train_data_iterator,
)
from kit.megatron_moe import MoESpec, init_parallel
from kit.megatron_training import build_trained_gpt, train_forward_backward
from kit.part_norms import part_norms
from megatron.core.utils import get_model_config

from twinkle_megatron import keys
from twinkle_megatron.megatron import MegatronInstrumentation, instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives, host_sync_free
from twinkle_megatron.tracker.incidents import read_skip_list

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
# megatron-core 0.16's expert MLP cannot add a bias (kit.megatron_moe); two MoE layers.
MOE_SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8,
                   add_bias_linear=False)
# No router losses: the aux and z losses are computed per DP rank's tokens, so with them the gradients (and the
# weights after a step) would depend on the layout; the LM loss's do not.
MOE = MoESpec(num_experts=4, topk=2, aux_loss_coeff=0.0, z_loss_coeff=None)
TRUE_VOCAB = 60
GROUPS = ("web", "code", "math")  # kit.megatron_gpt.BLEND_IDS: the dataset_id of each sample
# A resumed run (Megatron's args.iteration and consumed_train_samples from its checkpoint): iterations 11 to 14, so
# that iterations and sample indices are seen to be Megatron's, not counted by the plugin from its own start.
START, ITERS = 10, 4
RUN = range(START + 1, START + ITERS + 1)  # the iterations the run logs
EVAL_INTERVAL, LR = 2, 1e-3  # an evaluation (of the next validation batch) after every second iteration
TENSORBOARD_INTERVAL, LOG_INTERVAL = 2, 1
MICRO_BATCH, GLOBAL_BATCH = 2, 8
PLANT_AT, PLANTED_ROW, MARK, LOGIT_SCALE = 14, 5, 7, 100.0  # iteration, row of its global batch, its token, the scale
POSITION_BUCKETS, POSITION_EDGES = 2, (0, 4, 8)
RTOL = 1e-5
TIMEOUT = 300


@dataclass(frozen=True)
class Case:
    """One layout's run: its parallel sizes, the distributed optimizer, MoE layers (with expert parallelism), and the
    planted bad sample: its row and how it is bad (huge logits, or NaN embeddings: :func:`plant_bad_sample`)."""

    layout: Layout
    distributed_optimizer: bool = False
    ep: int = 1
    moe: bool = False
    planted_row: int = PLANTED_ROW
    nan: bool = False

    def __str__(self) -> str:
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        return f"{self.layout}{ep}{'-distopt' if self.distributed_optimizer else ''}"


CASES = [Case(Layout(tp=2, pp=2)), Case(Layout(pp=2, dp=2, vpp=2), distributed_optimizer=True),
         Case(Layout(tp=2, cp=2)), Case(Layout(dp=2), ep=2, moe=True)]


# ------------------------------------------------------------------ the data, the planted sample


def _spec(moe: bool) -> GPTSpec:
    return MOE_SPEC if moe else SPEC


def _batch_of(moe: bool, planted_row: int = PLANTED_ROW) -> Callable[[int], dict]:
    """The global batch of (0-based) training iteration ``i``, logged at ``i + 1``; the one logged at PLANT_AT has
    its row ``planted_row`` made of MARK tokens (what the planted sample's hooks recognise)."""
    spec = _spec(moe)

    def batch_of(i: int) -> dict:
        batch = blended_batch(spec, TRUE_VOCAB, GLOBAL_BATCH, seed=20 + i)
        if i + 1 == PLANT_AT:
            batch["tokens"][planted_row] = MARK
        return batch

    return batch_of


def _valid_of(moe: bool) -> Callable[[int], dict]:
    spec = _spec(moe)
    return lambda i: blended_batch(spec, TRUE_VOCAB, GLOBAL_BATCH, seed=100 + i)


def plant_bad_sample(chunks: list, nan: bool = False) -> None:
    """The model, on every layout alike: a row whose input tokens are all MARK gets its logits scaled by LOGIT_SCALE
    (a huge loss; hooks of this rank's last-stage GPTModel, registered before the plugin's), or with ``nan`` NaN
    embeddings (a NaN loss; a hook of the first stage's embedding). Device ops only."""
    for chunk in chunks:
        gpt = chunk.module
        if nan:
            if gpt.pre_process:
                gpt.embedding.register_forward_hook(_nan_embeddings, with_kwargs=True)
            continue
        if not gpt.post_process:
            continue
        marked: dict[str, torch.Tensor] = {}

        def capture(module, args, kwargs, marked=marked):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            marked["rows"] = (input_ids == MARK).all(-1)  # [b]; the logits are [s, b, v]

        def scale(module, args, output, marked=marked):
            logits, bias = output
            return torch.where(marked["rows"][None, :, None], logits * LOGIT_SCALE, logits), bias

        gpt.register_forward_pre_hook(capture, with_kwargs=True)
        gpt.output_layer.register_forward_hook(scale)


def _nan_embeddings(module, args, kwargs, output):
    """NaN for every token of a row whose input tokens are all MARK (the output is ``[s, b, h]``)."""
    planted = (kwargs.get("input_ids", args[0] if args else None) == MARK).all(-1)  # input_ids [b, s]
    return torch.where(planted[None, :, None], torch.full_like(output, float("nan")), output)


def _args(moe: bool, run_dir: str, release: str = "core_v0.16.1") -> MegatronLMArgs:
    spec = _spec(moe)
    fields = dict(release=release, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
                  seq_length=spec.max_sequence_length,
                  iteration=START, consumed_train_samples=START * GLOBAL_BATCH, train_iters=START + ITERS, lr=LR,
                  eval_interval=EVAL_INTERVAL, eval_iters=1, log_interval=LOG_INTERVAL,
                  tensorboard_log_interval=TENSORBOARD_INTERVAL, log_validation_ppl_to_tensorboard=True,
                  tensorboard_dir=run_dir, wandb_project="recorded", num_layers=spec.num_layers)
    if moe:
        fields.update(num_experts=MOE.num_experts, moe_z_loss_coeff=MOE.z_loss_coeff)
    return MegatronLMArgs(**fields)


# ------------------------------------------------------------------ one run of Megatron-LM's loop


@dataclass
class Probes:
    """A test's probes of a run: ``before_step(chunks, iteration)`` between the gradient reduction and the optimizer
    step (iteration: the one the step is logged at), ``after_iteration(chunks, iteration)``."""

    before_step: Optional[Callable] = None
    after_iteration: Optional[Callable] = None


def _run_loop(case: Case, forward_step: Callable, hooks: dict, args: MegatronLMArgs,
              probes: Optional[Probes] = None) -> dict:
    """Megatron-LM's train() over a fresh model; what this rank's writers, console, model and collectives hold."""
    probes = probes or Probes()
    writers = install_megatron_training(args)
    chunks, optimizer = build_trained_gpt(_spec(case.moe), distributed_optimizer=case.distributed_optimizer, lr=LR,
                                          moe=MOE if case.moe else None)
    plant_bad_sample(chunks, case.nan)
    if probes.before_step is not None:
        step = optimizer.step
        optimizer.step = lambda: probes.before_step(chunks, args.curr_iteration + 1) or step()
    collectives: list[int] = []

    def after_iteration(iteration: int) -> None:
        collectives.append(sum(counted.values()))
        if probes.after_iteration is not None:
            probes.after_iteration(chunks, iteration)

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), count_collectives() as counted:
        train(forward_step, chunks, optimizer, constant_lr_scheduler(optimizer, args),
              train_data_iterator(chunks, _batch_of(case.moe, case.planted_row), first_iteration=START),
              train_data_iterator(chunks, _valid_of(case.moe)),
              hooks.get("process_non_loss_data_func"), get_model_config(chunks[0]), hooks.get("non_loss_data_func"),
              after_iteration=after_iteration)
    return {"scalars": writers.tensorboard.scalars if writers.tensorboard else None,
            "wandb": writers.wandb.logged if writers.wandb else None, "printed": printed.getvalue(),
            "weights": [p.detach().clone() for c in chunks for p in c.module.parameters()],
            "grads": [p.main_grad.detach().clone() for c in chunks for p in c.module.parameters()],
            "collectives": [n - m for n, m in zip(collectives, [0] + collectives[:-1])]}


def _layout_worker(case: Case, run_dir: str) -> dict:
    if case.ep > 1:
        init_parallel(ep=case.ep)
    with cpu_cuda_shim():
        plain = _run_loop(case, gpt_forward_step, {}, _args(case.moe, os.path.join(run_dir, "plain")))
        nothing = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS, moe_routing=False)
        nothing_on = _run_loop(case, nothing.wrap(gpt_forward_step), nothing.pretrain_hooks(),
                               _args(case.moe, os.path.join(run_dir, "nothing"), release="core_v0.19.0"))
        everything = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS, layer_norms=True, incidents=True,
                                position_buckets=POSITION_BUCKETS, seq_length=_spec(case.moe).max_sequence_length)
        _forbid_host_syncs_per_microbatch(everything)
        everything_on = _run_loop(case, everything.wrap(gpt_forward_step), everything.pretrain_hooks(),
                                  _args(case.moe, os.path.join(run_dir, "everything")))
        everything.calculate()  # collective; raises MetricHookError on every rank if a hook failed (or synced)
    return {"plain": plain, "nothing": nothing_on, "everything": everything_on}


def _forbid_host_syncs_per_microbatch(metrics: MegatronInstrumentation) -> None:
    """The per-microbatch paths with everything on — the model and output-layer hooks, the loss_func's
    accumulation (the reports, the metrics, the step health's feed and sampler indices) — raise HostSyncError on a
    host sync; a hook's error is recorded as a hook failure, which ``calculate()`` raises on every rank."""
    for name in ("_before_model", "_after_output_layer", "_accumulate"):
        setattr(metrics, name, host_sync_free(getattr(metrics, name)))
    health = metrics.step_health
    health.feed, health.sample_indices = host_sync_free(health.feed), host_sync_free(health.sample_indices)


# ------------------------------------------------------------------ the float64 reference (world 1)


def _routing_counts(chunks: list, counts: dict, args: MegatronLMArgs) -> None:
    """Hooks on every router: per iteration and layer, the tokens each training call routes to each expert (its own
    ``routing_map``) and the sum of each token's routing entropy ``H(softmax(z_t))`` of its logits (the router's own
    ``gating``), float64; evaluation calls (autograd off) left out."""
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in chunks:  # world 1: the local layer numbers are the global ones
        for name, module in chunk.module.named_modules():
            if isinstance(module, TopKRouter):
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))

                def count(module, inputs, output, layer=layer):
                    if not torch.is_grad_enabled():
                        return
                    with torch.no_grad():
                        logits = module.gating(inputs[0]).double().reshape(-1, MOE.num_experts)
                    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
                    routed, entropies = counts.setdefault(args.curr_iteration + 1, {}).setdefault(layer, ([], []))
                    routed.append(output[1].sum(0).double())
                    entropies.append(entropy)

                module.register_forward_hook(count)


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered, position = sorted(values), q * (len(values) - 1)
    low = int(math.floor(position))
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def _moe_expected(per_layer: dict[int, tuple[list, list]]) -> dict[str, float]:
    """docs/moe.md's keys from the routers' maps and logits: ``n_e`` per layer, balanced load ``b = T·k/E``."""
    tokens = GLOBAL_BATCH * MOE_SPEC.max_sequence_length
    balanced = tokens * MOE.topk / MOE.num_experts
    layers = [torch.stack(per_layer[i][0]).sum(0) for i in sorted(per_layer)]
    entropies = [torch.cat(per_layer[i][1]) for i in sorted(per_layer)]
    assert all(len(h) == tokens for h in entropies)
    imbalance = [float(n.max() / balanced) for n in layers]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"moe/layers": len(layers), "moe/tokens": float(tokens),
            "moe/utilization_min": min(float(n.min() / balanced) for n in layers),
            "moe/utilization_cv": mean([float(n.std(unbiased=False) / n.mean()) for n in layers]),
            "moe/dead_expert_fraction": mean([float((n == 0).double().mean()) for n in layers]),
            "moe/routing_entropy_norm": mean([float(h.mean().exp()) / MOE.num_experts for h in entropies]),
            "moe/imbalance_mean": mean(imbalance), "moe/imbalance_max": max(imbalance),
            "moe/imbalance_p50": _percentile(imbalance, 0.5), "moe/imbalance_p90": _percentile(imbalance, 0.9),
            "moe/imbalance_worst_layer": imbalance.index(max(imbalance))}


def _reference_worker(moe: bool, run_dir: str) -> dict:
    """World 1, the same loop without the plugin: per iteration the float64 metrics of its batch at its weights
    (positions and groups too), the per-part norms before its optimizer step, the routers' maps; the evaluation
    batches' metrics at each evaluation's weights."""
    spec = _spec(moe)
    want: dict[str, Any] = {"train": {}, "norms": {}, "routing": {}, "valid": {}}

    def measure(chunks: list, iteration: int) -> None:
        model = chunks[0].module
        if iteration < START + ITERS:
            want["train"][iteration + 1] = reference_metrics(spec, _batch_of(moe)(iteration), TRUE_VOCAB, GROUPS,
                                                             model=model, position_edges=POSITION_EDGES)
        if iteration in EVALUATED:  # the n-th evaluation reads the n-th validation batch
            want["valid"][iteration] = reference_metrics(spec, _valid_of(moe)(EVALUATED.index(iteration)),
                                                         TRUE_VOCAB, GROUPS, model=model)

    def before_step(chunks: list, iteration: int) -> None:
        want["norms"][iteration] = part_norms(chunks)

    with cpu_cuda_shim():
        # The first iteration's weights are the built model's (layout-independent: the same in every build).
        measure(build_trained_gpt(spec, lr=LR, moe=MOE if moe else None)[0], START)
        args = _args(moe, run_dir)
        _run_loop(Case(Layout(), moe=moe), _routing_step(moe, want, args), {}, args,
                  Probes(before_step=before_step, after_iteration=measure))
    want["routing"] = {iteration: _moe_expected(per_layer) for iteration, per_layer in want["routing"].items()}
    return want


def _routing_step(moe: bool, want: dict, args: MegatronLMArgs) -> Callable:
    """The plain forward step; with MoE it first hooks the routers of the chunk it receives (once per chunk)."""
    if not moe:
        return gpt_forward_step
    hooked: set = set()

    def step(data_iterator, model):
        if model not in hooked:
            hooked.add(model)
            _routing_counts([model], want["routing"], args)
        return gpt_forward_step(data_iterator, model)

    return step


_REFERENCES: dict = {}


def reference(moe: bool, run_dir: str) -> dict:
    if moe not in _REFERENCES:
        _REFERENCES[moe] = run_distributed(_reference_worker, layout=Layout(), args=(moe, run_dir),
                                           timeout=TIMEOUT)[0]
    return _REFERENCES[moe]


# ------------------------------------------------------------------ the checks


def _by_key(records: list) -> dict[str, dict[int, float]]:
    """``{key: {step: value}}``, every (key, step) written once."""
    table: dict[str, dict[int, float]] = {}
    for key, value, step in records:
        assert step not in table.setdefault(key, {}), f"{key} written twice at {step}"
        table[key][step] = value
    return table


REPORT_KEYS = ["accuracy", "logprob", "entropy"] + [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy")
                                                     for g in GROUPS]
LOGGED = [i for i in RUN if i % TENSORBOARD_INTERVAL == 0]  # the iterations TensorBoard is written at
EVALUATED = [i for i in RUN if i % EVAL_INTERVAL == 0]  # the iterations an evaluation follows


def _plugin_key(key: str) -> bool:
    """A key the plugin writes itself (step health, validation), not through Megatron's loss reports."""
    return key.startswith(("grad_norm/", "param_norm/", "moe/", "validation/", "train/")) or "/pos_" in key


@pytest.mark.parametrize("case", CASES, ids=str)
def test_megatron_lm_loop_writes_what_the_one_line_gives(case, tmp_path):
    want = reference(case.moe, str(tmp_path / "reference"))
    per_rank = run_distributed(_layout_worker, layout=case.layout, args=(case, str(tmp_path)), timeout=TIMEOUT)
    runs = per_rank[-1]  # the last rank holds the writers
    assert all(r[run]["scalars"] is None for r in per_rank[:-1] for run in runs), "writers live on the last rank only"
    tensorboard, wandb = _by_key(runs["everything"]["scalars"]), _by_key(runs["everything"]["wandb"])
    printed = runs["everything"]["printed"]

    _check_reports(tensorboard, wandb, want)
    _check_validation(tensorboard, wandb, printed, want)
    _check_megatron_console(tensorboard, printed, "core_v0.16.1")
    _check_megatron_console(_by_key(runs["nothing"]["scalars"]), runs["nothing"]["printed"], "core_v0.19.0")
    _check_step_health_console(tensorboard, printed)
    _check_layer_norms(tensorboard, wandb, want)
    _check_positions(tensorboard, want)
    if case.moe:
        _check_moe(tensorboard, want)
    _check_incident(tmp_path / "everything", printed, case)
    _check_unchanged(per_rank)
    _check_collectives(per_rank)


def _check_reports(tensorboard: dict, wandb: dict, want: dict) -> None:
    """Per-dataset reports, pooled by train_step, written by training_log at its TensorBoard interval."""
    for iteration in LOGGED:
        expected = want["train"][iteration]
        for key in REPORT_KEYS:
            assert tensorboard[key][iteration] == pytest.approx(expected[key], rel=RTOL), (key, iteration)
            assert wandb[key][iteration] == tensorboard[key][iteration], key
        for group in GROUPS:
            assert tensorboard[f"lm loss/{group}"][iteration] == pytest.approx(expected[f"loss/{group}"], rel=RTOL)
        assert tensorboard["lm loss"][iteration] == pytest.approx(expected["loss"], rel=RTOL)
    assert set(tensorboard["lm loss"]) == set(LOGGED)


def _check_validation(tensorboard: dict, wandb: dict, printed: str, want: dict) -> None:
    """A perplexity of the loss only (console and writers); the plugin's values at each evaluation's iteration."""
    validation_lines = [line for line in printed.splitlines() if "validation loss at" in line]
    assert [int(re.search(r"at iteration (\d+) \|", line).group(1)) for line in validation_lines] == EVALUATED
    for line in validation_lines:
        assert set(re.findall(r"\| ([^|]+?) PPL:", " | " + line)) == {"lm loss"}, line
    assert {key for key in tensorboard if "ppl" in key} == {"lm loss validation ppl",
                                                            "lm loss validation ppl vs samples"}
    assert tensorboard["lm loss validation"] == {
        iteration: pytest.approx(want["valid"][iteration]["loss"], rel=RTOL) for iteration in EVALUATED}
    for key in ["accuracy", "logprob", "entropy", "loss"] + [f"{k}/{g}" for k in ("accuracy", "loss") for g in GROUPS]:
        assert tensorboard[f"validation/{key}"] == {
            iteration: pytest.approx(want["valid"][iteration][key], rel=RTOL) for iteration in EVALUATED}, key
        assert wandb[f"validation/{key}"] == tensorboard[f"validation/{key}"], key


def _check_megatron_console(tensorboard: dict, printed: str, release: str) -> None:
    """Megatron's console line at every iteration: its averages when > 0 (core_v0.16.1: never a log-prob, nor an
    accuracy of 0) or >= 0 (core_v0.19.0)."""
    lines = [line for line in printed.splitlines() if " iteration " in line and "consumed samples" in line]
    assert [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in lines] == list(RUN)
    for iteration, line in zip(RUN, lines):
        shown = dict(re.findall(r"\| ([^|:]+): (\S+) (?=\|)", line))
        for key in ["lm loss", *REPORT_KEYS]:
            if iteration in tensorboard[key]:  # the interval's average is the iteration's value (log interval 1)
                value = tensorboard[key][iteration]
                assert (key in shown) == (value > 0 or release == "core_v0.19.0" and value >= 0), (key, line)
                assert key not in shown or float(shown[key]) == pytest.approx(value, rel=1e-6), (key, line)


def _check_step_health_console(tensorboard: dict, printed: str) -> None:
    """The plugin's step-health line beside Megatron's, at every iteration (log interval 1)."""
    health = [line for line in printed.splitlines() if "step health at iteration" in line]
    assert [int(re.search(r"step health at iteration (\d+)", line).group(1)) for line in health] == \
        list(RUN), health
    for line in health:
        iteration = int(re.search(r"at iteration (\d+)", line).group(1))
        if iteration in tensorboard[keys.GRAD_NORM_TOTAL]:
            shown = float(re.search(r"grad_norm/total ([0-9.e+-]+)", line).group(1))
            assert shown == pytest.approx(tensorboard["grad-norm"][iteration], rel=1e-3), line


def _check_layer_norms(tensorboard: dict, wandb: dict, want: dict) -> None:
    """Per-layer norms at the TensorBoard interval's iterations only, equal to the reference; their total is
    Megatron's own grad-norm of the same iteration."""
    for iteration in LOGGED:
        expected = want["norms"][iteration]
        for part, (grad_norm, param_norm) in expected.items():
            assert tensorboard[f"grad_norm/{part}"][iteration] == pytest.approx(grad_norm, rel=RTOL), (part, iteration)
            assert tensorboard[f"param_norm/{part}"][iteration] == pytest.approx(param_norm, rel=RTOL), part
            assert wandb[f"grad_norm/{part}"][iteration] == tensorboard[f"grad_norm/{part}"][iteration]
        assert tensorboard[keys.GRAD_NORM_TOTAL][iteration] == pytest.approx(tensorboard["grad-norm"][iteration],
                                                                             rel=RTOL)
        total = math.sqrt(sum(g * g for g, _ in expected.values()))
        assert tensorboard[keys.GRAD_NORM_TOTAL][iteration] == pytest.approx(total, rel=RTOL)
        layers = {int(part[6:]): g for part, (g, _) in expected.items() if part.startswith("layer_")}
        largest = max(layers, key=lambda i: (layers[i], -i))
        assert tensorboard[keys.GRAD_NORM_LAYER_MAX_INDEX][iteration] == largest
        assert tensorboard[keys.GRAD_NORM_LAYER_MAX][iteration] == pytest.approx(layers[largest], rel=RTOL)
    for key in (keys.GRAD_NORM_TOTAL, "param_norm/layer_00", keys.GRAD_NORM_LAYER_MAX_OVER_MEDIAN):
        assert set(tensorboard[key]) == set(LOGGED) == set(wandb[key]), key


def _check_positions(tensorboard: dict, want: dict) -> None:
    """The position buckets' keys, at the TensorBoard interval's iterations, equal to the reference."""
    buckets = [f"pos_{a}-{b - 1}" for a, b in zip(POSITION_EDGES[:-1], POSITION_EDGES[1:])]
    for iteration in LOGGED:
        for bucket in buckets:
            for key in ("accuracy", "logprob", "entropy", "loss"):
                assert tensorboard[f"{key}/{bucket}"][iteration] == pytest.approx(
                    want["train"][iteration][f"{key}/{bucket}"], rel=RTOL), (key, bucket, iteration)


def _check_moe(tensorboard: dict, want: dict) -> None:
    """The MoE keys equal what the routers' own routing maps give (docs/moe.md's formulas)."""
    for iteration in LOGGED:
        for key, value in want["routing"][iteration].items():
            assert tensorboard[key][iteration] == pytest.approx(value, rel=RTOL, abs=1e-12), (key, iteration)


def _check_incident(run_dir, printed: str, case: Case) -> None:
    """The planted sample, named by its index in Megatron's sampler order and its dataset; the skip list reads it."""
    path = run_dir / "incidents.jsonl"
    incidents = [json.loads(line) for line in path.read_text().splitlines()]
    assert [incident["step"] for incident in incidents] == [PLANT_AT], incidents
    (incident,) = incidents
    assert "loss_spike" in incident["reasons"], incident
    index = (PLANT_AT - 1) * GLOBAL_BATCH + PLANTED_ROW  # consumed before the step (a resumed run's too) + its row
    top = incident["samples"][0]
    assert (top["sample_index"], top["dataset_id"], top["dataset"]) == \
        (index, BLEND_IDS[PLANTED_ROW], GROUPS[BLEND_IDS[PLANTED_ROW]]), incident
    assert read_skip_list(str(path)) == {index}
    assert f"top sample {index} (dataset {GROUPS[BLEND_IDS[PLANTED_ROW]]}" in printed


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _check_unchanged(per_rank: list) -> None:
    """Everything on: Megatron's weights, gradients, loss and grad norm bitwise those of the loop without the plugin;
    its reports those of the plugin with nothing on."""
    for rank, runs in enumerate(per_rank):
        plain, everything = runs["plain"], runs["everything"]
        assert all(map(_bitwise_equal, plain["weights"], everything["weights"])), rank
        assert all(map(_bitwise_equal, plain["grads"], everything["grads"])), rank
    runs = per_rank[-1]
    plain, nothing, everything = (_by_key(runs[run]["scalars"]) for run in ("plain", "nothing", "everything"))
    for key in ("lm loss", "grad-norm", "learning-rate", "loss-scale", "lm loss validation"):
        assert everything[key] == plain[key] == nothing[key], key
    megatron_keys = {key: value for key, value in everything.items() if not _plugin_key(key)}
    assert megatron_keys == {key: value for key, value in nothing.items() if not _plugin_key(key)}
    assert not any(key.startswith(("grad_norm/", "param_norm/", "moe/")) or "/pos_" in key for key in nothing)


def _check_collectives(per_rank: list) -> None:
    """Everything on adds the same collectives to every training step, at most two (the step-health sync), and one
    all-gather on the flagged step; nothing else of the loop changes."""
    for rank, runs in enumerate(per_rank):
        added = [e - n for e, n in zip(runs["everything"]["collectives"], runs["nothing"]["collectives"])]
        normal = added[0]
        assert 0 < normal <= 2, (rank, added)
        assert added == [normal if iteration != PLANT_AT else normal + 1 for iteration in RUN], (rank, added)


# ------------------------------------------------------------------ a NaN sample


def _nan_worker(case: Case, run_dir: str) -> dict:
    with cpu_cuda_shim():
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS, layer_norms=True, incidents=True)
        return _run_loop(case, metrics.wrap(gpt_forward_step), metrics.pretrain_hooks(), _args(False, run_dir))


def test_a_nan_sample_is_named_by_its_sampler_index_on_the_second_data_parallel_rank(tmp_path):
    """NaN embeddings for one sample (microbatch 1, DP rank 1, its first sample) in Megatron-LM's loop: Megatron's
    loss and grad norm are NaN at that iteration, the plugin flags it and names the sample: consumed + m·b·dp +
    r·b + j."""
    case = Case(Layout(pp=2, dp=2), planted_row=6, nan=True)  # row 6: microbatch 1 of DP rank 1, sample 0
    per_rank = run_distributed(_nan_worker, layout=case.layout, args=(case, str(tmp_path)), timeout=TIMEOUT)
    tensorboard = _by_key(per_rank[-1]["scalars"])
    assert math.isnan(tensorboard["lm loss"][PLANT_AT]) and math.isnan(tensorboard["grad-norm"][PLANT_AT])
    assert tensorboard[keys.NONFINITE_LOSS_STEPS] == {iteration: float(iteration == PLANT_AT) for iteration in LOGGED}
    incidents = [json.loads(line) for line in (tmp_path / "incidents.jsonl").read_text().splitlines()]
    assert [incident["step"] for incident in incidents] == [PLANT_AT], incidents
    (incident,) = incidents
    assert "nonfinite_loss" in incident["reasons"], incident
    index = (PLANT_AT - 1) * GLOBAL_BATCH + 1 * MICRO_BATCH * 2 + 1 * MICRO_BATCH + 0
    assert index == (PLANT_AT - 1) * GLOBAL_BATCH + 6
    top = incident["samples"][0]
    assert (top["sample_index"], top["dataset"]) == (index, GROUPS[BLEND_IDS[6]]), incident
    assert [s["sample_index"] for s in incident["samples"] if s["loss"] is None or s["loss"] != s["loss"]] == [index]
    assert read_skip_list(str(tmp_path)) == {index}


# ------------------------------------------------------------------ a step Megatron's rerun state machine runs again


def _rerun_worker(reruns: bool) -> dict:
    """Iterations 1 and 2 of the same batches with the weights held (no optimizer step); with ``reruns`` the
    forward-backward of iteration 1 runs twice at the same ``curr_iteration``, as ``train_step``'s
    ``while rerun_state_machine.should_run_forward_backward(...)`` loop runs it under ``validate_results``."""

    with cpu_cuda_shim():
        spec = _spec(None)
        chunks, optimizer = build_trained_gpt(spec)
        get_model_config(chunks[0]).grad_scale_func = optimizer.scale_loss
        args = MegatronLMArgs(micro_batch_size=MICRO_BATCH, global_batch_size=8, seq_length=spec.max_sequence_length,
                              train_iters=2)
        writers = install_megatron_training(args)
        metrics = instrument(vocab_size=TRUE_VOCAB, layer_norms=True, position_buckets=POSITION_BUCKETS,
                             seq_length=spec.max_sequence_length)
        step = metrics.wrap(gpt_forward_step)
        for iteration in (0, 1):
            args.curr_iteration = iteration
            batch = make_batch(spec, global_batch_size=8, seed=iteration)
            for _ in range(2 if reruns and iteration == 0 else 1):
                train_forward_backward(chunks, batch, micro_batch_size=MICRO_BATCH, forward_step_func=step)
        metrics.detach()
    return {"scalars": writers.tensorboard.scalars if writers.tensorboard else None}


def test_a_step_megatrons_rerun_machine_runs_again_is_written_once():
    """The rerun's second finalize at the same iteration writes nothing, and its states do not leak into the next
    step: every step-health point equals the run without the rerun, one per key and iteration."""
    plain, rerun = (run_distributed(_rerun_worker, layout=Layout(pp=2), args=(reruns,), timeout=TIMEOUT)[-1]
                    for reruns in (False, True))
    assert rerun["scalars"] and rerun["scalars"] == plain["scalars"]
    points = [(key, iteration) for key, _, iteration in rerun["scalars"]]
    assert len(points) == len(set(points)) and {iteration for _, iteration in points} == {1, 2}
    assert any("/pos_" in key for key, _ in points) and ("grad_norm/total", 2) in points
