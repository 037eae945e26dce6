"""Packed sequences (Megatron's THD rows with ``cu_seqlens``): each sub-sequence is a sequence.

The same eight sequences, packed two rows of four (each padded to a multiple of ``2·cp``, the padding given
valid labels so that only ``cu_seqlens`` can leave it out) or unpacked (one right-padded row each): GSPO's
sequence ratio, DPO's sequence log-probs (pairs of sub-sequences) and GRPO's token keys (with a rollout) on
the packed rows equal their single-process values on the unpacked ones, under DP and under CP (megatron-core's
THD split: chunks ``i`` and ``2·cp−1−i`` of every sequence), with their collective counts unchanged.
"""

from __future__ import annotations

import pytest
import torch
from kit.batches import RankView, thd_positions
from kit.distributed import Layout
from kit.invariance import Call, assert_layout_invariant, run_calls

from twinkle_megatron import DPOMetric, GRPOMetric, GSPOMetric

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
