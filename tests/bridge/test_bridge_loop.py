"""Megatron-Bridge 0.6.2's own loop as the caller: ``train_step``, ``training_log`` and ``evaluate_and_print_results``
unmodified (``kit/megatron_bridge.py``), driven in Bridge's order (``kit/bridge_loop.py``) with Bridge's own
``GlobalState`` and its loggers: TensorBoard's ``SummaryWriter``, W&B (offline) and MLflow (an SQLite store:
MLflow 3.17 refuses a new file store), each read back by the tool's own reader (``kit/logger_readers.py``) and
checked by key, value and iteration.

``pretrain(config, metrics.wrap(forward_step))``: ``instrument()`` gets no model (Bridge builds it), the statistics
ride in the loss reports. Each layout runs once (three training iterations, one evaluation after the second) on a
real megatron-core GPT with Megatron's DDP and Adam at learning rate 0 (the optimizer runs and reports its grad
norm, the weights stay), so every iteration's float64 reference is the single-process model on that
iteration's global batch. Checked:

* the loss reports Bridge's ``training_log`` writes (``lm loss``, ``accuracy``, ``accuracy/<dataset>``,
  ``lm loss/<dataset>``, ...) equal the reference at their iteration in every logger, and Bridge's console line
  prints them;
* Bridge's evaluation pools only the ``loss_func``'s key: ``lm loss`` is its only value, perplexity and logger
  key (no perplexity of an accuracy anywhere), equal to the reference; the plugin's own validation values
  (``calculate_validation()``) equal the reference over the evaluation batch.

A logger whose package is not installed is skipped with its reason (``make test-bridge`` installs them first).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import math
import os
import re

import megatron.core
import pytest
from kit.megatron_gpt import GPTSpec, blended_batch, local_microbatches, reference_metrics
from kit.megatron_training import build_trained_gpt
from megatron.core import parallel_state
from packaging.version import Version

from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

ENABLED = os.environ.get("TWINKLE_BRIDGE_TEST") == "1"
pytestmark = pytest.mark.skipif(not ENABLED, reason="Megatron-Bridge's own code (needs megatron-core >= 0.18): "
                                                    "run by `make test-bridge`")
BRIDGE = None
if ENABLED:
    if Version(megatron.core.__version__) < Version("0.18"):
        raise RuntimeError(f"Megatron-Bridge 0.6.2 needs megatron-core >= 0.18, got {megatron.core.__version__}: "
                           "run `make test-bridge`")
    from kit.megatron_bridge import BridgeUnavailable, global_state, load_bridge

    try:
        BRIDGE = load_bridge()  # in the parent: the forked ranks inherit the imports
    except BridgeUnavailable as error:
        pytest.skip(str(error), allow_module_level=True)
    from kit.bridge_config import ConfigContainer, LoggerConfig, ModelSettings, ValidationConfig
    from kit.bridge_loop import train
    from kit.logger_readers import mlflow_metrics, tensorboard_scalars, wandb_history

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB, GLOBAL_BATCH, MICRO_BATCH = 60, 8, 2
GROUPS = ("web", "code", "math")
ITERATIONS, EVAL_INTERVAL = 3, 2
EVAL_SEED = 100
TIMEOUT = 240
RTOL = 1e-5
STATISTICS = ("accuracy", "logprob", "entropy")
LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # logger: its package
EXPERIMENT = "bridge-test"
LAYOUTS = [Layout(tp=2, cp=2), Layout(pp=2, dp=2, vpp=2)]


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _train_batch(iteration: int) -> dict:
    """Iteration ``iteration``'s global batch (a ``dataset_id`` per sample, as megatron-core's BlendedDataset)."""
    return blended_batch(SPEC, TRUE_VOCAB, GLOBAL_BATCH, seed=iteration)


def _eval_batch() -> dict:
    return blended_batch(SPEC, TRUE_VOCAB, GLOBAL_BATCH, seed=EVAL_SEED)


def _reference_worker() -> dict:
    """World 1, float64: the metrics of every iteration's batch and of the evaluation batch."""
    with cpu_cuda_shim():
        return {"train": {i: reference_metrics(SPEC, _train_batch(i), TRUE_VOCAB, GROUPS)
                          for i in range(1, ITERATIONS + 1)},
                "eval": reference_metrics(SPEC, _eval_batch(), TRUE_VOCAB, GROUPS)}


@functools.cache
def reference() -> dict:
    return run_distributed(_reference_worker, layout=Layout(), timeout=TIMEOUT)[0]


def _logger_config(directory: str) -> LoggerConfig:
    """Bridge's logger settings: every logger whose package is installed, each value logged at every
    iteration, the console line at every iteration."""
    enabled = {name for name, package in LOGGERS.items() if _installed(package)}
    return LoggerConfig(
        log_interval=1, tensorboard_log_interval=1,
        tensorboard_dir=os.path.join(directory, "tb") if "tensorboard" in enabled else None,
        wandb_project="bridge-test" if "wandb" in enabled else None, wandb_exp_name="run",
        wandb_save_dir=directory,
        mlflow_experiment=EXPERIMENT if "mlflow" in enabled else None, mlflow_run_name="run",
        mlflow_tracking_uri=f"sqlite:///{directory}/mlflow.db")


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


def _run_worker(directory: str) -> dict:
    """One Bridge run on this rank (see the module docstring); the last rank's console output comes back."""
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    with cpu_cuda_shim():
        model, optimizer = build_trained_gpt(SPEC, lr=0.0)
        dp = parallel_state.get_data_parallel_world_size()
        init_num_microbatches_calculator(0, None, GLOBAL_BATCH, MICRO_BATCH, dp)
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        cfg = ConfigContainer(ModelSettings(vpp, seq_length=SPEC.max_sequence_length), micro_batch_size=MICRO_BATCH,
                              data_parallel_size=dp, logger=_logger_config(directory), train_iters=ITERATIONS,
                              validation=ValidationConfig(eval_iters=1, eval_interval=EVAL_INTERVAL,
                                                          eval_global_batch_size=GLOBAL_BATCH,
                                                          eval_micro_batch_size=MICRO_BATCH))
        state = global_state(BRIDGE, cfg)
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS)
        train_data = iter([micro for i in range(1, ITERATIONS + 1)
                           for micro in local_microbatches(_train_batch(i), MICRO_BATCH, cp_size=1, cp_rank=0)])
        valid_data = iter(local_microbatches(_eval_batch(), MICRO_BATCH, cp_size=1, cp_rank=0))
        console = io.StringIO()
        with contextlib.redirect_stdout(console):
            result = train(BRIDGE, state, metrics.wrap(BRIDGE.gpt_step.forward_step), model, optimizer,
                           _scheduler(optimizer), train_data, ITERATIONS, valid_data=valid_data)
        validation = metrics.calculate_validation()
        _close_loggers(state)
    return {"loss_dicts": result.loss_dicts, "grad_norms": result.grad_norms, "validations": result.validations,
            "validation": validation, "console": console.getvalue()}


_RUNS: dict = {}


def bridge_run(layout: Layout, tmp_path_factory) -> dict:
    """The layout's run (once per session): every rank's results and the directory its loggers wrote."""
    if layout not in _RUNS:
        directory = str(tmp_path_factory.mktemp(f"bridge-{layout}".replace(" ", "")))
        per_rank = run_distributed(_run_worker, layout=layout, args=(directory,), timeout=TIMEOUT)
        _RUNS[layout] = {"ranks": per_rank, "directory": directory}
    return _RUNS[layout]


@pytest.fixture(autouse=True)
def _offline_loggers(monkeypatch, tmp_path):
    """W&B offline and quiet; MLflow only where the run says; nothing written outside the test's folders."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    for name in ("WANDB_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


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


def _read(logger: str, directory: str) -> dict:
    if logger == "tensorboard":
        return tensorboard_scalars(os.path.join(directory, "tb"))
    if logger == "wandb":
        return wandb_history(directory)
    return mlflow_metrics(f"sqlite:///{directory}/mlflow.db", EXPERIMENT)


def _last_rank(run: dict) -> dict:
    return run["ranks"][-1]


@pytest.mark.parametrize("logger", sorted(LOGGERS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_training_log_writes_the_reports_at_their_iteration(layout, logger, tmp_path_factory):
    if not _installed(LOGGERS[logger]):
        pytest.skip(f"{LOGGERS[logger]} is not installed (make test-backends installs it)")
    run = bridge_run(layout, tmp_path_factory)
    written = _read(logger, run["directory"])
    grad_norms = _last_rank(run)["grad_norms"]
    for iteration in range(1, ITERATIONS + 1):
        assert _last_rank(run)["loss_dicts"][iteration] == pytest.approx(_expected_reports(iteration), rel=RTOL)
        for key, value in _expected_reports(iteration).items():
            assert written[key][iteration] == pytest.approx(value, rel=RTOL), (key, iteration)
        assert written["grad-norm"][iteration] == pytest.approx(grad_norms[iteration], rel=RTOL)
    assert not [key for key in written if "ppl" in key.lower() and not key.startswith("lm loss")]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_console_line_prints_the_reports(layout, tmp_path_factory):
    """Bridge's console line (last rank) at every iteration: each report with its value, Bridge's rule
    (``avg >= 0``) leaving out the negative log-prob."""
    console = _last_rank(bridge_run(layout, tmp_path_factory))["console"]
    lines = [line for line in console.splitlines() if re.search(r" iteration +\d+/ +\d+ \|", line)]
    assert len(lines) == ITERATIONS
    for iteration, line in enumerate(lines, start=1):
        printed = dict(re.findall(r" ([^|:]+): ([-+.0-9E]+) \|", line))
        for key, value in _expected_reports(iteration).items():
            if value >= 0:
                assert float(printed[key]) == pytest.approx(value, rel=1e-6), (key, iteration)
            else:
                assert key not in printed


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_evaluation_pools_only_the_loss_and_the_plugin_keeps_validation_values(layout, tmp_path_factory):
    run = bridge_run(layout, tmp_path_factory)
    want = reference()["eval"]
    last = _last_rank(run)
    assert last["validations"] == {EVAL_INTERVAL: pytest.approx({"lm loss": want["loss"]}, rel=RTOL)}
    console = last["console"]
    assert f"lm loss PPL: {math.exp(want['loss']):.6E}"[:-4] in console  # its value, to Bridge's 6 digits
    assert "PPL" not in console.replace("lm loss PPL", "")
    for rank in run["ranks"]:
        validation = rank["validation"]
        for key in STATISTICS:
            assert validation[f"validation/{key}"] == pytest.approx(want[key], rel=RTOL), key
            for group in GROUPS:
                assert validation[f"validation/{key}/{group}"] == pytest.approx(want[f"{key}/{group}"], rel=RTOL)


@pytest.mark.parametrize("logger", sorted(LOGGERS))
def test_evaluation_writes_only_the_loss_to_the_loggers(logger, tmp_path_factory):
    if not _installed(LOGGERS[logger]):
        pytest.skip(f"{LOGGERS[logger]} is not installed (make test-backends installs it)")
    run = bridge_run(LAYOUTS[0], tmp_path_factory)
    written = _read(logger, run["directory"])
    validation_keys = {key for key in written if "validation" in key or key.startswith("val/")}
    want = reference()["eval"]["loss"]
    expected_key = "val/lm loss" if logger == "mlflow" else "lm loss validation"
    assert expected_key in validation_keys
    assert written[expected_key] == {EVAL_INTERVAL: pytest.approx(want, rel=RTOL)}
    assert validation_keys <= {expected_key, "lm loss validation vs samples"}
