"""Spike reports: a planted bad sample is named (index and dataset) by the incident, under every layout.

A real megatron-core GPT (kit.megatron_gpt) with Megatron's DDP and Adam memorises
one global batch for a few steps through Megatron's schedule; then, with the
weights held, one sample of that batch gets random labels (the planted bad sample). The tracker flags
the loss spike in its one sync, every rank learns of it, and the incident —
one all-gather, on the flagged step only — names the planted sample's global
index and dataset as the highest-loss sample. Non-flagged log steps make no
more collectives than the tracker without SampleLosses.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from kit.megatron_gpt import GPTSpec, make_batch
from kit.megatron_training import build_trained_gpt, train_forward_backward

from twinkle_megatron import MetricsTracker, TrackerConfig
from twinkle_megatron.megatron import instrument
from twinkle_megatron.metric import LossMetric, SampleLosses
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import count_collectives
from twinkle_megatron.tracker.incidents import flag_reasons, format_incident, load_incidents, read_skip_list

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
STEPS, PLANTED_STEP, PLANTED = 6, 6, 5  # the planted sample: row 5 of the global batch
GLOBAL_BATCH, MICRO_BATCH = 8, 2


def _batch(step: int) -> dict:
    batch = make_batch(SPEC, global_batch_size=GLOBAL_BATCH, seq_length=8, seed=11, mask_fraction=0.0)
    batch["sample_index"] = torch.arange(1000, 1000 + GLOBAL_BATCH)
    batch["dataset_id"] = torch.arange(GLOBAL_BATCH) % 2
    if step == PLANTED_STEP:
        batch["labels"] = batch["labels"].clone()
        batch["labels"][PLANTED] = torch.randint(0, SPEC.vocab_size, (8,), generator=torch.Generator().manual_seed(5))
    return batch


def _train(log_dir: str, distributed_optimizer: bool) -> dict:
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(SPEC, distributed_optimizer=distributed_optimizer, lr=0.03)
        metrics = instrument([c.module for c in chunks], [LossMetric(group_names=["even", "odd"]),
                                                           SampleLosses(top_k=3, dataset_names=["even", "odd"])])
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=("jsonl",), log_dir=log_dir,
                                                      ema_alpha=1.0, spike_threshold=0.1), metrics=metrics.metrics)
        collectives, flags = {}, {}
        for step in range(1, STEPS + 1):
            tracker.start_step()
            train_forward_backward(chunks, _batch(step), micro_batch_size=MICRO_BATCH,
                                   forward_step_func=metrics.wrap(_forward_step))
            tracker.record_grad_norms(chunks, optimizer)
            if step < PLANTED_STEP - 1:  # the last two steps see the same weights: the spike is the planted sample's
                optimizer.step()
            with count_collectives() as counted:
                record = tracker.end_step(step)
            collectives[step], flags[step] = dict(counted), flag_reasons(record)
        tracker.close()
        metrics.detach()
    return {"collectives": collectives, "flags": flags, "incident": tracker.last_incident}


def _forward_step(data_iterator, model):
    from kit.megatron_gpt import gpt_forward_step

    return gpt_forward_step(data_iterator, model)


LAYOUTS = [(Layout(dp=2), False), (Layout(tp=2, pp=2, dp=2), True), (Layout(pp=2, dp=2, vpp=2), False),
           (Layout(cp=2, dp=2), True)]


@pytest.mark.parametrize("layout,distributed_optimizer", LAYOUTS, ids=[str(layout) for layout, _ in LAYOUTS])
def test_the_planted_sample_is_named_by_the_incident(tmp_path, layout, distributed_optimizer):
    results = run_distributed(_train, layout=layout, args=(str(tmp_path), distributed_optimizer), timeout=240)
    for rank, result in enumerate(results):
        assert result["flags"][PLANTED_STEP] == ["loss_spike"], (rank, result["flags"])
        assert not any(result["flags"][step] for step in range(2, PLANTED_STEP)), result["flags"]
        incident = result["incident"]
        assert incident == results[0]["incident"]
        top = incident["samples"][0]
        assert (top["sample_index"], top["dataset_id"], top["dataset"], top["step"]) == \
            (1000 + PLANTED, PLANTED % 2, "odd", PLANTED_STEP), incident
        assert top["complete"] and top["tokens"] == 8
        assert set(incident["dataset_losses"]) == {"even", "odd"}
        assert incident["layers"] and incident["layers"][0]["grad_norm"] > 0
        normal = result["collectives"][PLANTED_STEP - 1]
        flagged = result["collectives"][PLANTED_STEP]
        # A flagged step costs exactly one all-gather more than a normal one.
        assert sum(flagged.values()) == sum(normal.values()) + 1, (normal, flagged)
    written = load_incidents(str(tmp_path))
    assert [i["step"] for i in written] == [PLANTED_STEP]
    assert read_skip_list(str(tmp_path / "incidents.jsonl")) == {1000 + PLANTED}
    assert "top sample 1005 (dataset odd" in format_incident(written[0])


def _plain(with_samples: bool) -> dict:
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(SPEC)
        extra = [SampleLosses()] if with_samples else []
        metrics = instrument([c.module for c in chunks], [LossMetric(), *extra])
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()), metrics=metrics.metrics)
        counts = []
        for step in (1, 2):
            train_forward_backward(chunks, _batch(1), micro_batch_size=MICRO_BATCH,
                                   forward_step_func=metrics.wrap(_forward_step))
            with count_collectives() as counted:
                tracker.end_step(step)
            counts.append(dict(counted))
    return counts


def test_normal_steps_cost_no_collective():
    layout = Layout(pp=2, dp=2)
    plain = run_distributed(_plain, layout=layout, args=(False,), timeout=120)
    kept = run_distributed(_plain, layout=layout, args=(True,), timeout=120)
    assert kept == plain


def test_skip_list_from_a_text_file(tmp_path):
    path = tmp_path / "skip.txt"
    path.write_text("12  # planted\n\n7\n")
    assert read_skip_list(str(path)) == {7, 12}
    (tmp_path / "incidents.jsonl").write_text(json.dumps({"step": 3, "reasons": ["nonfinite_loss"], "samples": [
        {"sample_index": None, "loss": 1.0, "step": 3}, {"sample_index": 4, "loss": 0.5, "step": 3}]}) + "\n")
    assert read_skip_list(str(tmp_path), per_incident=2) == {4}
    assert os.path.exists(tmp_path / "incidents.jsonl")


def test_sample_losses_refuses_a_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        SampleLosses(top_k=0)


def _incident_run(tmp_path):
    records = [{"step": step, "loss": 2.0 + (step == 3)} for step in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    incident = {"step": 3, "reasons": ["loss_spike"], "loss": 3.0, "loss_ema": 2.0,
                "samples": [{"sample_index": 41, "dataset_id": 1, "dataset": "hard", "loss": 9.5, "tokens": 7,
                             "step": 3, "complete": True},
                            {"sample_index": 40, "dataset_id": 0, "dataset": "easy", "loss": 2.5, "tokens": 7,
                             "step": 3, "complete": False}],
                "dataset_losses": {"easy": 2.1, "hard": 3.9}, "layers": [{"part": "layer_01", "grad_norm": 4.0}]}
    (tmp_path / "incidents.jsonl").write_text(json.dumps(incident) + "\n")


def test_the_cli_prints_incidents_and_skip_lists(tmp_path, capsys):
    from twinkle_megatron.cli import main

    _incident_run(tmp_path)
    assert main(["incidents", str(tmp_path / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "[incident] step 3: loss_spike" in out and "top sample 41 (dataset hard, loss 9.5" in out
    assert "sample 40  dataset easy" in out and "partial" in out
    assert "dataset losses: easy 2.1, hard 3.9" in out and "largest grad norms: layer_01 4" in out
    assert main(["incidents", str(tmp_path), "--skip-list", "2"]) == 0
    assert capsys.readouterr().out.split() == ["41"]  # 40 (2.5 against the step's 3.0) is typical of its step
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["incidents", str(empty)]) == 0
    assert "no incidents" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["incidents", str(tmp_path / "missing")])
    assert exit_info.value.code == 2


def test_the_loss_chart_marks_incidents(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from twinkle_megatron.plots import mark_incidents

    _incident_run(tmp_path)
    axes = Figure().add_subplot()
    handle = mark_incidents(axes, str(tmp_path / "metrics.jsonl"))
    assert handle is not None and list(handle.get_xdata()) == [3, 3]
    assert [text.get_text() for text in axes.texts] == ["#41 (hard)"]
    assert mark_incidents(Figure().add_subplot(), str(tmp_path / "empty" / "metrics.jsonl")) is None


def test_sample_losses_keep_the_top_samples_on_the_device_and_rank_non_finite_first():
    from twinkle_megatron.testing.guards import forbid_host_sync

    samples = SampleLosses(top_k=2, dataset_names=["a", "b"])
    losses = torch.tensor([[1.0, 1.0], [float("nan"), 2.0], [3.0, 5.0], [9.0, 9.0]])
    inputs = {"labels": torch.zeros(4, 2, dtype=torch.long), "completion_mask": torch.tensor([[1, 1]] * 3 + [[0, 0]]),
              "dataset_id": torch.tensor([0, 1, 0, 1]), "sample_index": torch.tensor([10, 11, 12, 13])}
    with forbid_host_sync():
        samples.accumulate(inputs, {"token_losses": losses})
        samples.end_step(7)
    assert samples.calculate() == {}  # the sync (no states of its own), then the interval is kept for gather_top
    top = samples.gather_top()
    assert [(s["sample_index"], s["dataset"], s["step"]) for s in top] == [(11, "b", 7), (12, "a", 7)]
    assert top[1]["loss"] == 4.0 and top[1]["tokens"] == 2
    assert top[0]["loss"] != top[0]["loss"]  # NaN: the non-finite sample ranks first


def test_flag_reasons():
    assert flag_reasons({"loss": 1.0, "train/loss_spike": 0, "train/nonfinite_loss_steps": 0}) == []
    assert flag_reasons({"train/nonfinite_loss_steps": 2}) == ["nonfinite_loss"]
    assert flag_reasons({"grad_norm/layer_03": float("inf"), "grad_norm/max_layer_over_median": float("inf")}) == \
        ["nonfinite_grad_norm"]
    assert flag_reasons({"grad_norm/max_layer_over_median": float("inf")}) == []  # a zero median: no incident


def test_an_fp16_overflow_alone_flags_no_incident_where_the_optimizer_skips_it():
    """overflow_skips (Megatron's own loop under fp16): non-finite layer norms with a finite loss are the loss
    scaler's overflow, a skipped step; with a non-finite loss or a spike beside them the step is still flagged."""
    overflow = {"loss": 2.0, "grad_norm/layer_03": float("inf")}
    assert flag_reasons(overflow) == ["nonfinite_grad_norm"]
    assert flag_reasons(overflow, overflow_skips=True) == []
    assert flag_reasons({**overflow, "train/nonfinite_loss_steps": 1}, overflow_skips=True) == \
        ["nonfinite_loss", "nonfinite_grad_norm"]
    assert flag_reasons({**overflow, "train/loss_spike": 1}, overflow_skips=True) == \
        ["loss_spike", "nonfinite_grad_norm"]


# ------------------------------------------------------------------ a NaN planted in one sample's embeddings

NAN_TOKEN = SPEC.vocab_size - 1  # the planted sample's every input token: what the embedding hook looks for
NAN_STEP = 2


def _nan_batch(step: int) -> dict:
    batch = _batch(1)
    if step == NAN_STEP:
        batch["tokens"] = batch["tokens"].clone()
        batch["tokens"][PLANTED] = NAN_TOKEN
    return batch


def _nan_embeddings(module, args, kwargs, output):
    """NaN for every token of a row whose inputs are all NAN_TOKEN (a device op: no host sync)."""
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    planted = (input_ids == NAN_TOKEN).all(-1)  # [b]; the output is [s, b, h]
    return torch.where(planted[None, :, None], torch.full_like(output, float("nan")), output)


def _strict_json_line(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def _train_with_a_nan(log_dir: str, layer_norms: bool, precision: str) -> dict:
    with cpu_cuda_shim():
        chunks, optimizer = _fp16_gpt(lr=0.03) if precision == "fp16" else build_trained_gpt(SPEC, lr=0.03)
        for chunk in chunks:
            model = chunk.module
            while not hasattr(model, "embedding") and hasattr(model, "module"):  # DDP(Float16Module(GPTModel))
                model = model.module
            if getattr(model, "embedding", None) is not None:  # the first pipeline stage
                model.embedding.register_forward_hook(_nan_embeddings, with_kwargs=True)
        metrics = instrument([c.module for c in chunks], [LossMetric(group_names=["even", "odd"]),
                                                           SampleLosses(top_k=3, dataset_names=["even", "odd"])])
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=("jsonl",), log_dir=log_dir),
                                 metrics=metrics.metrics)
        records, updated = {}, {}
        for step in (1, NAN_STEP):
            tracker.start_step()
            train_forward_backward(chunks, _nan_batch(step), micro_batch_size=MICRO_BATCH,
                                   forward_step_func=metrics.wrap(_forward_step))
            if layer_norms:
                tracker.record_grad_norms(chunks, optimizer)
            update_successful, grad_norm, _ = optimizer.step()
            updated[step] = update_successful
            records[step] = tracker.end_step(step, grad_norm=grad_norm, update_successful=update_successful)
        tracker.close()
        metrics.detach()
    return {"records": records, "incident": tracker.last_incident, "updated": updated}


NAN_LAYOUTS = [Layout(dp=2), Layout(pp=2, dp=2, vpp=2), Layout(cp=2, dp=2)]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("layer_norms", [False, True], ids=["plain", "layer_norms"])
@pytest.mark.parametrize("layout", NAN_LAYOUTS, ids=[str(layout) for layout in NAN_LAYOUTS])
def test_a_nan_in_one_samples_embeddings_flags_the_step_and_writes_strict_json(tmp_path, layout, layer_norms,
                                                                               precision):
    """The NaN sample's loss is non-finite; the step is flagged nonfinite_loss on every rank (the count of
    instrument()'s LossMetric feeds train/nonfinite_loss_steps), in fp32 and in fp16 (Megatron's loss scaler
    skips the step: update_successful False, grad_norm None, counted in train/skipped_steps), with or without
    per-layer norms, and the incident line is strict JSON naming the sample among its non-finite ones (the
    data, not the step)."""
    results = run_distributed(_train_with_a_nan, layout=layout, args=(str(tmp_path), layer_norms, precision),
                              timeout=240)
    for result in results:
        skipped = precision == "fp16"
        assert result["updated"] == {1: True, NAN_STEP: not skipped}
        assert result["records"][NAN_STEP]["train/skipped_steps"] == int(skipped)
        assert result["records"][1]["train/skipped_steps"] == 0
        record = result["records"][NAN_STEP]
        assert record["train/nonfinite_loss_steps"] == 1 and record["nonfinite_losses"] >= 1, record
        assert result["records"][1]["train/nonfinite_loss_steps"] == 0
        incident = result["incident"]
        assert incident["step"] == NAN_STEP and "nonfinite_loss" in incident["reasons"], incident
        nonfinite = [s for s in incident["samples"] if s["loss"] != s["loss"]]
        assert incident["samples"][0]["sample_index"] == 1000 + PLANTED, incident  # named first
        assert [s["sample_index"] for s in nonfinite] == [1000 + PLANTED], incident
        # The planted sample's microbatch neighbours still count (tests/test_nonfinite_samples.py checks the
        # values against a float64 reference): the loss and both datasets' losses stay finite.
        assert all(math.isfinite(record[key]) for key in ("loss", "loss/even", "loss/odd")), record
        assert incident["nonfinite_samples"] == len(nonfinite) and incident["step_wide"] is False
    lines = (tmp_path / "incidents.jsonl").read_text().splitlines()
    assert len(lines) == 1
    written = _strict_json_line(lines[0])
    assert written["step"] == NAN_STEP and "nonfinite_loss" in written["reasons"]
    assert any(s["loss"] is None for s in written["samples"]) and "/samples/0/loss" in written["nonfinite"]
    assert 1000 + PLANTED in read_skip_list(str(tmp_path), per_incident=len(written["samples"]))
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        _strict_json_line(line)


def _fp16_gpt(lr: float) -> tuple[list, object]:
    """The kit's GPT in fp16 with Megatron's Float16Module, DDP and its fp16 optimizer (a dynamic loss scaler),
    the schedule scaling the loss by the optimizer's scale (``grad_scale_func``), as Megatron-LM sets it up."""
    from kit.megatron_gpt import build_gpt_model, make_config
    from kit.megatron_training import _cuda_type_name, _with_gloo_groups
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    _with_gloo_groups()
    torch.Tensor.type = _cuda_type_name
    config = make_config(SPEC, fp16=True, params_dtype=torch.float16, pipeline_dtype=torch.float16)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = [Float16Module(config, chunk) for chunk in build_gpt_model(SPEC, config=config)]
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    wrapped = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, fp16=True, clip_grad=0.0,
                                                       initial_loss_scale=2.0 ** 8), wrapped)
    config.grad_scale_func = optimizer.scale_loss
    return wrapped, optimizer


# ------------------------------------------------------------------ the file, and data or step


def _incident(loss, sample_losses, **extra):
    samples = [{"sample_index": 10 + i, "dataset_id": i % 2, "dataset": ("easy", "hard")[i % 2], "loss": value,
                "tokens": 7, "step": 5, "complete": True} for i, value in enumerate(sample_losses)]
    return {"step": 5, "reasons": ["loss_spike"], "loss": loss, "samples": samples, **extra}


def test_incidents_are_strict_json_and_old_lines_still_read(tmp_path, capsys):
    from twinkle_megatron.cli import main
    from twinkle_megatron.tracker.incidents import IncidentReporter

    record = {"loss": float("nan"), "grad_norm": float("inf"), "learning rate": 0.3, "train/nonfinite_loss_steps": 1,
              "nonfinite_losses": 8, "loss/easy": 1.0, "loss/pos_0-3": 2.0}
    incident = IncidentReporter(None, str(tmp_path)).report(record, 2)
    assert "[incident] step 2: nonfinite_loss (loss nan, lr 3.00e-01, grad norm inf)" in capsys.readouterr().out
    line = (tmp_path / "incidents.jsonl").read_text()
    written = _strict_json_line(line)
    assert written["loss"] is None and written["grad_norm"] is None
    assert written["nonfinite"] == {"/loss": "NaN", "/grad_norm": "Infinity"}
    assert (written["dataset_losses"], written["position_losses"]) == ({"easy": 1.0}, {"pos_0-3": 2.0})
    assert incident["learning_rate"] == 0.3 and incident["nonfinite_losses"] == 8 and incident["samples"] == []
    old = json.dumps(_incident(float("nan"), [float("nan"), 2.0], step=3,
                               dataset_losses={"easy": 1.0, "pos_0-3": 2.0}))  # bare NaN, positions mixed in
    assert "NaN" in old
    (tmp_path / "incidents.jsonl").write_text(line + old + "\n")
    loaded = load_incidents(str(tmp_path))
    assert [i["step"] for i in loaded] == [2, 3]
    assert loaded[0]["loss"] != loaded[0]["loss"] and loaded[0]["grad_norm"] == float("inf")  # restored
    assert (loaded[1]["dataset_losses"], loaded[1]["position_losses"]) == ({"easy": 1.0}, {"pos_0-3": 2.0})
    assert read_skip_list(str(tmp_path)) == {10}  # the one non-finite sample among finite ones: the data
    assert main(["incidents", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "losses by position: pos_0-3 2" in out and "top sample 10 (dataset easy, loss nan" in out


def test_a_step_wide_incident_blames_the_step_and_skips_nothing(tmp_path):
    from twinkle_megatron.tracker.incidents import STEP_WIDE_RATIO, assess

    high = assess(_incident(14.7, [15.0, 14.9, 14.6, 14.4]))  # --lr 0.3: every sample as high as the step
    assert high["step_wide"] is True and all(s["loss_over_step"] < STEP_WIDE_RATIO for s in high["samples"])
    line = format_incident(high)
    assert "step-wide" in line and "top sample" not in line
    all_nan = assess(_incident(float("nan"), [float("nan")] * 3))  # --lr 1e6: every sample non-finite
    assert (all_nan["step_wide"], all_nan["nonfinite_samples"]) == (True, 3)
    assert "3 non-finite samples, every one listed: step-wide" in format_incident(all_nan)
    assert "top sample" not in format_incident(all_nan)
    one_bad = assess(_incident(3.0, [9.0, 2.5]))
    assert one_bad["step_wide"] is False and one_bad["samples"][0]["loss_over_step"] == 3.0
    for name, incident, skipped in (("high", high, set()), ("nan", all_nan, set()), ("bad", one_bad, {10})):
        path = tmp_path / name
        path.mkdir()
        (path / "incidents.jsonl").write_text(json.dumps(incident) + "\n")
        assert read_skip_list(str(path), per_incident=4) == skipped, name


def test_a_harder_dataset_is_not_blamed_for_being_hard(tmp_path):
    """A blend whose 'hard' corpus always runs above the step's loss: its ordinary samples are typical (their
    reference is their own dataset's other listed samples); one sample far above its dataset's is not."""
    from twinkle_megatron.tracker.incidents import assess

    def incident(hard_losses):
        samples = [{"sample_index": 20 + i, "dataset_id": 1, "dataset": "hard", "loss": value, "tokens": 7,
                    "step": 5, "complete": True} for i, value in enumerate(hard_losses)]
        samples.append({"sample_index": 99, "dataset_id": 0, "dataset": "easy", "loss": 0.45, "tokens": 7,
                        "step": 5, "complete": True})
        return assess({"step": 5, "reasons": ["loss_spike"], "loss": 1.6, "samples": samples,
                       "dataset_losses": {"easy": 0.41, "hard": 2.7}})

    ordinary = incident([2.9, 2.8, 2.75, 2.7])  # each > 1.5 x the step's 1.6, all like their own corpus
    assert ordinary["step_wide"] is True
    outlier = incident([9.0, 2.8, 2.75, 2.7])
    assert outlier["step_wide"] is False and outlier["samples"][0]["loss_over_step"] > 3
    for name, value, skipped in (("ordinary", ordinary, set()), ("outlier", outlier, {20})):
        path = tmp_path / name
        path.mkdir()
        (path / "incidents.jsonl").write_text(json.dumps(value) + "\n")
        assert read_skip_list(str(path), per_incident=5) == skipped, name
