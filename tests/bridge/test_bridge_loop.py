"""Megatron-Bridge 0.6.2's own loop as the caller: ``train_step``, ``training_log`` and ``evaluate_and_print_results``
unmodified (``kit/megatron_bridge.py``), driven in Bridge's order (``kit/bridge_loop.py``) with Bridge's own
``GlobalState`` and its loggers: TensorBoard's ``SummaryWriter``, W&B (offline) and MLflow (an SQLite store:
MLflow 3.17 refuses a new file store), each read back by the tool's own reader (``kit/logger_readers.py``) and
checked by key, value and iteration.

The wiring of ``pretrain(config, metrics.wrap(forward_step), callbacks=metrics.bridge_callbacks())`` with
``instrument(vocab_size=..., group_names=..., layer_norms=True, incidents=True, position_buckets=2, seq_length=8)``:
no model at ``instrument()`` (Bridge builds it). Each run happens once (three training iterations, one
evaluation after the second) on a real megatron-core GPT with Megatron's DDP and Adam at learning rate 0 (the
optimizer runs and reports its grad norm, the weights stay), so every iteration's float64 reference is the
single-process model on that iteration's global batch.
Runs: TP2 × CP2 and PP2 × VPP2 × DP2 (dense), DP2 × EP2 with MoE layers. Checked:

* the loss reports ``training_log`` writes (``lm loss``, ``accuracy``, ``accuracy/<dataset>``, ...) equal the
  reference at their iteration in every logger, and Bridge's console line prints them; so do the statistics per
  position bucket (``accuracy/pos_0-3``, ``loss/pos_4-7``, ...) the plugin writes at the step's end;
* per-layer gradient and parameter norms in every logger equal the float64 reference; their total equals
  Bridge's own logged ``grad-norm`` of the same iteration (and the plugin's console line, Bridge's);
* a planted bad sample (its token's embedding row turns non-finite at the last iteration) is named in
  ``incidents.jsonl`` with its global index in Megatron's sampler order and its dataset, and on the console;
* ``moe/...`` keys equal what the routers' own routing maps give, and Megatron's router losses as Bridge logs them;
* Bridge's evaluation pools only the ``loss_func``'s key (its only value, perplexity and logger keys); the
  plugin's callback writes ``validation/<key>`` at Bridge's iteration, equal to the reference;
* beside Bridge's plain step on a twin model: at most two collectives more per step (beyond Bridge's own
  pooling of the added report keys), gradients, weights, loss and grad norm bitwise the same.

A logger whose package is not installed is skipped with its reason (``make test-bridge`` installs them first;
Bridge's ``GlobalState`` itself imports TensorBoard).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from kit.megatron_bridge import SKIP_REASON, TEST_ENABLED, bridge_for_tests
from kit.megatron_gpt import GPTSpec, blended_batch, local_microbatches, reference_metrics
from kit.megatron_moe import MoESpec, init_parallel
from kit.megatron_training import build_trained_gpt, train_forward_backward
from kit.part_norms import part_norms
from megatron.core import parallel_state

from twinkle_megatron import keys
from twinkle_megatron.logging.mlflow_names import mlflow_key
from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives
from twinkle_megatron.tracker.incidents import load_incidents, read_skip_list

pytestmark = pytest.mark.skipif(not TEST_ENABLED, reason=SKIP_REASON)
BRIDGE = bridge_for_tests()
if TEST_ENABLED:
    from kit.bridge_config import ConfigContainer, LoggerConfig, ModelSettings, ValidationConfig
    from kit.bridge_loop import configure_model_like_bridge, train
    from kit.logger_readers import mlflow_metrics, tensorboard_scalars, wandb_history
    from kit.megatron_bridge import global_state

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
MOE_SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8,
                   add_bias_linear=False)  # megatron-core's expert MLP cannot add a bias (kit.megatron_moe)
TRUE_VOCAB, GLOBAL_BATCH, MICRO_BATCH = 60, 8, 2
GROUPS = ("web", "code", "math")
ITERATIONS, EVAL_INTERVAL = 3, 2
EVAL_SEED = 100
TIMEOUT = 240
RTOL = 1e-5
STATISTICS = ("accuracy", "logprob", "entropy")
LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # logger: its package
EXPERIMENT = "bridge-test"
# The planted bad sample: at iteration PLANTED_ITERATION, sample PLANTED_POSITION of the global batch holds token
# PLANT_TOKEN (outside the true vocabulary: no other sample has it), whose embedding row turns non-finite just
# before that step, so that sample's loss and every gradient are NaN. Its global index in Megatron's sampler
# order: the samples of the earlier steps, then its position.
PLANTED_ITERATION, PLANTED_POSITION, PLANT_TOKEN = 3, 7, 62  # under DP2: microbatch 1 of DP rank 1, its 2nd
PLANTED_INDEX = (PLANTED_ITERATION - 1) * GLOBAL_BATCH + PLANTED_POSITION
HEALTHY = range(1, PLANTED_ITERATION)  # the iterations before the planted one
MOE = MoESpec()  # 4 experts, top-2, Megatron's aux loss and z-loss
POSITION_EDGES = (0, 4, 8)  # instrument(position_buckets=2, seq_length=8): positions 0-3 and 4-7


@dataclass(frozen=True)
class Run:
    """One Bridge run: its layout (EP by ``init_parallel`` inside the ranks) and model."""

    name: str
    layout: Layout
    ep: int = 1
    moe: bool = False
    beside_plain: bool = False  # also Bridge's plain step on a twin model: collectives, bitwise equality

    @property
    def spec(self) -> GPTSpec:
        return MOE_SPEC if self.moe else SPEC


DENSE = [Run("tp2-cp2", Layout(tp=2, cp=2)), Run("pp2-vpp2-dp2", Layout(pp=2, dp=2, vpp=2), beside_plain=True)]
MOE_RUN = Run("dp2-ep2-moe", Layout(dp=2), ep=2, moe=True)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _train_batch(iteration: int) -> dict:
    """Iteration ``iteration``'s global batch (a ``dataset_id`` per sample, as megatron-core's BlendedDataset),
    the planted sample's token in it at the planted iteration."""
    batch = blended_batch(SPEC, TRUE_VOCAB, GLOBAL_BATCH, seed=iteration)
    if iteration == PLANTED_ITERATION:
        batch["tokens"][PLANTED_POSITION, 3] = PLANT_TOKEN
    return batch


def _eval_batch() -> dict:
    return blended_batch(SPEC, TRUE_VOCAB, GLOBAL_BATCH, seed=EVAL_SEED)


def _reference_worker() -> dict:
    """World 1, float64: the metrics of every iteration's batch and of the evaluation batch, and each part's
    gradient and parameter norm on the healthy iterations (Megatron's DDP and finalize, the reduced gradients)."""
    with cpu_cuda_shim():
        chunks, _ = build_trained_gpt(SPEC, lr=0.0)
        norms = {}
        for iteration in HEALTHY:
            train_forward_backward(chunks, _train_batch(iteration), micro_batch_size=MICRO_BATCH)
            norms[iteration] = part_norms(chunks)
        return {"train": {i: reference_metrics(SPEC, _train_batch(i), TRUE_VOCAB, GROUPS,
                                               position_edges=POSITION_EDGES) for i in HEALTHY},
                "eval": reference_metrics(SPEC, _eval_batch(), TRUE_VOCAB, GROUPS, position_edges=POSITION_EDGES),
                "norms": norms}


@functools.cache
def reference() -> dict:
    return run_distributed(_reference_worker, layout=Layout(), timeout=TIMEOUT)[0]


def _logger_config(directory: str) -> LoggerConfig:
    """Bridge's logger settings: TensorBoard and every other logger whose package is installed, each value
    logged at every iteration, the console line at every iteration."""
    enabled = {name for name, package in LOGGERS.items() if _installed(package)}
    return LoggerConfig(
        log_interval=1, tensorboard_log_interval=1,
        tensorboard_dir=_run_dir(directory),
        wandb_project="bridge-test" if "wandb" in enabled else None, wandb_exp_name="run",
        wandb_save_dir=directory,
        mlflow_experiment=EXPERIMENT if "mlflow" in enabled else None, mlflow_run_name="run",
        mlflow_tracking_uri=f"sqlite:///{directory}/mlflow.db")


def _run_dir(directory: str) -> str:
    """Where incidents.jsonl goes: Bridge's TensorBoard directory (Bridge's state needs TensorBoard installed)."""
    return os.path.join(directory, "tb")


def _close_loggers(state) -> None:
    """What Bridge's run end does to its loggers (their files complete for the readers)."""
    if state.tensorboard_logger is not None:
        state.tensorboard_logger.close()
    if state.wandb_logger is not None:
        state.wandb_logger.finish()
    if state.mlflow_logger is not None:
        state.mlflow_logger.end_run()


def _scheduler(optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=0.0, min_lr=0.0, lr_warmup_steps=0,
                                   lr_decay_steps=ITERATIONS, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=ITERATIONS, wd_incr_style="constant")


def _callbacks(model: list, moe: bool) -> list:
    """The user's callbacks: the plugin's validation callback, and the test's own (Bridge's ``Callback``): the
    planted corruption (dense runs), the routers' own maps (MoE run)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class PlantCorruptRow(BRIDGE.callbacks.Callback):
        """Just before the planted iteration, the planted token's embedding row (on the TP rank holding it)
        becomes non-finite: the one sample holding that token gets NaN activations, loss and gradients."""

        def on_train_step_start(self, context) -> None:
            if context.state.train_state.step + 1 != PLANTED_ITERATION:
                return
            for chunk in model:
                embedding = getattr(chunk.module, "embedding", None)
                if embedding is None:
                    continue
                table = embedding.word_embeddings
                if table.vocab_start_index <= PLANT_TOKEN < table.vocab_end_index:
                    with torch.no_grad():
                        table.weight[PLANT_TOKEN - table.vocab_start_index] = math.inf

    class RouterMaps(BRIDGE.callbacks.Callback):
        """Each training step's routing maps as megatron-core's routers return them (forward hooks; evaluation
        left out), per global layer: ``[tokens routed to each expert], tokens``, cut at ``on_train_step_end``."""

        def __init__(self) -> None:
            self.current: dict = {}
            self.steps: dict = {}
            for chunk in model:
                for module in chunk.modules():
                    if isinstance(module, TopKRouter):
                        module.register_forward_hook(self._record)

        def _record(self, router, args, output) -> None:
            if not torch.is_grad_enabled():
                return
            routing_map = output[1]
            counts, tokens = self.current.get(router.layer_number - 1, (0, 0))
            self.current[router.layer_number - 1] = (routing_map.sum(0).double() + counts,
                                                     tokens + routing_map.shape[0])

        def on_train_step_end(self, context) -> None:
            self.steps[context.state.train_state.step + 1] = {
                layer: (counts.tolist(), tokens) for layer, (counts, tokens) in self.current.items()}
            self.current = {}

    return [RouterMaps()] if moe else [PlantCorruptRow()]


def _observer(model: list):
    """A Bridge ``Callback`` counting the collectives of each training step (``on_train_step_start`` to
    ``on_train_step_end``: exactly Bridge's ``train_step``, megatron-core's and the plugin's alike) and keeping
    the gradients and weights after the last healthy step."""

    class Observer(BRIDGE.callbacks.Callback):
        def __init__(self) -> None:
            self.collectives: dict = {}
            self.after_healthy: Optional[tuple] = None
            self._counting = None

        def on_train_step_start(self, context) -> None:
            self._counting = count_collectives()
            self._counter = self._counting.__enter__()

        def on_train_step_end(self, context) -> None:
            self._counting.__exit__(None, None, None)
            iteration = context.state.train_state.step + 1
            self.collectives[iteration] = dict(self._counter)
            if iteration == HEALTHY[-1]:
                parameters = [p for chunk in model for p in chunk.parameters()]
                self.after_healthy = ([p.main_grad.clone() for p in parameters],
                                      [p.detach().clone() for p in parameters], context.loss_dict, context.grad_norm)

    return Observer()


def _plain_twin(run: Run, seen) -> dict:
    """Bridge's own ``forward_step``, not wrapped, on a twin of the model (same weights), for the healthy
    iterations: its collectives per step, and whether its gradients, weights, loss and grad norm equal, bitwise,
    what the instrumented run had (``seen``: its observer)."""
    model, optimizer = build_trained_gpt(run.spec, lr=0.0)
    configure_model_like_bridge(model, optimizer)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    cfg = ConfigContainer(ModelSettings(vpp, seq_length=SPEC.max_sequence_length, num_layers=SPEC.num_layers),
                          micro_batch_size=MICRO_BATCH, train_iters=len(HEALTHY),
                          data_parallel_size=parallel_state.get_data_parallel_world_size())
    plain = _observer(model)
    data = iter([micro for i in HEALTHY
                 for micro in local_microbatches(_train_batch(i), MICRO_BATCH, cp_size=1, cp_rank=0)])
    with contextlib.redirect_stdout(io.StringIO()):
        train(BRIDGE, global_state(BRIDGE, cfg), BRIDGE.gpt_step.forward_step, model, optimizer,
              _scheduler(optimizer), data, len(HEALTHY), callbacks=[plain])
    grads, weights, loss_dict, grad_norm = plain.after_healthy
    seen_grads, seen_weights, seen_loss_dict, seen_grad_norm = seen.after_healthy
    return {"plain_collectives": plain.collectives, "collectives": seen.collectives,
            "report_keys": (len(loss_dict), len(seen_loss_dict)),
            "bitwise": {"gradients": all(torch.equal(a, b) for a, b in zip(grads, seen_grads)),
                        "weights": all(torch.equal(a, b) for a, b in zip(weights, seen_weights)),
                        "lm loss": all(torch.equal(loss_dict[key], seen_loss_dict[key]) for key in loss_dict),
                        "grad norm": grad_norm == seen_grad_norm}}


def _run_worker(run: Run, directory: str) -> dict:
    """One Bridge run on this rank (see the module docstring); the last rank's console output comes back."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    if run.ep > 1:
        init_parallel(ep=run.ep)
    with cpu_cuda_shim():
        model, optimizer = build_trained_gpt(run.spec, lr=0.0, moe=MOE if run.moe else None)
        configure_model_like_bridge(model, optimizer)
        dp = parallel_state.get_data_parallel_world_size()
        init_num_microbatches_calculator(0, None, GLOBAL_BATCH, MICRO_BATCH, dp)
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        model_settings = ModelSettings(vpp, seq_length=SPEC.max_sequence_length, num_layers=run.spec.num_layers,
                                       num_moe_experts=MOE.num_experts if run.moe else None,
                                       moe_z_loss_coeff=MOE.z_loss_coeff if run.moe else None)
        cfg = ConfigContainer(model_settings, micro_batch_size=MICRO_BATCH, data_parallel_size=dp,
                              logger=_logger_config(directory), train_iters=ITERATIONS,
                              checkpoint_save=os.path.join(directory, "checkpoints"),
                              validation=ValidationConfig(eval_iters=1, eval_interval=EVAL_INTERVAL,
                                                          eval_global_batch_size=GLOBAL_BATCH,
                                                          eval_micro_batch_size=MICRO_BATCH))
        cfg.rerun_state_machine.check_for_nan_in_loss = False  # else Bridge's loss raises on the planted NaN
        state = global_state(BRIDGE, cfg)
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS, layer_norms=True, incidents=True,
                             position_buckets=len(POSITION_EDGES) - 1, seq_length=SPEC.max_sequence_length)
        own = _callbacks(model, run.moe)
        observer = _observer(model)
        train_data = iter([micro for i in range(1, ITERATIONS + 1)
                           for micro in local_microbatches(_train_batch(i), MICRO_BATCH, cp_size=1, cp_rank=0)])
        valid_data = iter(local_microbatches(_eval_batch(), MICRO_BATCH, cp_size=1, cp_rank=0))
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            result = train(BRIDGE, state, metrics.wrap(BRIDGE.gpt_step.forward_step), model, optimizer,
                           _scheduler(optimizer), train_data, ITERATIONS, valid_data=valid_data,
                           callbacks=metrics.bridge_callbacks() + own + [observer])
        _close_loggers(state)
        twin = _plain_twin(run, observer) if run.beside_plain else None
    return {"loss_dicts": result.loss_dicts, "grad_norms": result.grad_norms, "validations": result.validations,
            "console": console.getvalue(), "routing": own[0].steps if run.moe else None, "twin": twin}


_RUNS: dict = {}


def bridge_run(run: Run, tmp_path_factory) -> dict:
    """The run's results (once per session): every rank's, and the directory its loggers wrote."""
    if run.name not in _RUNS:
        directory = str(tmp_path_factory.mktemp(f"bridge-{run.name}"))
        per_rank = run_distributed(_run_worker, layout=run.layout, args=(run, directory), timeout=TIMEOUT)
        _RUNS[run.name] = {"ranks": per_rank, "directory": directory, "last": per_rank[-1]}
    return _RUNS[run.name]


@pytest.fixture(autouse=True)
def _offline_loggers(monkeypatch, tmp_path):
    """W&B offline and quiet; MLflow only where the run says; nothing written outside the test's folders."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    for name in ("WANDB_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


def _read(logger: str, directory: str) -> dict:
    """What ``logger`` holds (read once per run: the tests only look)."""
    if not _installed(LOGGERS[logger]):
        pytest.skip(f"{LOGGERS[logger]} is not installed (make test-backends installs it)")
    return _read_once(logger, directory)


@functools.cache
def _read_once(logger: str, directory: str) -> dict:
    if logger == "tensorboard":
        return tensorboard_scalars(os.path.join(directory, "tb"))
    if logger == "wandb":
        return wandb_history(directory)
    return mlflow_metrics(f"sqlite:///{directory}/mlflow.db", EXPERIMENT)


def _key(logger: str, key: str) -> str:
    return mlflow_key(key) if logger == "mlflow" else key


def _expected_reports(iteration: int) -> dict[str, float]:
    """The loss reports Bridge pools at ``iteration``: Megatron's ``lm loss`` and the plugin's statistics, over
    all tokens and per dataset."""
    want = reference()["train"][iteration]
    expected = {"lm loss": want["loss"]}
    expected.update({f"lm loss/{group}": want[f"loss/{group}"] for group in GROUPS})
    for key in STATISTICS:
        expected[key] = want[key]
        expected.update({f"{key}/{group}": want[f"{key}/{group}"] for group in GROUPS})
    return expected


def _position_keys() -> list[str]:
    """The per-position-bucket keys (``accuracy/pos_0-3``, ...) the plugin writes itself at the step's end."""
    buckets = [keys.position_bucket_key(first, end) for first, end in zip(POSITION_EDGES[:-1], POSITION_EDGES[1:])]
    return [f"{stat}/{bucket}" for stat in STATISTICS + ("loss",) for bucket in buckets]


def _no_perplexity_but_the_loss(written: dict) -> None:
    assert not [key for key in written if "ppl" in key.lower() and not key.startswith(("lm loss", "val/lm loss"))]


# ------------------------------------------------------------------ what the loss reports carry


@pytest.mark.parametrize("logger", sorted(LOGGERS))
@pytest.mark.parametrize("run", DENSE, ids=lambda run: run.name)
def test_training_log_writes_the_reports_at_their_iteration(run, logger, tmp_path_factory):
    result = bridge_run(run, tmp_path_factory)
    written = _read(logger, result["directory"])
    for iteration in HEALTHY:
        assert result["last"]["loss_dicts"][iteration] == pytest.approx(_expected_reports(iteration), rel=RTOL)
        for key, value in _expected_reports(iteration).items():
            assert written[key][iteration] == pytest.approx(value, rel=RTOL), (key, iteration)
        for key in _position_keys():  # each token at its position in its own sequence (CP chunks mapped back)
            want = reference()["train"][iteration][key]
            assert written[_key(logger, key)][iteration] == pytest.approx(want, rel=RTOL), (key, iteration)
    _no_perplexity_but_the_loss(written)


@pytest.mark.parametrize("run", DENSE, ids=lambda run: run.name)
def test_the_console_lines(run, tmp_path_factory):
    """Bridge's console line (last rank) at every iteration: each report with its value, Bridge's rule
    (``avg >= 0``) leaving out the negative log-prob; the plugin's step-health line after it; the incident line."""
    console = bridge_run(run, tmp_path_factory)["last"]["console"]
    lines = [line for line in console.splitlines() if re.search(r" iteration +\d+/ +\d+ \|", line)]
    assert len(lines) == ITERATIONS
    for iteration in HEALTHY:
        printed = dict(re.findall(r" ([^|:]+): ([-+.0-9E]+) \|", lines[iteration - 1]))
        for key, value in _expected_reports(iteration).items():
            if value >= 0:
                assert float(printed[key]) == pytest.approx(value, rel=1e-6), (key, iteration)
            else:
                assert key not in printed
    plugin_norms = dict(re.findall(r" twinkle-megatron step health at iteration (\d+) \| grad_norm/total ([^ |]+)",
                                   console))
    for iteration in HEALTHY:  # the plugin's total beside Bridge's own grad norm, as each prints it
        bridge_norm = float(re.search(r" grad norm: ([^ |]+) \|", lines[iteration - 1]).group(1))
        assert float(plugin_norms[str(iteration)]) == pytest.approx(bridge_norm, abs=1e-3), iteration
    assert sorted(plugin_norms) == [str(i) for i in range(1, ITERATIONS + 1)]
    dataset = GROUPS[_train_batch(PLANTED_ITERATION)["dataset_id"][PLANTED_POSITION]]
    assert f"[incident] step {PLANTED_ITERATION}: nonfinite_loss" in console
    assert f"; top sample {PLANTED_INDEX} (dataset {dataset}, loss nan" in console.lower()


# ------------------------------------------------------------------ step health through Bridge's loop


@pytest.mark.parametrize("logger", sorted(LOGGERS))
@pytest.mark.parametrize("run", DENSE, ids=lambda run: run.name)
def test_layer_norms_equal_the_reference_and_sum_to_bridges_grad_norm(run, logger, tmp_path_factory):
    result = bridge_run(run, tmp_path_factory)
    written = _read(logger, result["directory"])
    for iteration in HEALTHY:
        expected = reference()["norms"][iteration]
        squares = 0.0
        for part, (grad_norm, param_norm) in expected.items():
            grad = written[_key(logger, keys.layer_grad_norm_key(part))][iteration]
            assert grad == pytest.approx(grad_norm, rel=RTOL), (part, iteration)
            param = written[_key(logger, keys.layer_param_norm_key(part))][iteration]
            assert param == pytest.approx(param_norm, rel=RTOL), (part, iteration)
            squares += grad ** 2
        bridge_norm = written["grad-norm"][iteration]
        assert bridge_norm == pytest.approx(result["last"]["grad_norms"][iteration], rel=RTOL)
        assert written[_key(logger, keys.GRAD_NORM_TOTAL)][iteration] == pytest.approx(bridge_norm, rel=RTOL)
        assert math.sqrt(squares) == pytest.approx(bridge_norm, rel=RTOL)
        layers = [expected[keys.layer_part(i, SPEC.num_layers)][0] for i in range(SPEC.num_layers)]
        worst = max(range(SPEC.num_layers), key=lambda i: layers[i])
        assert written[_key(logger, keys.GRAD_NORM_LAYER_MAX_INDEX)][iteration] == worst
        assert written[_key(logger, keys.GRAD_NORM_LAYER_MAX)][iteration] == pytest.approx(layers[worst], rel=RTOL)
    assert not any("grad_norm/other" in key for key in written)


@pytest.mark.parametrize("run", DENSE, ids=lambda run: run.name)
def test_the_planted_sample_is_named_in_incidents_jsonl(run, tmp_path_factory):
    result = bridge_run(run, tmp_path_factory)
    run_dir = _run_dir(result["directory"])
    incidents = load_incidents(run_dir)
    assert [incident["step"] for incident in incidents] == [PLANTED_ITERATION]
    (incident,) = incidents
    top = incident["samples"][0]
    assert (top["sample_index"], top["dataset"], top["step"]) == (
        PLANTED_INDEX, GROUPS[_train_batch(PLANTED_ITERATION)["dataset_id"][PLANTED_POSITION]], PLANTED_ITERATION)
    assert "nonfinite_loss" in incident["reasons"] and top["nonfinite_tokens"] > 0
    assert all(sample["nonfinite_tokens"] == 0 for sample in incident["samples"][1:]), "one sample is bad"
    assert read_skip_list(run_dir) == {PLANTED_INDEX}
    assert math.isnan(result["last"]["loss_dicts"][PLANTED_ITERATION]["lm loss"])  # what Bridge logged


# ------------------------------------------------------------------ validation through Bridge's evaluation


@pytest.mark.parametrize("logger", sorted(LOGGERS))
@pytest.mark.parametrize("run", DENSE, ids=lambda run: run.name)
def test_validation_values_reach_the_loggers_and_only_the_loss_gets_a_perplexity(run, logger, tmp_path_factory):
    """Bridge's evaluation pools only the loss_func's key (``lm loss``: its value, its perplexity, its logger
    keys); the plugin's callback writes ``validation/<key>`` at Bridge's iteration, equal to the reference."""
    result = bridge_run(run, tmp_path_factory)
    want = reference()["eval"]
    assert result["last"]["validations"] == {EVAL_INTERVAL: pytest.approx({"lm loss": want["loss"]}, rel=RTOL)}
    written = _read(logger, result["directory"])
    loss_key = "val/lm loss" if logger == "mlflow" else "lm loss validation"
    assert written[loss_key] == {EVAL_INTERVAL: pytest.approx(want["loss"], rel=RTOL)}
    plugin = {f"validation/{key}": want[key] for key in STATISTICS + ("loss", "total_tokens", "correct_tokens")}
    plugin.update({f"validation/{key}/{group}": want[f"{key}/{group}"]
                   for key in STATISTICS + ("loss", "total_tokens") for group in GROUPS})
    plugin.update({f"validation/{key}": want[key] for key in _position_keys()})
    for key, value in plugin.items():
        assert written[_key(logger, key)] == {EVAL_INTERVAL: pytest.approx(value, rel=RTOL)}, key
    bridge_keys = {key for key in written if ("validation" in key or key.startswith("val/"))
                   and not key.startswith("validation/")}
    assert bridge_keys <= {loss_key, "lm loss validation vs samples"}
    _no_perplexity_but_the_loss(written)
    console = result["last"]["console"]
    assert f"lm loss PPL: {math.exp(want['loss']):.6E}"[:-4] in console  # its value, to Bridge's 6 digits
    assert "PPL" not in console.replace("lm loss PPL", "")
    assert f" validation at iteration {EVAL_INTERVAL} | accuracy: " in console


# ------------------------------------------------------------------ MoE routing through Bridge's loop


def _routing_expectation(per_rank: list, iteration: int) -> dict[str, float]:
    """docs/moe.md's keys from the routers' own maps of ``iteration``, summed over the ranks (DP×EP, TP1)."""
    layers = sorted(per_rank[0][iteration])
    loads, tokens = [], []
    for layer in layers:
        counts = torch.tensor([rank[iteration][layer][0] for rank in per_rank], dtype=torch.float64).sum(0)
        loads.append(counts)
        tokens.append(sum(rank[iteration][layer][1] for rank in per_rank))
    balanced = [t * MOE.topk / MOE.num_experts for t in tokens]
    utilization = [load / b for load, b in zip(loads, balanced)]
    imbalance = [float(u.max()) for u in utilization]
    return {"moe/layers": len(layers), "moe/tokens": sum(tokens) / len(layers),
            "moe/utilization_min": min(float(u.min()) for u in utilization),
            "moe/utilization_cv": sum(float(load.std(unbiased=False) / load.mean()) for load in loads) / len(layers),
            "moe/dead_expert_fraction": sum(float((load == 0).double().mean()) for load in loads) / len(layers),
            "moe/imbalance_mean": sum(imbalance) / len(layers), "moe/imbalance_max": max(imbalance),
            "moe/imbalance_worst_layer": imbalance.index(max(imbalance))}


@pytest.mark.parametrize("logger", sorted(LOGGERS))
def test_moe_keys_equal_the_routers_own_maps(logger, tmp_path_factory):
    result = bridge_run(MOE_RUN, tmp_path_factory)
    written = _read(logger, result["directory"])
    routing = [rank["routing"] for rank in result["ranks"]]
    for iteration in range(1, ITERATIONS + 1):
        for key, value in _routing_expectation(routing, iteration).items():
            assert written[_key(logger, key)][iteration] == pytest.approx(value, rel=RTOL), (key, iteration)
        bridge_norm = written["grad-norm"][iteration]
        assert written[_key(logger, keys.GRAD_NORM_TOTAL)][iteration] == pytest.approx(bridge_norm, rel=RTOL)
        # Megatron's router losses as Bridge's training_log logs them (megatron-core's track_moe_metrics); the
        # z-loss agrees here because every rank routes the same number of tokens (docs/moe.md: pooled by tokens).
        for loss in ("load_balancing_loss", "z_loss"):
            assert written[_key(logger, f"moe/{loss}")][iteration] == pytest.approx(written[loss][iteration],
                                                                                    rel=RTOL), (loss, iteration)
    assert not load_incidents(_run_dir(result["directory"]))


# ------------------------------------------------------------------ what the plugin adds to Bridge's step


def test_the_plugin_adds_one_sync_per_step_and_changes_nothing(tmp_path_factory):
    """Beside Bridge's plain step on a twin model, every rank: the instrumented step (everything on) issues at most
    two more collectives (the step-health sync) beyond the one all-reduce per report key that Bridge's
    ``train_step`` pools on the last stage (docs: 3 keys, plus 4 per dataset), and Bridge's gradients, weights,
    loss reports and grad norm are bitwise the same."""
    (run,) = [run for run in DENSE if run.beside_plain]
    for rank, result in enumerate(bridge_run(run, tmp_path_factory)["ranks"]):
        twin = result["twin"]
        assert twin["bitwise"] == {"gradients": True, "weights": True, "lm loss": True, "grad norm": True}, rank
        plain_keys, keys_seen = twin["report_keys"]
        pooled = keys_seen - plain_keys
        assert pooled in (0, len(STATISTICS) + 4 * len(GROUPS)), (rank, twin["report_keys"])
        for iteration in HEALTHY:
            added = sum(twin["collectives"][iteration].values()) - sum(twin["plain_collectives"][iteration].values())
            assert 0 < added - pooled <= 2, (rank, iteration, twin["collectives"][iteration],
                                             twin["plain_collectives"][iteration])
