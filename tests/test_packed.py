"""Packed sequences (Megatron's THD rows with ``cu_seqlens``): each sub-sequence is a sequence.

The same eight sequences, packed two rows of four (each padded to a multiple of ``2·cp``, the padding given
valid labels so that only ``cu_seqlens`` can leave it out) or unpacked (one right-padded row each): GSPO's
sequence ratio, DPO's sequence log-probs (pairs of sub-sequences) and GRPO's token keys (with a rollout) on
the packed rows equal their single-process values on the unpacked ones, under DP and under CP (megatron-core's
THD split: chunks ``i`` and ``2·cp−1−i`` of every sequence), with their collective counts unchanged.
"""

from __future__ import annotations

import functools

import pytest
import torch
from kit.megatron_gpt import GPTSpec, build_gpt_model, gpt_forward_step, lm_loss_func, run_forward_backward
from kit.megatron_packed import packed_layer_spec, packed_seq_params

from twinkle_megatron import DPOMetric, GRPOMetric, GSPOMetric
from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.batches import RankView, thd_positions
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.invariance import Call, assert_layout_invariant, assert_matches, run_calls

LENGTHS = [5, 9, 3, 12, 7, 4, 16, 2]  # real lengths; two packed rows of four sequences
PER_ROW, SEQ, MULTIPLE = 4, 16, 4
METRICS = {"gspo": lambda: GSPOMetric(epsilon=0.05, position_buckets=[0, 4, 16]),
           "dpo": lambda: DPOMetric(beta=0.5),
           "grpo": lambda: GRPOMetric(rollout_threshold=0.2, position_buckets=[0, 4, 16])}


def sequences() -> list[dict]:
    g = torch.Generator().manual_seed(21)
    result = []
    for index, n in enumerate(LENGTHS):
        labels = torch.randint(0, 30, (n,), generator=g)
        labels[:min(2, n - 1)] = -100  # the prompt
        logps = -torch.rand(n, generator=g, dtype=torch.float64) * 2
        result.append({"labels": labels, "logps": logps,
                       "old": logps + 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
                       "ref": logps + 0.3 * torch.randn(n, generator=g, dtype=torch.float64),
                       "rollout": logps + 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
                       "advantages": torch.full((n,), float(index % 3 - 1) + 0.5, dtype=torch.float64)})
    return result


KEYS = ("labels", "logps", "old", "ref", "rollout", "advantages")


def unpacked() -> dict:
    """One row per sequence, right-padded to SEQ with labels -100."""
    rows = {key: torch.zeros(len(LENGTHS), SEQ, dtype=torch.float64) for key in KEYS}
    rows["labels"] = torch.full((len(LENGTHS), SEQ), -100)
    for row, sequence in enumerate(sequences()):
        for key in KEYS:
            rows[key][row, :len(sequence[key])] = sequence[key]
    return rows


def packed() -> list[dict]:
    """Two THD rows; each sequence padded to a multiple of 4 with valid labels and finite values."""
    rows = []
    all_sequences = sequences()
    for first in range(0, len(LENGTHS), PER_ROW):
        pieces = {key: [] for key in KEYS}
        padded = []
        for sequence in all_sequences[first:first + PER_ROW]:
            n = len(sequence["labels"])
            width = -(-n // MULTIPLE) * MULTIPLE
            padded.append(width)
            for key in KEYS:
                filler = torch.full((width - n,), 7 if key == "labels" else -0.5, dtype=sequence[key].dtype)
                pieces[key].append(torch.cat([sequence[key], filler]))
        lengths = LENGTHS[first:first + PER_ROW]
        rows.append({**{key: torch.cat(values) for key, values in pieces.items()},
                     "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
                     "cu_seqlens_padded": torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])})
    return rows


def accumulate(metric, name: str, inputs, values: dict) -> Call:
    if name == "dpo":
        return Call(inputs, {"logps": values["logps"]}, {"ref_outputs": {"logps": values["ref"]}})
    return Call(inputs, {"logps": values["logps"]}, {"old_logps": values["old"], "advantages": values["advantages"],
                                                      "rollout_logps": values["rollout"]})


def unpacked_result(name: str) -> dict:
    metric, rows = METRICS[name](), unpacked()
    run_calls(metric, [accumulate(metric, name, {"labels": rows["labels"]}, rows)])
    return metric.calculate()


def feed_packed(metric, rows: list, view: RankView, name: str) -> list[Call]:
    if not view.last_stage:
        return []
    block = len(rows) // view.dp_size
    inputs, values = [], {key: [] for key in KEYS if key != "labels"}
    for row in rows[view.dp_rank * block:(view.dp_rank + 1) * block]:
        index = thd_positions(row["cu_seqlens_padded"], view.cp_size, view.cp_rank)
        inputs.append({"labels": row["labels"][index][None], "cu_seqlens": row["cu_seqlens"],
                       "cu_seqlens_padded": row["cu_seqlens_padded"]})
        for key in values:
            values[key].append(row[key][index][None])
    return [accumulate(metric, name, inputs, values)]


def collectives(layout: Layout, name: str) -> dict:
    """Per microbatch (one packed row), under CP: GSPO's and DPO's one sum of per-sequence partials."""
    rows = 2 // layout.dp
    return {"all_reduce": rows} if layout.cp > 1 and name in ("gspo", "dpo") else {}


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2), Layout(cp=2), Layout(cp=2, dp=2)], ids=str)
def test_packed_rows_give_the_unpacked_sequences_results(layout):
    names = tuple(METRICS)
    assert_layout_invariant(lambda name: METRICS[name](), packed(), [layout], feed=feed_packed, variants=names,
                            expected=lambda _, name: unpacked_result(name), rel=1e-9,
                            accumulate_collectives=collectives,
                            calculate_collectives={"all_reduce": 2} if layout.world_size > 1 else {})


def test_packed_rows_with_several_rows_or_group_ids_are_refused():
    row = packed()[0]
    metric = GSPOMetric()
    with pytest.raises(ValueError, match="one row of tokens"):
        metric.accumulate({"labels": row["labels"][None].expand(2, -1), "cu_seqlens": row["cu_seqlens"]},
                          {"logps": row["logps"][None].expand(2, -1)})
    grouped = DPOMetric(group_names=("a", "b"))
    with pytest.raises(ValueError, match="group ids of packed sub-sequences"):
        grouped.accumulate({"labels": row["labels"][None], "cu_seqlens": row["cu_seqlens"], "dataset_id": 0},
                           {"logps": row["logps"][None]})


# ------------------------------------------------------------------ through instrument() and GPTModel

GPT = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
ROWS = [[3, 7, 4], [8, 2, 3]]  # real lengths; padded to [4, 8, 4] and [8, 4, 4]: 16 positions per row
GPT_EDGES = [0, 2, 5, 8]


def _gpt_sequences() -> list[dict]:
    g = torch.Generator().manual_seed(31)
    result = []
    for n in (n for row in ROWS for n in row):
        stream = torch.randint(0, GPT.vocab_size, (n + 1,), generator=g)
        loss_mask = torch.ones(n)
        loss_mask[0] = 0.0  # a prompt token
        result.append({"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask})
    return result


def _gpt_unpacked() -> dict:
    """One row per sequence, right-padded to 8 with loss_mask 0."""
    sequences, width = _gpt_sequences(), 8
    batch = {key: torch.zeros(len(sequences), width, dtype=torch.long) for key in ("tokens", "labels")}
    batch["loss_mask"] = torch.zeros(len(sequences), width)
    for row, sequence in enumerate(sequences):
        for key in ("tokens", "labels", "loss_mask"):
            batch[key][row, :len(sequence[key])] = sequence[key]
    batch["position_ids"] = torch.arange(width).repeat(len(sequences), 1)
    return batch


def _gpt_packed() -> dict:
    """Two THD rows; the padding between sequences has valid labels and loss_mask 1: only cu_seqlens leaves it
    out of the token statistics."""
    sequences = iter(_gpt_sequences())
    rows: dict = {key: [] for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
                                      "cu_seqlens_padded")}
    for lengths in ROWS:
        pieces: dict = {key: [] for key in ("tokens", "labels", "loss_mask", "position_ids")}
        padded = [-(-n // 4) * 4 for n in lengths]
        for n, width in zip(lengths, padded):
            sequence = next(sequences)
            for key in ("tokens", "labels", "loss_mask"):
                filler = torch.full((width - n,), 1, dtype=sequence[key].dtype)
                pieces[key].append(torch.cat([sequence[key], filler]))
            pieces["position_ids"].append(torch.arange(width))
        for key, values in pieces.items():
            rows[key].append(torch.cat(values))
        rows["cu_seqlens"].append(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
        rows["cu_seqlens_padded"].append(torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()]))
    return {key: torch.stack(values) for key, values in rows.items()}


def _packed_forward_step(data_iterator, model):
    batch = next(data_iterator)
    params = packed_seq_params(batch["cu_seqlens"][0], batch["cu_seqlens_padded"][0])
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"], packed_seq_params=params)
    return output, functools.partial(lm_loss_func, batch["loss_mask"])


def _instrumented_gpt(packed_rows: bool) -> dict:
    with cpu_cuda_shim():
        chunks = build_gpt_model(GPT, layer_spec_fn=packed_layer_spec)
        with instrument(chunks, position_buckets=GPT_EDGES) as metrics:
            batch, step = (_gpt_packed(), _packed_forward_step) if packed_rows else (_gpt_unpacked(), gpt_forward_step)
            run_forward_backward(chunks, batch, micro_batch_size=1, forward_only=True,
                                 forward_step_func=metrics.wrap(step))
            return metrics.calculate()


@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(pp=2, dp=2)], ids=str)
def test_instrument_reads_packed_seq_params_from_the_model_call(layout):
    """Accuracy, log-prob, entropy and the per-position keys (loss/pos_* from GPTModel's per-token losses) of
    the packed rows equal those of the same sequences unpacked; Megatron's own `loss` report is not compared
    (its loss_mask counts the padding here, on purpose)."""
    want = run_distributed(_instrumented_gpt, layout=Layout(), args=(False,), timeout=120)[0]
    per_rank = run_distributed(_instrumented_gpt, layout=layout, args=(True,), timeout=120)
    assert all(result == per_rank[0] for result in per_rank)
    assert {f"loss/pos_{a}-{b - 1}" for a, b in zip(GPT_EDGES[:-1], GPT_EDGES[1:])} <= set(want)
    assert_matches(per_rank[0], want, rel=1e-5, ignore=("loss",))
