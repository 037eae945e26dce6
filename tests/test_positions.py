"""Statistics by token position (``position_buckets``): each bucket equals a float64 reference on its tokens.

The reference of bucket ``[a, b)`` is plain torch in float64 on the global batch: the statistic over the
counted tokens whose position in their own sequence is in ``[a, b)``. Padded batches (each row a sequence)
and packed ones (Megatron's THD rows with ``cu_seqlens``: positions restart in every sub-sequence, the padding
between sequences never counts, even with valid labels) under TP, TP×PP×DP and CP×DP layouts (CP chunks
``i`` and ``2·cp−1−i`` of every row, or of every packed sequence), combined with ``group_names``; the buckets
travel in the same sync (collective counts unchanged); through ``instrument()`` and the real GPTModel too.
"""

from __future__ import annotations

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
from kit.references import full_vocab_stats

from twinkle_megatron import Accuracy, DPOMetric, LossMetric, MetricCollection, TokenStatsMetric
from twinkle_megatron.keys import parse_position_bucket_key, position_bucket_key
from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.batches import RankView, split_microbatches, thd_positions
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant

ROWS, SEQ, VOCAB, PADDED = 8, 16, 40, 48
EDGES = [0, 3, 8, 13, 16]  # crosses the CP chunks (4 positions each at cp=2)
GROUPS = ("web", "code")
LAYOUTS = [Layout(tp=2), Layout(tp=2, pp=2, dp=2), Layout(cp=2, dp=2)]


def _bucket(first: int, end: int) -> str:
    return f"pos_{first}-{end - 1}"


def padded_data() -> dict:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(ROWS, SEQ, PADDED, generator=g, dtype=torch.float64) * 2
    logits[..., VOCAB:] = 30.0
    labels = torch.where(torch.rand(ROWS, SEQ, generator=g) < 0.4, logits[..., :VOCAB].argmax(-1),
                         torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))
    labels[:, 0] = -100
    for row in range(ROWS):  # right padding of different lengths
        labels[row, SEQ - row:] = -100
    return {"logits": logits, "labels": labels, "positions": torch.arange(SEQ).expand(ROWS, SEQ),
            "token_loss": torch.rand(ROWS, SEQ, generator=g, dtype=torch.float64) * 3,
            "dataset_id": torch.tensor([0, 1, 1, 0, 0, 1, 0, 1])}


# Packed rows: real lengths of each row's sequences; each occupies a multiple of 4 = 2·cp positions.
PACKED = [[5, 8, 3], [7, 4], [12, 1, 6], [9, 9]]


def packed_data() -> dict:
    g = torch.Generator().manual_seed(8)
    rows = []
    for lengths in PACKED:
        padded = [-(-n // 4) * 4 for n in lengths]
        total = sum(padded)
        logits = torch.randn(total, PADDED, generator=g, dtype=torch.float64) * 2
        logits[:, VOCAB:] = 30.0
        labels = torch.randint(0, VOCAB, (total,), generator=g)  # padding gets valid labels too
        positions, real = torch.zeros(total, dtype=torch.long), torch.zeros(total, dtype=torch.bool)
        start = 0
        for n, width in zip(lengths, padded):
            positions[start:start + width] = torch.arange(width)
            real[start:start + n] = True
            labels[start] = -100  # a prompt token
            start += width
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
        rows.append({"logits": logits, "labels": labels, "positions": positions, "real": real,
                     "token_loss": torch.rand(total, generator=g, dtype=torch.float64) * 3,
                     "cu_seqlens": cu, "cu_seqlens_padded": cu_padded})
    return {"rows": rows}


def reference(logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, counted: torch.Tensor,
              token_loss: torch.Tensor, groups: torch.Tensor = None) -> dict:
    """Accuracy, log-prob, entropy and loss over the counted tokens, globally and per bucket (per group)."""
    stats = full_vocab_stats(logits, labels, VOCAB)
    correct = stats.argmax == labels

    def keys(mask: torch.Tensor, suffix: str = "") -> dict:
        if not mask.any():
            return {}
        total = int(mask.sum())
        return {f"accuracy{suffix}": int((correct & mask).sum()) / total,
                f"correct_tokens{suffix}": int((correct & mask).sum()), f"total_tokens{suffix}": total,
                f"logprob{suffix}": float(stats.logprobs[mask].mean()),
                f"entropy{suffix}": float(stats.entropy[mask].mean()),
                f"loss{suffix}": float(token_loss[mask].mean())}

    results = keys(counted)
    for first, end in zip(EDGES[:-1], EDGES[1:]):
        results.update(keys(counted & (positions >= first) & (positions < end), "/" + _bucket(first, end)))
    for index, group in enumerate(GROUPS if groups is not None else ()):
        results.update({key: value for key, value in keys(counted & (groups == index), "/" + group).items()
                        if key.startswith(("accuracy", "correct_tokens", "total_tokens"))})
    return results


def padded_reference() -> dict:
    d = padded_data()
    return reference(d["logits"], d["labels"], d["positions"], d["labels"] != -100, d["token_loss"],
                     d["dataset_id"][:, None].expand(ROWS, SEQ))


def packed_reference() -> dict:
    rows = packed_data()["rows"]
    cat = {key: torch.cat([row[key] for row in rows]) for key in ("logits", "labels", "positions", "real",
                                                                     "token_loss")}
    return reference(cat["logits"], cat["labels"], cat["positions"], cat["real"] & (cat["labels"] != -100),
                     cat["token_loss"])


def collection(grouped: bool = True) -> MetricCollection:
    groups = {"group_names": GROUPS} if grouped else {}
    return MetricCollection([Accuracy(vocab_size=VOCAB, position_buckets=EDGES, **groups),
                             TokenStatsMetric(vocab_size=VOCAB, position_buckets=EDGES),
                             LossMetric(position_buckets=EDGES)])


def feed_padded(metric, d: dict, view: RankView, splits: int) -> list[Call]:
    if not view.last_stage:
        return []
    split = lambda tensor: split_microbatches(tensor, splits)  # noqa: E731
    labels, loss = split(view.tokens(d["labels"])), split(view.tokens(d["token_loss"]))
    logits = split(view.vocab(view.tokens(d["logits"])))
    ids = split(view.rows(d["dataset_id"]))
    inputs = [{"labels": mb_labels, "dataset_id": mb_ids} for mb_labels, mb_ids in zip(labels, ids)]
    return [Call(inputs, {"logits": logits, "loss": loss})]


def local_packed_rows(d: dict, view: RankView) -> list[dict]:
    """This rank's packed rows (DP), each cut to its CP pieces of every sequence (THD)."""
    rows = d["rows"]
    block = len(rows) // view.dp_size
    local = []
    for row in rows[view.dp_rank * block:(view.dp_rank + 1) * block]:
        index = thd_positions(row["cu_seqlens_padded"], view.cp_size, view.cp_rank)
        local.append({**{key: row[key][index] for key in ("logits", "labels", "token_loss")},
                      "cu_seqlens": row["cu_seqlens"], "cu_seqlens_padded": row["cu_seqlens_padded"]})
    return local


def feed_packed(metric, d: dict, view: RankView, variant: str) -> list[Call]:
    if not view.last_stage:
        return []
    rows = local_packed_rows(d, view)
    inputs = [{"labels": row["labels"][None], "cu_seqlens": row["cu_seqlens"],
               "cu_seqlens_padded": row["cu_seqlens_padded"]} for row in rows]
    if variant == "sbv":  # Megatron's [s, b, v] logits of a packed row
        logits = [view.vocab(row["logits"])[:, None] for row in rows]
    else:
        logits = [view.vocab(row["logits"])[None] for row in rows]
    return [Call(inputs, {"logits": logits, "loss": [row["token_loss"][None] for row in rows]})]


def accumulate_collectives(layout: Layout, microbatches: int) -> dict:
    """The shared TP pass over the logits, two all-reduces per microbatch; the buckets add nothing."""
    return {"all_reduce": 2 * microbatches} if layout.tp > 1 else {}


def test_each_bucket_equals_its_float64_reference_in_one_process():
    from twinkle_megatron.testing.invariance import assert_matches, run_calls

    metric = collection()
    run_calls(metric, feed_padded(metric, padded_data(), RankView(), 2))
    assert_matches(metric.calculate(), padded_reference(), rel=1e-6)
    metric = collection(grouped=False)
    run_calls(metric, feed_packed(metric, packed_data(), RankView(), "bsv"))
    assert_matches(metric.calculate(), packed_reference(), rel=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_buckets_of_padded_batches_are_layout_invariant_in_the_same_sync(layout):
    assert_layout_invariant(lambda splits: collection(), padded_data(), [layout], feed=feed_padded,
                            variants=(1, 2), expected=lambda *_: padded_reference(), rel=1e-6,
                            accumulate_collectives=accumulate_collectives,
                            calculate_collectives={"all_reduce": 2})


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(cp=2, dp=2), Layout(tp=2, pp=2, dp=2)], ids=str)
def test_buckets_of_packed_batches_restart_in_every_sequence_and_skip_its_padding(layout):
    rows = len(PACKED) // layout.dp
    assert_layout_invariant(lambda variant: collection(grouped=False), packed_data(), [layout], feed=feed_packed,
                            variants=("bsv", "sbv"), expected=lambda *_: packed_reference(), rel=1e-6,
                            accumulate_collectives=lambda lay, _: accumulate_collectives(lay, rows),
                            calculate_collectives={"all_reduce": 2})


def test_equal_buckets_over_seq_length_and_bad_options():
    assert Accuracy(position_buckets=4, seq_length=16).position_buckets.edges == (0, 4, 8, 12, 16)
    assert Accuracy(position_buckets=[0, 512, 1024]).position_buckets.labels == ("pos_0-511", "pos_512-1023")
    for bad in ({"position_buckets": 4}, {"position_buckets": [3, 3]}, {"position_buckets": [-1, 4]},
                {"position_buckets": [5]}, {"position_buckets": 2.5}, {"position_buckets": 8, "seq_length": 4}):
        with pytest.raises(ValueError, match="position_buckets"):
            Accuracy(**bad)
    with pytest.raises(ValueError, match="no per-token statistics by position"):
        DPOMetric(position_buckets=[0, 4])
    with pytest.raises(TypeError, match="postion_buckets"):  # a misspelt option is not silently ignored
        instrument(torch.nn.Linear(2, 2), postion_buckets=4)
    # Positions past the last edge are in no bucket; the global statistics keep them.
    metric = Accuracy(position_buckets=[0, 2])
    metric.accumulate({"labels": torch.tensor([[1, 1, 1]])}, {"logits": torch.nn.functional.one_hot(
        torch.tensor([[1, 0, 1]]), 3).double()})
    assert metric.calculate() == {"accuracy": 2 / 3, "correct_tokens": 2, "total_tokens": 3,
                                  "accuracy/pos_0-1": 0.5, "correct_tokens/pos_0-1": 1, "total_tokens/pos_0-1": 2}


def test_packed_rows_are_refused_when_malformed_or_concatenated():
    metric = Accuracy(position_buckets=[0, 4])
    logits = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        metric.accumulate({"labels": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": torch.tensor([[0, 4]])},
                          {"logits": logits})
    with pytest.raises(ValueError, match="cannot be concatenated"):
        metric.accumulate([{"labels": torch.zeros(1, 2, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2])}] * 2,
                          {"logits": torch.zeros(2, 2, 3)}, logits_layout="bsv")


# ------------------------------------------------------------------ through instrument() and GPTModel

SPEC = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB = 60
GPT_EDGES = [0, 3, 5, 8]


def _gpt_batch() -> dict:
    batch = make_batch(SPEC, 8, seed=6)
    batch["labels"] = batch["labels"] % TRUE_VOCAB
    batch["tokens"] = batch["tokens"] % TRUE_VOCAB
    return batch


def _instrumented() -> dict:
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        with instrument(chunks, vocab_size=TRUE_VOCAB, position_buckets=GPT_EDGES) as metrics:
            run_forward_backward(chunks, _gpt_batch(), micro_batch_size=2, forward_only=True,
                                 forward_step_func=metrics.wrap(gpt_forward_step))
            return metrics.calculate()


def _gpt_reference() -> dict:
    batch = _gpt_batch()
    with cpu_cuda_shim():
        (model,) = build_gpt_model(SPEC)
        logits = reference_forward(model, batch).detach().double()
    mask = batch["loss_mask"].bool()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SPEC.vocab_size), batch["labels"].reshape(-1),
                                             reduction="none").reshape(mask.shape)
    stats = full_vocab_stats(logits, batch["labels"], TRUE_VOCAB)
    positions = torch.arange(mask.shape[1]).expand(mask.shape)
    results = {}
    for first, end in zip(GPT_EDGES[:-1], GPT_EDGES[1:]):
        bucket = mask & (positions >= first) & (positions < end)
        name = _bucket(first, end)
        results[f"accuracy/{name}"] = float(((stats.argmax == batch["labels"]) & bucket).sum() / bucket.sum())
        results[f"logprob/{name}"] = float(stats.logprobs[bucket].mean())
        results[f"loss/{name}"] = float(loss[bucket].mean())
    return results


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(tp=2, cp=2)], ids=str)
def test_instrument_reports_loss_accuracy_and_logprob_by_position(layout):
    want = run_distributed(_gpt_reference, layout=Layout(), timeout=120)[0]
    per_rank = run_distributed(_instrumented, layout=layout, timeout=120)
    assert all(result == per_rank[0] for result in per_rank)
    for key, value in want.items():
        assert per_rank[0][key] == pytest.approx(value, rel=1e-5), key


# ------------------------------------------------------------------ the chart


def test_plot_draws_the_loss_by_position_and_keeps_buckets_off_the_dataset_panel(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from twinkle_megatron.logging.runlog import load_run
    from twinkle_megatron.plots import dataset_panels, plot_run
    from twinkle_megatron.plots.positions import position_keys

    # The bucket names the metric writes (out of order in the log, one past 1000), beside a dataset's keys.
    names = LossMetric(position_buckets=[0, 512, 1024, 4096]).position_buckets.labels
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 2.0, f"loss/{names[2]}": 1.0, f"loss/{names[0]}": 2.0,
                                        f"loss/{names[1]}": 3.0 - step / 50, "loss/web": 2.5,
                                        "loss/pos_sim": 2.5}) + "\n" for step in range(1, 11)))
    log = load_run(str(path))
    assert position_keys(log) == [(0, 512, "loss/pos_0-511"), (512, 1024, "loss/pos_512-1023"),
                                  (1024, 4096, "loss/pos_1024-4095")]
    assert set(dataset_panels(log)[0].keys) == {"loss/web", "loss/pos_sim"}
    written, skipped = plot_run(log, str(tmp_path / "plots"))
    assert {"positions.png", "datasets.png"} <= {name.rsplit("/", 1)[-1] for name in written}


def test_the_bucket_name_is_read_back_by_its_one_parser():
    for first, end in [(0, 1), (0, 512), (512, 1024), (7, 4096)]:
        assert parse_position_bucket_key(position_bucket_key(first, end)) == (first, end)
    for other in ("web", "pos_sim", "pos_0-", "pos_a-b", "xpos_0-1", "pos_0-1/web", "loss/pos_0-1"):
        assert parse_position_bucket_key(other) is None
