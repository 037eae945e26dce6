"""The logging backends against the real packages, read back by each tool's own reader.

tensorboard, wandb (offline), mlflow (sqlite store) and swanlab (offline) are
installed by ``make test-backends`` (pinned in ``tests/requirements-backends.txt``);
without them these tests are skipped, saying which package is missing.

The central scenario: a training of 20 steps (log every step, an eval at step
15) checkpoints at step 10 and dies at 20; the requeued job loads the step-10
checkpoint and logs steps 11..20 again with other values (and an eval at 18).
Each tool's reader must then show every key at every step exactly once, with
the values of the run that continued — no abandoned point (the first attempt's
steps 11..20, its eval at 15) — and the run configuration.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings

import pytest

from twinkle_megatron import TrainMetric
from twinkle_megatron.logging import (
    JsonlBackend,
    MetricsLogger,
    MlflowBackend,
    SwanLabBackend,
    TensorBoardBackend,
    WandbBackend,
    read_jsonl,
)
from twinkle_megatron.logging.mlflow import KEY_NAMES_TAG, SUPERSEDED_BY_TAG
from twinkle_megatron.logging.mlflow_names import mlflow_key
from twinkle_megatron.tracker import MetricsTracker, TrackerConfig

PACKAGES = ("tensorboard", "wandb", "mlflow", "swanlab")


def needs(*packages: str):
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed: `make test-backends` "
                                                    "installs the pinned logging packages")


Timeline = dict  # {key: {step: value}}


# ------------------------------------------------------------------ the scenario


def _environment(monkeypatch, tmp_path) -> None:
    """Offline, quiet, and nothing written outside tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-config"))
    for name in ("WANDB_RUN_ID", "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "MLFLOW_TRACKING_URI",
                 "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


def _backends(run_dir: str, tracking_uri: str) -> list:
    return [JsonlBackend(os.path.join(run_dir, "metrics.jsonl")), TensorBoardBackend(os.path.join(run_dir, "tb")),
            WandbBackend(project="twinkle-test", directory=run_dir),
            MlflowBackend(experiment="twinkle-test", run_name="resumed", tracking_uri=tracking_uri),
            SwanLabBackend(project="twinkle-test", mode="offline", log_dir=os.path.join(run_dir, "swanlog"))]


def _attempt(run_dir: str, tracking_uri: str, steps: range, loss_offset: float, checkpoint=None, eval_at=None,
             save_at=None, backends=None):
    """One job: the tracker with every backend, a TrainMetric with two parameter groups (Twinkle's keys)."""
    train = TrainMetric()
    backends = _backends(run_dir, tracking_uri) if backends is None else backends
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=backends, log_dir=run_dir,
                                                  run_config={"optimizer": {"name": "adam", "lr": 1e-3}, "seed": 7}),
                             metrics=[train])
    if checkpoint is not None:
        tracker.load_state_dict(checkpoint["tracker"])
        train.load_state_dict(checkpoint["train"])
    records, saved = {}, None
    for step in steps:
        train.accumulate(None, {"lr": [1e-3, 2e-3], "step": step})
        records[step] = tracker.end_step(step, loss=loss_offset + step, tokens=8, grad_norm=0.5, lr=1e-3)
        if step == eval_at:
            records[step] = {**records[step], **tracker.log_eval(loss=loss_offset / 100 + 0.25)}
        if step == save_at:
            saved = {"tracker": tracker.state_dict(), "train": train.state_dict()}
    tracker.close()
    return records, saved


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Run the two attempts once for every backend; the expected timeline and where each backend wrote."""
    for name in PACKAGES:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} not installed: `make test-backends` installs the pinned logging packages")
    tmp_path = tmp_path_factory.mktemp("resumed")
    run_dir, tracking_uri = str(tmp_path / "run"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as monkeypatch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _environment(monkeypatch, tmp_path)
        first, checkpoint = _attempt(run_dir, tracking_uri, range(1, 21), 100.0, eval_at=15, save_at=10)
        time.sleep(1.1)  # W&B and SwanLab name run directories by the second: a real restart takes longer
        second, _ = _attempt(run_dir, tracking_uri, range(11, 21), 200.0, checkpoint=checkpoint, eval_at=18)
    failures = [str(w.message) for w in caught if "failed and is disabled" in str(w.message)]
    expected: Timeline = {}
    for step, record in [*((s, r) for s, r in first.items() if s <= 10), *second.items()]:
        for key, value in record.items():
            expected.setdefault(key, {})[step] = value
    return {"expected": expected, "run_dir": run_dir, "tracking_uri": tracking_uri, "failures": failures,
            "abandoned": first}


def _assert_timeline(read: Timeline, expected: Timeline, float32: bool = False) -> None:
    assert sorted(read) == sorted(expected)
    for key, points in expected.items():
        assert sorted(read[key]) == sorted(points), f"{key}: steps {sorted(read[key])}"
        for step, value in points.items():
            want = _as_float32(value) if float32 else value
            assert read[key][step] == pytest.approx(want, rel=1e-12, abs=0), f"{key} at step {step}"


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _check_scenario_expectations(expected: Timeline) -> None:
    """What the scenario must contain for the checks to mean something."""
    assert expected["loss"] == {step: (100.0 if step <= 10 else 200.0) + step for step in range(1, 21)}
    assert expected["eval/loss"] == {18: 2.25}, "the eval of step 15 was abandoned"
    assert expected["train/consumed_tokens"][20] == 160
    assert "learning rate(param group 1)" in expected and "learning rate" in expected


# ------------------------------------------------------------------ JSONL (the baseline)


@needs(*PACKAGES)
def test_jsonl_holds_every_step_once(resumed_run):
    _check_scenario_expectations(resumed_run["expected"])
    read: Timeline = {}
    for record in read_jsonl(os.path.join(resumed_run["run_dir"], "metrics.jsonl")):
        for key, value in record.items():
            if key != "step":
                assert record["step"] not in read.get(key, {}), f"{key} twice at step {record['step']}"
                read.setdefault(key, {})[record["step"]] = value
    _assert_timeline(read, resumed_run["expected"])


# ------------------------------------------------------------------ TensorBoard: three loaders


def _tb_dir(resumed_run) -> str:
    return os.path.join(resumed_run["run_dir"], "tb")


@needs(*PACKAGES)
def test_tensorboard_event_accumulator(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    assert not [f for f in resumed_run["failures"] if "'tensorboard'" in f]
    events = EventAccumulator(_tb_dir(resumed_run))
    events.Reload()
    read = {tag: {}for tag in events.Tags()["scalars"]}
    for tag in read:
        for event in events.Scalars(tag):
            assert event.step not in read[tag], f"{tag} twice at step {event.step}"
            read[tag][event.step] = event.value
    _assert_timeline(read, resumed_run["expected"], float32=True)
    sessions = [HParamsPluginData.FromString(content).session_start_info
                for tag, content in events.PluginTagToContent("hparams").items() if "session_start_info" in tag]
    assert len(sessions) == 1, "one configuration: the earlier run's is replaced"
    hparams = {key: value.number_value or value.string_value for key, value in sessions[0].hparams.items()}
    assert hparams["parallel.tp"] == 1 and hparams["optimizer.name"] == "adam" and hparams["seed"] == 7
    assert hparams["versions.twinkle_megatron"] and hparams["training.log_interval"] == 1


@needs(*PACKAGES)
def test_tensorboard_legacy_app_loader(resumed_run):
    """The loader of ``tensorboard --load_fast=false``: it ignores the first START marker of a run."""
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(_tb_dir(resumed_run))
    multiplexer.Reload()
    (run,) = multiplexer.Runs()
    accumulator = multiplexer.GetAccumulator(run)
    read: Timeline = {}
    for tag in accumulator.Tags()["tensors"]:
        if tag.startswith("_hparams_"):
            continue
        for event in accumulator.Tensors(tag):
            assert event.step not in read.get(tag, {}), f"{tag} twice at step {event.step}"
            read.setdefault(tag, {})[event.step] = float(event.tensor_proto.float_val[0])
    _assert_timeline(read, resumed_run["expected"], float32=True)


@needs(*PACKAGES)
def test_tensorboard_app_with_its_data_server(resumed_run):
    """The real ``tensorboard`` app (Rust data server, the default), asked over HTTP on the loopback."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", _tb_dir(resumed_run), "--host", "127.0.0.1",
               "--port", "0", "--load_fast", "true"]
    app = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = None
        deadline = time.monotonic() + 60
        while base is None and time.monotonic() < deadline:
            line = app.stdout.readline()
            if not line and app.poll() is not None:
                break
            match = re.search(r"(http://127\.0\.0\.1:\d+)/", line)
            base = match.group(1) if match else None
        assert base is not None, "tensorboard did not start"
        tags = _wait_for_tags(base, deadline)
        read: Timeline = {}
        for tag in tags:
            query = urllib.parse.urlencode({"run": ".", "tag": tag})
            with urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{query}", timeout=30) as response:
                points = json.load(response)
            for _, step, value in points:
                assert step not in read.get(tag, {}), f"{tag} twice at step {step}"
                read.setdefault(tag, {})[step] = value
        _assert_timeline(read, resumed_run["expected"], float32=True)
    finally:
        app.terminate()
        app.wait(timeout=30)


def _wait_for_tags(base: str, deadline: float) -> list:
    """The scalar tags of the run once the data server has loaded it (it loads in the background)."""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=10) as response:
                tags = json.load(response).get(".", {})
            if "eval/loss" in tags:
                time.sleep(2)  # one more reload cycle: every file is read
                with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=10) as response:
                    return list(json.load(response)["."])
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("the data server did not load the run in time")


# ------------------------------------------------------------------ W&B offline: its transaction log


def wandb_records(run_dir: str) -> list:
    """The records of one offline run directory, as ``wandb leet inspect --json`` (W&B's own reader) prints them."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    done = subprocess.run([wandb, "leet", "inspect", "--json", run_dir], capture_output=True, text=True,
                          timeout=120, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wandb_run_dirs(directory: str, run_id: str) -> list:
    return sorted(glob.glob(os.path.join(directory, "wandb", f"offline-run-*-{run_id}")))


def wandb_visible_history(directory: str, run_id: str) -> tuple[Timeline, dict]:
    """What the run shows once its files are synced: each file's history in start order, and a run record's
    ``branch_point`` on the same run (a rewind, ``resume_from``) first drops the history after its step."""
    history: Timeline = {}
    config: dict = {}
    for run_dir in wandb_run_dirs(directory, run_id):
        for record in wandb_records(run_dir):
            if record["type"] == "run":
                branch = record["run"].get("branch_point")
                if branch and branch["run"] == run_id and branch["metric"] == "_step":
                    history = {key: {step: value for step, value in points.items() if step <= branch.get("value", 0)}
                               for key, points in history.items()}
                config.update(record["run"].get("config", {}).get("update", {}))
            elif record["type"] == "config":
                config.update(record["config"].get("update", {}))
            elif record["type"] == "history":
                step = int(record["history"]["step"]["num"])
                for key, value in record["history"]["item"].items():
                    if not key.startswith("_"):
                        history.setdefault(key, {})[step] = value
    return history, config


def _wandb_values(history: Timeline) -> Timeline:
    """W&B writes non-finite numbers as the strings 'NaN' / 'Infinity'."""
    return {key: {step: float(value) for step, value in points.items()} for key, points in history.items()}


def wandb_synced_runs(directory: str) -> dict:
    """``{run_id: (history, config)}`` of what ``wandb sync DIRECTORY/wandb`` uploads: the run folders directly in
    ``wandb/`` (W&B's sync reads ``wandb/*/*.wandb``), each run's folders in start order."""
    files = {os.path.realpath(path) for path in glob.glob(os.path.join(directory, "wandb", "*", "*.wandb"))}
    ids = {os.path.basename(os.path.dirname(path)).rsplit("-", 1)[1] for path in files}  # latest-run: a link
    return {run_id: wandb_visible_history(directory, run_id) for run_id in ids}


@needs(*PACKAGES)
def test_wandb_offline_restart_continues_in_a_successor_that_holds_every_step_once(resumed_run):
    """Offline, by default, no rewind (it would be applied only when synced, on a server that may lack it): the
    requeued job's run continues the first in a new run holding the steps before the restart, copied from the
    first run's files; the first run's folder moves to ``wandb/superseded/``, so a sync uploads one run."""
    assert not [f for f in resumed_run["failures"] if "'wandb'" in f]
    with open(os.path.join(resumed_run["run_dir"], "run_ids.json")) as file:
        successor = json.load(file)["wandb"]
    runs = wandb_synced_runs(resumed_run["run_dir"])
    assert list(runs) == [successor], "one run to sync"
    history, config = runs[successor]
    _assert_timeline(_wandb_values(history), resumed_run["expected"])
    (superseded,) = glob.glob(os.path.join(resumed_run["run_dir"], "wandb", "superseded", "offline-run-*"))
    first = superseded.rsplit("-", 1)[1]
    assert config["twinkle_megatron"]["continues"] == first != successor
    assert config["parallel"]["tp"] == 1 and config["optimizer"]["name"] == "adam" and config["seed"] == 7
    assert config["versions"]["twinkle_megatron"]


def _wandb_restart(tmp_path, monkeypatch, refuse_rewind: bool, save_at: int = 10, last_step: int = 20, **options):
    """Two attempts with the W&B backend alone (offline); the second resumes the checkpoint of ``save_at``.

    ``refuse_rewind``: the real ``wandb.init`` raises when asked to rewind (``resume_from``), as W&B's
    self-managed servers and clouds without the preview feature do; every other call is W&B's own."""
    import wandb

    _environment(monkeypatch, tmp_path)
    run_dir = str(tmp_path / "run")
    real_init = wandb.init

    def init(*args, **kwargs):
        if refuse_rewind and kwargs.get("resume_from"):
            raise wandb.errors.CommError("rewind is not enabled for this W&B server")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, checkpoint = _attempt(run_dir, "", range(1, last_step + 1), 100.0, save_at=save_at,
                                     backends=[WandbBackend(project="t", directory=run_dir, **options)])
        time.sleep(1.1)  # W&B names run folders by the second: a real restart takes longer
        second, _ = _attempt(run_dir, "", range(save_at + 1, 21), 200.0, checkpoint=checkpoint,
                             backends=[WandbBackend(project="t", directory=run_dir, **options)])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not [m for m in messages if "failed and is disabled" in m], messages
    expected: Timeline = {}
    for step, record in [*((s, r) for s, r in first.items() if s <= save_at), *second.items()]:
        for key, value in record.items():
            expected.setdefault(key, {})[step] = value
    with open(os.path.join(run_dir, "run_ids.json")) as file:
        return run_dir, json.load(file)["wandb"], expected, messages


@needs("wandb")
def test_wandb_rewind_when_asked_offline(tmp_path, monkeypatch):
    """``rewind=True``: the run is reopened and rewound (W&B applies it when the folders are synced, in order)."""
    run_dir, run_id, expected, messages = _wandb_restart(tmp_path, monkeypatch, refuse_rewind=False, rewind=True)
    directories = wandb_run_dirs(run_dir, run_id)
    assert len(directories) == 2, "the requeued job continues the same run id"
    runs = wandb_synced_runs(run_dir)
    assert list(runs) == [run_id] and not messages
    _assert_timeline(_wandb_values(runs[run_id][0]), expected)
    (record,) = [r for r in wandb_records(directories[1]) if r["type"] == "run"]
    assert record["run"]["branch_point"] == {"metric": "_step", "run": run_id, "value": 10}


@needs("wandb")
def test_wandb_rewind_refused_continues_in_a_successor_and_loses_no_step(tmp_path, monkeypatch):
    """The server refuses the rewind at ``wandb.init``: the backend stays alive, a successor run takes the steps
    before the restart (from the first run's files) and logs every resumed step; a sync shows each step once."""
    run_dir, run_id, expected, messages = _wandb_restart(tmp_path, monkeypatch, refuse_rewind=True, rewind=True)
    runs = wandb_synced_runs(run_dir)
    assert list(runs) == [run_id], "offline, the first run's folder moved aside: one run to sync"
    history, config = runs[run_id]
    _assert_timeline(_wandb_values(history), expected)
    (superseded,) = glob.glob(os.path.join(run_dir, "wandb", "superseded", "offline-run-*"))
    first = superseded.rsplit("-", 1)[1]
    assert config["twinkle_megatron"]["continues"] == first
    kept = [int(r["history"]["step"]["num"]) for r in wandb_records(superseded) if r["type"] == "history"]
    assert kept == list(range(1, 21)), "the first run's files are kept as they were"
    (message,) = [m for m in messages if "W&B restart" in m]
    assert f"W&B did not rewind run {first} (CommError: rewind is not enabled" in message
    assert f"run {run_id} continues it" in message and "10 earlier step(s) copied from its local files" in message


@needs("wandb")
def test_wandb_rewind_refused_resumes_a_run_that_stopped_at_its_checkpoint(tmp_path, monkeypatch):
    """Nothing after the checkpoint: the same run is resumed (``resume='allow'``), every step once."""
    run_dir, run_id, expected, messages = _wandb_restart(tmp_path, monkeypatch, refuse_rewind=True, last_step=10,
                                                         rewind=True)
    runs = wandb_synced_runs(run_dir)
    assert list(runs) == [run_id] and len(wandb_run_dirs(run_dir, run_id)) == 2
    _assert_timeline(_wandb_values(runs[run_id][0]), expected)
    (message,) = [m for m in messages if "W&B restart" in m]
    assert "it holds no step from 11 on, so it is resumed (resume='allow')" in message


# ------------------------------------------------------------------ MLflow: MlflowClient


@needs(*PACKAGES)
def test_mlflow_run_holds_every_step_once(resumed_run):
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    assert not [f for f in resumed_run["failures"] if "'mlflow'" in f]
    client = MlflowClient(tracking_uri=resumed_run["tracking_uri"])
    experiment = client.get_experiment_by_name("twinkle-test")
    (visible,) = client.search_runs([experiment.experiment_id])  # active runs only: what the UI lists
    read = {key: {m.step: m.value for m in client.get_metric_history(visible.info.run_id, key)}
            for key in visible.data.metrics}
    for key in read:
        steps = [m.step for m in client.get_metric_history(visible.info.run_id, key)]
        assert len(steps) == len(set(steps)), f"{key} holds a step twice"
    expected = {mlflow_key(key): points for key, points in resumed_run["expected"].items()}
    assert "learning rate_param group 1_" in expected, "Twinkle's key, in MLflow's characters"
    _assert_timeline(read, expected)
    assert visible.data.params["parallel.tp"] == "1" and visible.data.params["optimizer.name"] == "adam"
    assert visible.info.status == "FINISHED" and visible.info.run_name == "resumed"
    everything = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    (superseded,) = [run for run in everything if run.info.run_id != visible.info.run_id]
    assert superseded.info.lifecycle_stage == "deleted"
    assert superseded.data.tags[SUPERSEDED_BY_TAG] == visible.info.run_id


# ------------------------------------------------------------------ SwanLab offline: its local store


def swanlab_scalars(run_dir: str) -> Timeline:
    """The scalars of a SwanLab run directory, read with SwanLab's own record reader (what ``swanlab sync`` reads)."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = glob.glob(os.path.join(run_dir, "run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(path)
    read: Timeline = {}
    for raw in reader:
        record = Record.FromString(raw)
        if record.HasField("scalar"):
            key, step = record.scalar.key, record.scalar.step
            assert step not in read.get(key, {}), f"{key} twice at step {step}"
            read.setdefault(key, {})[step] = record.scalar.value.number
    reader.close()
    return read


@needs(*PACKAGES)
def test_swanlab_local_store_holds_every_step_once(resumed_run):
    import yaml

    assert not [f for f in resumed_run["failures"] if "'swanlab'" in f]
    store = os.path.join(resumed_run["run_dir"], "swanlog")
    (run_dir,) = glob.glob(os.path.join(store, "run-*"))  # the superseded attempt was moved aside
    assert len(glob.glob(os.path.join(store, "superseded", "run-*"))) == 1
    read = {key: points for key, points in swanlab_scalars(run_dir).items() if key in resumed_run["expected"]}
    _assert_timeline(read, resumed_run["expected"])
    with open(os.path.join(run_dir, "files", "config.yaml")) as file:
        config = yaml.safe_load(file)
    values = {key: item["value"] if isinstance(item, dict) and "value" in item else item
              for key, item in config.items()}
    assert values["parallel"]["tp"] == 1 and values["optimizer"]["name"] == "adam" and values["seed"] == 7


# ------------------------------------------------------------------ a run the user started (item 3)


@needs("wandb")
def test_wandb_run_started_by_the_user_is_logged_into_and_left_open(tmp_path, monkeypatch):
    import wandb

    _environment(monkeypatch, tmp_path)
    user_run = wandb.init(project="mine", dir=str(tmp_path), config={"mine": 1})
    try:
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=["wandb"], log_dir=str(tmp_path),
                                                      run_config={"seed": 3}))
        for step in (1, 2, 3):
            tracker.end_step(step, loss=float(step))
        tracker.close()
        user_run.log({"after": 1.0}, step=4)  # raised "run is finished" when the tracker finished it
        assert user_run.config["mine"] == 1 and user_run.config["seed"] == 3
        run_id = user_run.id
    finally:
        user_run.finish()
    history, _ = wandb_visible_history(str(tmp_path), run_id)
    assert history["loss"] == {1: 1.0, 2: 2.0, 3: 3.0} and history["after"] == {4: 1.0}


@needs("mlflow")
def test_mlflow_run_started_by_the_user_is_logged_into_and_left_open(tmp_path, monkeypatch):
    import mlflow

    _environment(monkeypatch, tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        with mlflow.start_run() as user_run:
            tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=["mlflow"], log_dir=str(tmp_path)))
            for step in (1, 2):
                tracker.end_step(step, loss=float(step))
            tracker.close()
            assert mlflow.active_run().info.run_id == user_run.info.run_id, "still the user's"
            mlflow.log_metric("after", 1.0, step=3)
        client = mlflow.MlflowClient()
        assert [(m.step, m.value) for m in client.get_metric_history(user_run.info.run_id, "loss")] == \
            [(1, 1.0), (2, 2.0)]
        assert client.get_run(user_run.info.run_id).data.params["parallel.tp"] == "1"
    finally:
        mlflow.set_tracking_uri(None)


@needs("swanlab")
def test_swanlab_run_started_by_the_user_is_logged_into_and_left_open(tmp_path, monkeypatch):
    import swanlab

    _environment(monkeypatch, tmp_path)
    user_run = swanlab.init(project="mine", mode="offline", log_dir=str(tmp_path / "mine"))
    try:
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=["swanlab"], log_dir=str(tmp_path)))
        for step in (1, 2):
            tracker.end_step(step, loss=float(step))
        tracker.close()
        assert swanlab.has_run() and swanlab.get_run() is user_run
        user_run.log({"after": 1.0}, step=3)
    finally:
        user_run.finish()
    (run_dir,) = glob.glob(str(tmp_path / "mine" / "run-*"))
    read = swanlab_scalars(run_dir)
    assert read["loss"] == {1: 1.0, 2: 2.0} and read["after"] == {3: 1.0}


# ------------------------------------------------------------------ run identity (item 4), keys (item 1)


def _wandb_training(log_dir: str, backend="wandb") -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a disabled backend fails the test
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[backend], log_dir=log_dir))
        tracker.end_step(1, loss=1.0)
        tracker.close()
    with open(os.path.join(log_dir, "run_ids.json")) as file:
        return json.load(file)["wandb"]


@needs("wandb")
def test_wandb_fresh_runs_get_fresh_ids_and_a_requeued_job_continues_its_run(tmp_path, monkeypatch):
    import wandb

    _environment(monkeypatch, tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first = _wandb_training(str(tmp_path / "a"))
    second = _wandb_training(str(tmp_path / "a"))  # a second training in the same allocation and directory
    assert first != second and "4242" not in (first, second)
    time.sleep(1.1)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the job was requeued before its first checkpoint
    monkeypatch.setenv("WANDB_RESUME", "allow")  # what job scripts export; W&B refuses it with a rewind
    wandb.teardown()  # W&B reads the environment once per process: as in a new job, read it again
    third = _wandb_training(str(tmp_path / "a"))  # offline: a successor of the second run
    runs = wandb_synced_runs(str(tmp_path / "a"))
    assert set(runs) == {first, third} and runs[third][1]["twinkle_megatron"]["continues"] == second
    assert runs[third][0]["loss"] == {1: 1.0}, "started again at step 1: step 1 once"
    time.sleep(1.1)
    wandb.teardown()
    rewound = _wandb_training(str(tmp_path / "a"), WandbBackend(directory=str(tmp_path / "a"), rewind=True))
    assert rewound == third, "rewound: the same run id"
    assert os.environ["WANDB_RESUME"] == "allow"
    history, _ = wandb_visible_history(str(tmp_path / "a"), third)
    assert history["loss"] == {1: 1.0}, "rewound to step 0: step 1 once"


@needs("mlflow")
def test_a_failing_mlflow_backend_leaves_no_active_run(tmp_path, monkeypatch):
    import mlflow

    _environment(monkeypatch, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    client.delete_experiment(client.create_experiment("gone"))  # MLflow refuses new runs in it
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[MlflowBackend(experiment="gone",
                                                                                          tracking_uri=uri)]))
    with pytest.warns(RuntimeWarning, match="'mlflow' failed and is disabled"):
        tracker.end_step(1, loss=1.0)
    tracker.close()
    assert mlflow.active_run() is None
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run() as run:  # raised "Run ... is already active" when the backend left one
            mlflow.log_metric("x", 1.0)
        assert run.info.run_id
    finally:
        mlflow.set_tracking_uri(None)


@needs("mlflow")
def test_mlflow_keys_twinkle_names_are_logged_not_fatal(tmp_path, monkeypatch):
    """``learning rate(param group 1)`` made MLflow raise at step 1 and disable the backend: nothing was logged."""
    from mlflow import MlflowClient

    _environment(monkeypatch, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    train = TrainMetric()
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, log_dir=str(tmp_path),
                                                  backends=[MlflowBackend(experiment="keys", tracking_uri=uri)]),
                             metrics=[train])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no backend may be disabled
        train.accumulate(None, {"lr": [1e-3, 5e-4], "step": 1})
        tracker.end_step(1, loss=2.0)
        tracker.log_eval(**{"profiling/Time taken: generate": 1.5})
    tracker.close()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("keys").experiment_id])
    assert run.data.metrics["loss"] == 2.0
    assert run.data.metrics["learning rate_param group 1_"] == 1e-3
    assert run.data.metrics["learning rate_param group 2_"] == 5e-4
    assert run.data.metrics["eval/profiling/Time taken: generate"] == 1.5, "MLflow accepts ':': unchanged"


# Keys MLflow accepts (its rule: Unicode word characters, digits, _ - . / : and spaces), and keys it refuses,
# some of which become one name once their refused characters are replaced.
ACCEPTED_KEYS = ("损失", "训练/准确率", "énergie", "Größe/Ω", "profiling/Time taken: generate", "a:b", "loss",
                 "eval/loss", "ratio_x")
REFUSED_KEYS = ("learning rate(param group 1)", "learning rate(param group 2)", "ratio(x)", "ratio[x]", "ratio{x}",
                "ratio<x>", "/rooted", "a//b", "trailing/", "..parent", "x" * 300, "x" * 299 + "!")


@needs("mlflow")
def test_mlflow_keeps_every_key_it_accepts_and_never_merges_two(tmp_path, monkeypatch):
    """Chinese, accented and colon keys arrive unchanged; keys that differ only in refused characters (and a
    refused key whose replacement is an accepted key: ``ratio(x)`` → ``ratio_x_``, ``ratio_x`` is its own) arrive
    under distinct names; nothing is dropped; the run's ``key_names`` tag says which key each new name holds, and
    a restart keeps every name."""
    from mlflow import MlflowClient
    from mlflow.utils.validation import _validate_metric_name

    _environment(monkeypatch, tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keys_ = ACCEPTED_KEYS + REFUSED_KEYS
    for key in ACCEPTED_KEYS:
        _validate_metric_name(key)  # MLflow's own check: these are accepted as they are
    values = {key: float(index) for index, key in enumerate(keys_)}

    def attempt(first_step, steps, offset):
        logger = MetricsLogger([MlflowBackend(experiment="keys", tracking_uri=uri)], log_dir=str(tmp_path))
        logger.start(first_step, {"数据集": "wiki", "a(b)": 1, "a_b_": 2})
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing dropped, no backend disabled
            for step in steps:
                logger.log({key: value + offset for key, value in values.items()}, step)
        logger.close()

    attempt(1, [1, 2], 0.0)
    attempt(2, [2, 3], 100.0)  # a restart at step 2: the run is superseded, and every key keeps its name
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("keys").experiment_id])
    recorded = json.loads(run.data.tags[KEY_NAMES_TAG])
    by_key = {key: name for name, key in recorded["metrics"].items()}
    assert set(by_key) == set(REFUSED_KEYS), "the renamed keys, each findable"
    names = {key: by_key.get(key, key) for key in keys_}
    assert len(set(names.values())) == len(keys_), "every key under a name of its own"
    assert set(run.data.metrics) == set(names.values()), "nothing dropped, nothing else"
    for key, name in names.items():
        _validate_metric_name(name)
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [(1, values[key]), (2, values[key] + 100),
                                                        (3, values[key] + 100)], key
    assert names["learning rate(param group 1)"] == "learning rate_param group 1_"
    assert names["ratio(x)"] == "ratio_x_" and names["ratio_x"] == "ratio_x", "first come, its plain name"
    assert {names[f"ratio{b}x{e}"][:len("ratio_x_-")] for b, e in ("[]", "{}", "<>")} == {"ratio_x_-"}
    assert names["/rooted"] == "_/rooted" and names["a//b"] == "a/_/b" and names["trailing/"] == "trailing/_"
    assert len(names["x" * 300]) == 250 and names["x" * 299 + "!"] != names["x" * 300]
    params = run.data.params
    assert params["数据集"] == "wiki" and params["a_b_"] == "2"
    assert params[recorded_param(recorded, "a(b)")] == "1" and recorded_param(recorded, "a(b)") != "a_b_"


def recorded_param(recorded: dict, key: str) -> str:
    (name,) = [name for name, original in recorded["params"].items() if original == key]
    return name


# ------------------------------------------------------------------ TensorBoard: a requeue before any checkpoint


@needs("tensorboard")
def test_tensorboard_restart_from_scratch_supersedes_every_loader_sees_it(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    log_dir = str(tmp_path / "tb")
    for attempt in (1, 2):
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=[TensorBoardBackend(log_dir)]))
        for step in range(1, 4 if attempt == 2 else 6):
            tracker.end_step(step, loss=10.0 * attempt + step)
        tracker.close()
    events = EventAccumulator(log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 21.0), (2, 22.0), (3, 23.0)]
    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(log_dir)
    multiplexer.Reload()
    tensors = multiplexer.GetAccumulator(".").Tensors("loss")
    assert [(e.step, e.tensor_proto.float_val[0]) for e in tensors] == [(1, 21.0), (2, 22.0), (3, 23.0)]
    assert all(math.isfinite(e.value) for e in events.Scalars("perf/step_time"))


@needs("mlflow")
def test_mlflow_run_id_recorded_for_another_store_starts_a_new_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    _environment(monkeypatch, tmp_path)
    first_uri, second_uri = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, log_dir=str(tmp_path),
                                                  backends=[MlflowBackend(tracking_uri=first_uri)]))
    tracker.end_step(1, loss=1.0)
    tracker.close()
    resumed = MetricsTracker(config=TrackerConfig(log_interval=1, log_dir=str(tmp_path),
                                                  backends=[MlflowBackend(tracking_uri=second_uri)]))
    resumed.load_state_dict(tracker.state_dict())
    with pytest.warns(RuntimeWarning, match="is not in this tracking store; starting a new run"):
        resumed.end_step(2, loss=2.0)
    resumed.close()
    client = MlflowClient(tracking_uri=second_uri)
    (run,) = client.search_runs(["0"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(2, 2.0)]


@needs("mlflow")
def test_mlflow_names_follow_mlflows_own_rule():
    """Over random keys of accepted and refused characters: what we keep is what MLflow's validator accepts, and
    every name given is accepted by it and held by one key only."""
    import random

    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_length_limit, _validate_metric_name

    from twinkle_megatron.logging.mlflow_names import MlflowNames, mlflow_accepts

    def accepted(name: str) -> bool:
        try:
            _validate_metric_name(name)
            _validate_length_limit("name", 250, name)
        except MlflowException:
            return False
        return True

    generator = random.Random(0)
    alphabet = "ab/.: -_()[]#é损\u0301\t"
    names, owners = MlflowNames(), {}
    for _ in range(20_000):
        key = "".join(generator.choice(alphabet) for _ in range(generator.randint(0, 8)))
        key = key * 60 if generator.random() < 0.01 else key
        assert mlflow_accepts(key) == accepted(key), repr(key)
        name = names(key)
        assert accepted(name) and owners.setdefault(name, key) == key, (key, name)
        assert name == key or not accepted(key) or key in names.renamed.values()


# ------------------------------------------------------------------ a checkpoint loaded after the tracker logged


@needs(*PACKAGES)
@pytest.mark.parametrize("rewind", [None, True], ids=["wandb-default", "wandb-rewind"])
def test_a_late_load_state_dict_leaves_no_step_twice_in_any_backend(tmp_path, monkeypatch, rewind):
    """A rollback in the same process: steps 1..8 logged, then the step-4 checkpoint is loaded and steps 5..8 run
    again with other values. Every backend (read with its own reader, SwanLab's local store too) holds each step
    once: 1..4 of the first timeline, 5..8 of the second. (Before, the JSONL log held steps 5..8 twice, silently.)"""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _environment(monkeypatch, tmp_path)
    run_dir, uri = str(tmp_path / "run"), f"sqlite:///{tmp_path / 'mlflow.db'}"
    backends = [JsonlBackend(os.path.join(run_dir, "metrics.jsonl")), TensorBoardBackend(os.path.join(run_dir, "tb")),
                WandbBackend(project="late", directory=run_dir, rewind=rewind),
                MlflowBackend(experiment="late", tracking_uri=uri),
                SwanLabBackend(project="late", mode="offline", log_dir=os.path.join(run_dir, "swanlog"))]
    tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=backends, log_dir=run_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 9):
            tracker.end_step(step, loss=100.0 + step)
            if step == 4:
                checkpoint = tracker.state_dict()
        time.sleep(1.1)  # W&B names run folders by the second
        tracker.load_state_dict(checkpoint)
        for step in range(5, 9):
            tracker.end_step(step, loss=200.0 + step)
        tracker.close()
    assert not [w for w in caught if "disabled" in str(w.message)], [str(w.message) for w in caught]
    expected = {step: (100.0 if step <= 4 else 200.0) + step for step in range(1, 9)}

    assert [(r["step"], r["loss"]) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == \
        sorted(expected.items())
    events = EventAccumulator(os.path.join(run_dir, "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == sorted(expected.items())
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("late").experiment_id])
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == \
        sorted(expected.items())
    runs = wandb_synced_runs(run_dir)
    (run_id,) = runs if rewind is None else [json.load(open(os.path.join(run_dir, "run_ids.json")))["wandb"]]
    assert list(runs) == [run_id], "one W&B run to sync"
    assert _wandb_values(runs[run_id][0])["loss"] == expected
    (swanlab_run,) = glob.glob(os.path.join(run_dir, "swanlog", "run-*"))  # the first moved to superseded/
    assert swanlab_scalars(swanlab_run)["loss"] == expected
