"""Per-group (per-dataset) metrics: each group equals the metric on that group's data alone, under any layout.

The reference of group g is the same metric, without groups, in one process,
on the whole global batch with every sample of another group masked out
(labels -100): a group's statistic is by definition the statistic of its own
samples. Group ids come per sample (megatron-core's ``BlendedDataset`` gives
each sample a ``dataset_id``), one sample's id is outside the groups.
"""

from __future__ import annotations

import pytest
import torch
from kit.megatron_gpt import (
    GPTSpec,
    build_gpt_model,
    gpt_forward_step,
    lm_loss_func,
    make_batch,
    reference_forward,
    run_forward_backward,
)

from twinkle_megatron import (
    Accuracy,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    MetricCollection,
    MetricsTracker,
    TokenStatsMetric,
    TrackerConfig,
    TrainMetric,
)
from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.batches import RankView, split_microbatches
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, assert_matches, run_calls

ROWS, SEQ, VOCAB, PADDED = 8, 8, 40, 48
GROUPS = ("web", "code", "math")
IDS = torch.tensor([0, 1, 0, 2, 1, 1, 0, 7])  # row 7: an id outside the groups
LAYOUTS = [Layout(), Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)]


def data() -> dict:
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(ROWS, SEQ, PADDED, generator=generator, dtype=torch.float64) * 2
    logits[..., VOCAB:] = 30.0  # padding columns: never read
    labels = torch.where(torch.rand(ROWS, SEQ, generator=generator) < 0.5, logits[..., :VOCAB].argmax(-1),
                         torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator))
    labels[:, 0] = -100
    logps = torch.log_softmax(logits[..., :VOCAB], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return {"logits": logits, "labels": labels, "logps": logps,
            "old_logps": logps + 0.3 * torch.randn(ROWS, SEQ, generator=generator, dtype=torch.float64),
            "ref_logps": logps + 0.2 * torch.randn(ROWS, SEQ, generator=generator, dtype=torch.float64),
            "token_loss": torch.rand(ROWS, SEQ, generator=generator, dtype=torch.float64) * 3,
            "advantages": torch.randn(ROWS, generator=generator, dtype=torch.float64)}


def collections(group_names=()) -> list[MetricCollection]:
    kw = {"group_names": group_names} if group_names else {}
    square = {"vocab_size": VOCAB, "logits_layout": "bsv"}  # ROWS == SEQ: the layout is declared, not guessed
    return [MetricCollection([Accuracy(**square, **kw), TokenStatsMetric(**square, **kw),
                              LossMetric(**kw), GRPOMetric(**square, **kw), DPOMetric(**kw)]),
            MetricCollection([GSPOMetric(**square, **kw)])]


def calls(collection: MetricCollection, d: dict, num_microbatches: int, vocab_shard: slice = slice(None)) -> list[Call]:
    """The forms of the metrics' callers, per microbatch: logits (a vocab shard), per-token losses, logps..."""
    split = lambda key: split_microbatches(d[key], num_microbatches)  # noqa: E731
    inputs = [{"labels": labels, "dataset_id": ids} for labels, ids in zip(split("labels"), split("dataset_id"))]
    outputs = {"logits": [logits[..., vocab_shard] for logits in split("logits")], "loss": split("token_loss"),
               "logps": split("logps")}
    return [Call(inputs, outputs, {"old_logps": split("old_logps"), "advantages": d["advantages"],
                                   "ref_outputs": {"logps": split("ref_logps")}})]


def single_process(collection: MetricCollection, d: dict) -> dict:
    run_calls(collection, calls(collection, d, 1))
    return collection.calculate()


def reference(group: int) -> dict:
    """Every metric on the samples of ``group`` alone (one process)."""
    d = {**data(), "dataset_id": IDS.clone()}
    d["labels"][IDS != group] = -100
    results = {}
    for collection in collections():
        results.update(single_process(collection, d))
    return {key: value for key, value in results.items() if not key.startswith(("logps/", "rewards/"))}


def dpo_reference(group: int) -> dict:
    """DPO on the pairs of ``group`` alone: a (chosen, rejected) pair belongs to its chosen sample's group."""
    d = {**data(), "dataset_id": IDS.clone()}
    d["labels"][torch.repeat_interleave(IDS[0::2] != group, 2)] = -100
    metric = DPOMetric()
    metric.accumulate({"labels": d["labels"]}, {"logps": d["logps"]}, ref_outputs={"logps": d["ref_logps"]})
    return metric.calculate()


def test_each_group_equals_the_metric_on_that_groups_samples():
    results = {}
    for collection in collections(GROUPS):
        results.update(single_process(collection, {**data(), "dataset_id": IDS}))
    for index, group in enumerate(GROUPS):
        for key, value in {**reference(index), **dpo_reference(index)}.items():
            if key in ("nonfinite_tokens", "invalid_labels", "_high_kl_records"):
                continue
            assert results[f"{key}/{group}"] == pytest.approx(value, rel=1e-9, abs=1e-12), (group, key)
    # Row 7's id is outside [0, 3): its counted tokens are counted, and left out of every group.
    invalid = int((data()["labels"][7] != -100).sum())
    assert results["invalid_group_ids"] == invalid
    assert results["total_tokens"] == sum(results[f"total_tokens/{g}"] for g in GROUPS) + invalid


def _feed(collection: MetricCollection, d: dict, view: RankView, variant: tuple[int, int]) -> list[Call]:
    if not view.last_stage:
        return []
    local = {key: view.tokens(value) for key, value in d.items() if value.dim() >= 2}
    local["dataset_id"], local["advantages"] = view.rows(d["dataset_id"]), view.rows(d["advantages"])
    local["logits"] = view.vocab(local["logits"])
    return calls(collection, local, num_microbatches=variant[1])


def accumulate_collectives(layout: Layout, variant: tuple[int, int]) -> dict:
    """Per microbatch: the one shared TP pass over the logits (two all-reduces), and under CP the one sum of
    the per-sequence partials (DPO's log-ratios, GSPO's sequence means); the groups add none."""
    splits = variant[1]
    count = (2 * splits if layout.tp > 1 else 0) + (splits if layout.cp > 1 else 0)
    return {"all_reduce": count} if count else {}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_are_layout_invariant_and_travel_in_the_same_two_all_reduces(layout):
    assert_layout_invariant(lambda variant: collections(GROUPS)[variant[0]], {**data(), "dataset_id": IDS}, [layout],
                            feed=_feed, variants=[(index, splits) for index in (0, 1) for splits in (1, 2)],
                            rel=1e-9, accumulate_collectives=accumulate_collectives,
                            calculate_collectives={"all_reduce": 2} if layout.world_size > 1 else {})


def test_a_loss_per_microbatch_takes_one_group_id_per_microbatch():
    metric = LossMetric(group_names=GROUPS)
    metric.accumulate([{"dataset_id": 0}, {"dataset_id": 2}], {"loss": [6.0, 4.0], "num_tokens": [3, 1]},
                      loss_reduction="sum")
    assert metric.calculate() == {"loss": 2.5, "loss/web": 2.0, "loss/math": 4.0}
    with pytest.raises(ValueError, match="needs one group id for the whole microbatch"):
        metric.accumulate({"dataset_id": torch.tensor([0, 1])}, {"loss": 6.0, "num_tokens": 3},
                          loss_reduction="sum")


def test_one_id_per_microbatch_with_whole_batch_outputs_applies_to_that_microbatchs_rows():
    labels = torch.tensor([[1, 2], [3, 4], [5, 6]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 0], [3, 4], [5, 0]]), 8).double()
    metric = Accuracy(group_names=("a", "b"))
    metric.accumulate([{"labels": labels[:1], "dataset_id": 0}, {"labels": labels[1:], "dataset_id": 1}],
                      {"logits": logits})
    result = metric.calculate()
    assert (result["correct_tokens/a"], result["total_tokens/a"]) == (1, 2)
    assert (result["correct_tokens/b"], result["total_tokens/b"]) == (3, 4)
    # Without rows to repeat the ids over, differing ids cannot be applied to one whole-batch loss.
    loss = LossMetric(group_names=GROUPS)
    with pytest.raises(ValueError, match=r"'dataset_id'.*cannot be concatenated over microbatches"):
        loss.accumulate([{"dataset_id": 0}, {"dataset_id": 2}], {"loss": 3.0})
    # A key some microbatches lack would be applied to the wrong rows: refused.
    with pytest.raises(ValueError, match="'completion_mask'] is given for some microbatches only"):
        metric.accumulate([{"labels": labels[:1]}, {"labels": labels[1:], "completion_mask": torch.ones(2, 2)}],
                          {"logits": logits})


def test_ids_outside_the_groups_are_counted_in_tokens_by_every_metric():
    """Megatron's per-microbatch reports and the logits of the same microbatches: the loss metric and the
    logits metrics count the same tokens with an id outside the groups, so the collection reports one count."""
    labels = torch.tensor([[1, 2, -100], [3, 4, 5]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 0, 0], [3, 4, 0]]), 8).double()
    logits[1, 2] = float("nan")  # a non-finite token is still a token with an invalid id
    collection = MetricCollection([Accuracy(group_names=GROUPS), LossMetric(group_names=GROUPS)])
    collection.accumulate([{"labels": labels[:1], "dataset_id": 0}, {"labels": labels[1:], "dataset_id": 5}],
                          {"logits": [logits[:1], logits[1:]], "loss": [4.0, 9.0], "num_tokens": [2, 3]},
                          loss_reduction="sum")
    result = collection.calculate()
    assert result["invalid_group_ids"] == 3
    assert (result["loss"], result["loss/web"]) == (13.0 / 5, 2.0)


def test_group_ids_as_a_keyword_and_per_token():
    labels = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0], [4, 0, 6]]), 8).double()
    per_token = torch.tensor([[0, 0, 1], [1, 1, 1]])
    metric = Accuracy(group_names=("a", "b"))
    metric.accumulate({"labels": labels}, {"logits": logits}, group_ids=per_token)
    result = metric.calculate()
    assert (result["correct_tokens/a"], result["total_tokens/a"]) == (2, 2)
    assert (result["correct_tokens/b"], result["total_tokens/b"]) == (2, 4)


def test_bad_group_names_and_ids_are_refused():
    for names in (["a", "a"], ["a/b"], [""]):
        with pytest.raises(ValueError, match="group names must be"):
            Accuracy(group_names=names)
    metric = Accuracy(group_names=("a",))
    with pytest.raises(ValueError, match="group ids have shape"):
        metric.accumulate({"labels": torch.ones(2, 3, dtype=torch.long),
                           "dataset_id": torch.zeros(3, dtype=torch.long)}, {"logits": torch.zeros(2, 3, 4)})
    with pytest.raises(ValueError, match="group ids must be integers"):
        metric.accumulate({"labels": torch.ones(2, 3, dtype=torch.long), "dataset_id": torch.zeros(2)},
                          {"logits": torch.zeros(2, 3, 4)})
    assert Accuracy().group_names == ()
    # Metrics without per-group statistics refuse groups rather than report nothing per group.
    for metric in (EmbeddingMetric(group_names=("a",)), TrainMetric(group_names=("a",)),
                   CompletionRewardMetric(group_names=("a",))):
        with pytest.raises(ValueError, match="has no per-group statistics"):
            metric.accumulate({}, {})


# ------------------------------------------------------------------ through instrument() and the schedules

SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB = 60
BLEND_IDS = torch.tensor([0, 1, 1, 0, 2, 0, 1, 2])  # one dataset_id per sample, as a BlendedDataset gives


def _gpt_batch() -> dict:
    batch = make_batch(SPEC, 8, seed=4)
    batch["labels"] = batch["labels"] % TRUE_VOCAB
    batch["tokens"] = batch["tokens"] % TRUE_VOCAB
    batch["dataset_id"] = BLEND_IDS
    return batch


def _instrumented() -> dict:
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        with instrument(chunks, vocab_size=TRUE_VOCAB, group_names=GROUPS) as metrics:
            run_forward_backward(chunks, _gpt_batch(), micro_batch_size=2, forward_only=True,
                                 forward_step_func=metrics.wrap(gpt_forward_step))
            return metrics.calculate()


def _recorded_by_hand() -> dict:
    """A custom forward_step feeding the metrics itself (``record_microbatch``): the logits from a hook on
    the last stage's logits, the loss report, per-token losses and the batch's dataset ids in its loss_func."""
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        with instrument(chunks, vocab_size=TRUE_VOCAB, group_names=GROUPS) as metrics:
            def on_logits(logits: torch.Tensor, batch: dict) -> None:
                metrics.record_microbatch(logits=logits, labels=batch["labels"], loss_mask=batch["loss_mask"],
                                          group_ids=batch["dataset_id"])

            def forward_step(data_iterator, model):
                batch = next(data_iterator)
                output, _ = gpt_forward_step(iter([batch]), model, logits_hook=on_logits)

                def loss_func(output_tensor: torch.Tensor):
                    loss, num_tokens, report = lm_loss_func(batch["loss_mask"], output_tensor)
                    metrics.record_microbatch(labels=batch["labels"], loss_mask=batch["loss_mask"],
                                              loss=report["lm loss"][0], num_tokens=report["lm loss"][1],
                                              group_ids=batch["dataset_id"], token_losses=output_tensor)
                    return loss, num_tokens, report
                return output, loss_func

            run_forward_backward(chunks, _gpt_batch(), micro_batch_size=2, forward_only=True,
                                 forward_step_func=forward_step)
            return metrics.calculate()


def _tracked(group_names: tuple) -> dict:
    """The README's tracker recipe: the tracker pools Megatron's reports, the instrumented metrics report too."""
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        with instrument(chunks, vocab_size=TRUE_VOCAB, group_names=group_names) as metrics:
            tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=()), metrics=metrics.metrics)
            with tracker.step(1) as values:
                reports = run_forward_backward(chunks, _gpt_batch(), micro_batch_size=2, forward_only=True,
                                               forward_step_func=metrics.wrap(gpt_forward_step))
                values.update(loss=reports)
            return tracker.last_record


def _reference_per_group() -> dict:
    batch = _gpt_batch()
    with cpu_cuda_shim():
        (model,) = build_gpt_model(SPEC)
        logits = reference_forward(model, batch).detach().double()
    results = {}
    for index, group in enumerate(GROUPS):
        mask = batch["loss_mask"].bool() & (BLEND_IDS == index)[:, None]
        full = logits[..., :TRUE_VOCAB]
        logprobs = full.log_softmax(-1)
        label_logprobs = logprobs.gather(-1, batch["labels"][..., None])[..., 0]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC.vocab_size), batch["labels"].reshape(-1),
                                                 reduction="none").reshape(mask.shape)
        results[group] = {"total_tokens": int(mask.sum()),
                          "correct_tokens": int(((full.argmax(-1) == batch["labels"]) & mask).sum()),
                          "logprob": float(label_logprobs[mask].mean()),
                          "entropy": float(-(logprobs.exp() * logprobs).sum(-1)[mask].mean()),
                          "loss": float(loss[mask].mean())}
    return results


def test_with_groups_the_loss_stays_megatrons_and_the_tracker_agrees():
    """The per-group losses come from GPTModel's per-token losses; ``loss`` itself stays the pooled
    ``[sum, count]`` reports, exactly what the tracker pools from the same reports (no clash in the merge)."""
    grouped = run_distributed(_tracked, layout=Layout(pp=2, dp=2), args=(GROUPS,), timeout=120)
    plain = run_distributed(_tracked, layout=Layout(pp=2, dp=2), args=((),), timeout=120)
    assert grouped[0]["loss"] == plain[0]["loss"]
    assert {f"loss/{group}" for group in GROUPS} <= set(grouped[0])


def test_a_custom_forward_step_records_its_groups_by_hand():
    by_hand = run_distributed(_recorded_by_hand, layout=Layout(tp=2, pp=2), timeout=120)
    wrapped = run_distributed(_instrumented, layout=Layout(tp=2, pp=2), timeout=120)
    assert all(result == by_hand[0] for result in by_hand)
    assert {f"loss/{group}" for group in GROUPS} | {f"accuracy/{group}" for group in GROUPS} <= set(by_hand[0])
    assert_matches(by_hand[0], wrapped[0], rel=1e-6)


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(pp=2, dp=2)], ids=str)
def test_instrument_reads_each_samples_dataset_id_from_its_batch(layout):
    want = run_distributed(_reference_per_group, layout=Layout(), timeout=120)[0]
    per_rank = run_distributed(_instrumented, layout=layout, timeout=120)
    assert all(r == per_rank[0] for r in per_rank)
    for group in GROUPS:
        for key, value in want[group].items():
            assert per_rank[0][f"{key}/{group}"] == pytest.approx(value, rel=1e-5), (group, key)
