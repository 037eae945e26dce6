"""SampleLosses on packed rows (THD): one sample per packed sequence, its own tokens only.

The same eleven sequences go through a real megatron-core GPTModel (kit.megatron_packed's THD attention) with
``instrument()`` and SampleLosses, once unpacked (one right-padded row each, loss mask 0 on the padding) and
once packed four rows of THD sequences (``packed_seq_params`` with ``cu_seqlens`` and ``cu_seqlens_padded``;
the padding between sequences carries valid labels and loss mask 1, so only ``cu_seqlens_padded`` can leave it
out; each packed row's batch carries one ``sample_index`` and ``dataset_id`` per packed sequence). Under DP, PP
and CP (megatron-core's THD split: chunks ``i`` and ``2·cp−1−i`` of every sequence) the gathered top samples
equal the unpacked single-process ones: indices, datasets, losses, token counts.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kit.megatron_gpt import GPTSpec, build_gpt_model, gpt_forward_step, lm_loss_func, run_forward_backward
from kit.megatron_packed import packed_layer_spec, packed_seq_params
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from twinkle_megatron.megatron import instrument
from twinkle_megatron.metric import SampleLosses
from twinkle_megatron.testing.batches import thd_positions
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

GPT = GPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=16)
ROWS = [[3, 7, 4], [8, 2, 3], [5, 2, 3], [2, 9]]  # real lengths; each row padded to 16 (multiples of 4)
MULTIPLE, WIDTH = 4, 12  # THD padding to a multiple of 2·cp; the unpacked rows' width
COUNT = sum(len(row) for row in ROWS)
TOP_K = COUNT  # every sample kept: the comparison covers them all


def _sequences() -> list[dict]:
    g = torch.Generator().manual_seed(41)
    result = []
    for index, n in enumerate(n for row in ROWS for n in row):
        stream = torch.randint(0, GPT.vocab_size, (n + 1,), generator=g)
        loss_mask = torch.ones(n)
        loss_mask[0] = 0.0  # a prompt token
        result.append({"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask,
                       "sample_index": 500 + 3 * index, "dataset_id": index % 3})
    return result


def _unpacked() -> dict:
    """One row per sequence, right-padded to WIDTH with loss_mask 0."""
    sequences = _sequences()
    batch = {key: torch.zeros(COUNT, WIDTH, dtype=torch.long) for key in ("tokens", "labels")}
    batch["loss_mask"] = torch.zeros(COUNT, WIDTH)
    for row, sequence in enumerate(sequences):
        for key in ("tokens", "labels", "loss_mask"):
            batch[key][row, :len(sequence[key])] = sequence[key]
    batch["position_ids"] = torch.arange(WIDTH).repeat(COUNT, 1)
    batch["sample_index"] = torch.tensor([s["sample_index"] for s in sequences])
    batch["dataset_id"] = torch.tensor([s["dataset_id"] for s in sequences])
    return batch


def _packed_rows() -> list[dict]:
    """THD rows; the padding after each sequence has valid labels and loss_mask 1."""
    sequences = iter(_sequences())
    rows = []
    for lengths in ROWS:
        pieces: dict = {key: [] for key in ("tokens", "labels", "loss_mask", "position_ids")}
        padded, indices, datasets = [], [], []
        for n in lengths:
            sequence, width = next(sequences), -(-n // MULTIPLE) * MULTIPLE
            for key in ("tokens", "labels", "loss_mask"):
                pieces[key].append(torch.cat([sequence[key], torch.ones(width - n, dtype=sequence[key].dtype)]))
            pieces["position_ids"].append(torch.arange(width))
            padded.append(width)
            indices.append(sequence["sample_index"])
            datasets.append(sequence["dataset_id"])
        row = {key: torch.cat(values)[None] for key, values in pieces.items()}
        row["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        row["cu_seqlens_padded"] = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
        row["sample_index"], row["dataset_id"] = torch.tensor([indices]), torch.tensor([datasets])  # [1, n]
        rows.append(row)
    return rows


def _local_packed_microbatches() -> list[dict]:
    """This rank's packed rows (one per microbatch, Megatron's DP order), cut to its CP pieces of every sequence
    (megatron-core's ``get_thd_batch_on_this_cp_rank``); per-sequence entries and cu_seqlens whole."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    rows = _packed_rows()
    local = []
    for row in rows[dp_rank::dp]:
        index = thd_positions(row["cu_seqlens_padded"], cp, cp_rank)
        local.append({**row, **{key: row[key][:, index] for key in ("tokens", "labels", "loss_mask", "position_ids")}})
    return local


def _packed_forward_step(data_iterator, model):
    batch = next(data_iterator)
    params = packed_seq_params(batch["cu_seqlens"], batch["cu_seqlens_padded"])
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"], packed_seq_params=params)
    return output, functools.partial(lm_loss_func, batch["loss_mask"])


def _top_samples(packed: bool) -> list[dict]:
    with cpu_cuda_shim():
        chunks = build_gpt_model(GPT, layer_spec_fn=packed_layer_spec)
        samples = SampleLosses(top_k=TOP_K, dataset_names=["a", "b", "c"])
        with instrument(chunks, [samples]) as metrics:
            if packed:
                microbatches = _local_packed_microbatches()
                get_forward_backward_func()(
                    forward_step_func=metrics.wrap(_packed_forward_step),
                    data_iterator=[iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches),
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(microbatches),
                    seq_length=microbatches[0]["tokens"].shape[1], micro_batch_size=1, forward_only=True)
            else:
                run_forward_backward(chunks, _unpacked(), micro_batch_size=1, forward_only=True,
                                     forward_step_func=metrics.wrap(gpt_forward_step))
            samples.end_step(1)
            metrics.calculate()
            return samples.gather_top()


@functools.cache
def _unpacked_reference() -> list[dict]:
    return run_distributed(_top_samples, layout=Layout(), args=(False,), timeout=120)[0]


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(pp=2), Layout(cp=2), Layout(cp=2, dp=2)], ids=str)
def test_packed_sequences_are_the_samples(layout):
    want = _unpacked_reference()
    assert len(want) == COUNT and all(s["complete"] and s["nonfinite_tokens"] == 0 for s in want)
    assert [s["tokens"] for s in sorted(want, key=lambda s: s["sample_index"])] == \
        [n - 1 for row in ROWS for n in row]  # the real tokens of each sequence, its prompt token out
    per_rank = run_distributed(_top_samples, layout=layout, args=(True,), timeout=240)
    assert all(top == per_rank[0] for top in per_rank)
    got = per_rank[0]
    assert [s["sample_index"] for s in got] == [s["sample_index"] for s in want]
    for sample, expected in zip(got, want):
        assert sample == {**expected, "loss": pytest.approx(expected["loss"], rel=1e-5)}


# ------------------------------------------------------------------ the metric alone


def _packed_call(nan_in: int = -1) -> tuple[dict, dict]:
    """One packed row of three sequences (real 3, 5, 2; padded 4, 8, 4) with valid labels on the padding, per-token
    losses 1 + position; ``nan_in``: the sequence whose second token's loss is NaN."""
    cu, padded = torch.tensor([0, 3, 8, 10]), torch.tensor([0, 4, 12, 16])
    sequence = torch.repeat_interleave(torch.arange(3), padded.diff())
    losses = 1.0 + torch.arange(16, dtype=torch.float64)
    if nan_in >= 0:
        losses[int(padded[nan_in]) + 1] = math.nan
    inputs = {"labels": torch.ones(1, 16, dtype=torch.long), "cu_seqlens": cu, "cu_seqlens_padded": padded,
              "sample_index": torch.tensor([7, 8, 9]), "dataset_id": 1}
    assert sequence.numel() == 16
    return inputs, {"token_losses": losses[None]}


def test_a_packed_row_gives_one_sample_per_sequence_and_names_a_nonfinite_one():
    from twinkle_megatron.testing.guards import forbid_host_sync

    samples = SampleLosses(top_k=3)
    inputs, outputs = _packed_call(nan_in=2)
    with forbid_host_sync():
        samples.accumulate(inputs, outputs)
        samples.end_step(4)
    samples.calculate()
    top = samples.gather_top()
    assert [(s["sample_index"], s["dataset_id"], s["tokens"], s["nonfinite_tokens"]) for s in top] == \
        [(9, 1, 2, 1), (8, 1, 5, 0), (7, 1, 3, 0)]
    assert math.isnan(top[0]["loss"])
    assert top[1]["loss"] == pytest.approx((5 + 6 + 7 + 8 + 9) / 5) and top[2]["loss"] == pytest.approx(2.0)


def test_a_packed_row_needs_one_sample_index_per_sequence():
    samples = SampleLosses()
    inputs, outputs = _packed_call()
    with pytest.raises(ValueError, match="one sample_index per packed sequence"):
        samples.accumulate({**inputs, "sample_index": 7}, outputs)
    with pytest.raises(ValueError, match="one sample_index per packed sequence"):
        samples.accumulate({**inputs, "sample_index": torch.tensor([7, 8])}, outputs)
