"""Megatron-Bridge 0.6.2's own training code as the caller: its ``gpt_step.forward_step``, state injection and
``train_step``, unmodified (``kit/megatron_bridge.py``), on megatron-core's schedules on forked CPU ranks.

Both wirings a Bridge user writes: ``metrics.wrap(<the partial Bridge hands the schedule>)``, and
``metrics.wrap(forward_step)`` handed to Bridge, which injects its ``GlobalState`` (``prepare_forward_step_func``
reads the wrapped step's signature). Bridge fetches each microbatch, splits it over context-parallel ranks and
computes the loss itself; the metrics (``calculate()``) and the loss reports that Bridge's ``train_step`` pools
over DP×CP must equal the single-process reference of the same global batch, over all tokens and per dataset.

Run by ``make test-bridge`` (megatron-core 0.19.2 first on the path, ``TWINKLE_BRIDGE_TEST=1``); skipped
elsewhere, and skipped when the package index cannot be reached to download the wheel.
"""

from __future__ import annotations

import functools

import pytest
from kit.megatron_bridge import SKIP_REASON, TEST_ENABLED, bridge_for_tests
from kit.megatron_gpt import GPTSpec, blended_batch, blended_reference, build_gpt_model, local_microbatches
from megatron.core import parallel_state

from twinkle_megatron.megatron import instrument
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed

pytestmark = pytest.mark.skipif(not TEST_ENABLED, reason=SKIP_REASON)
BRIDGE = bridge_for_tests()
if TEST_ENABLED:
    from kit.bridge_config import ConfigContainer, ModelSettings
    from kit.megatron_bridge import global_state

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB, GLOBAL_BATCH, MICRO_BATCH = 60, 8, 2
GROUPS = ("web", "code", "math")
TIMEOUT = 180
WIRINGS = ("wrap the partial Bridge hands the schedule", "wrap forward_step, Bridge injects its state")


def _batch() -> dict:
    """What Bridge's data loader yields, for the whole global batch: full sequences (Bridge splits CP itself)
    and a ``dataset_id`` per sample (megatron-core's BlendedDataset)."""
    return blended_batch(SPEC, TRUE_VOCAB, GLOBAL_BATCH)


@functools.cache
def reference() -> dict:
    return blended_reference(SPEC, TRUE_VOCAB, GROUPS, TIMEOUT)


def _state():
    """Bridge's own GlobalState (no loggers configured)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return global_state(BRIDGE, ConfigContainer(ModelSettings(vpp, seq_length=SPEC.max_sequence_length),
                                                micro_batch_size=MICRO_BATCH,
                                                data_parallel_size=parallel_state.get_data_parallel_world_size()))


def _wired_step(metrics, state):
    return {WIRINGS[0]: lambda: metrics.wrap(BRIDGE.train_utils.prepare_forward_step_func(
                BRIDGE.gpt_step.forward_step, state)),
            WIRINGS[1]: lambda: BRIDGE.train_utils.prepare_forward_step_func(
                metrics.wrap(BRIDGE.gpt_step.forward_step), state)}


def _microbatches() -> list:
    """This rank's microbatches: the data-parallel split only (Bridge's get_batch does the CP split)."""
    return local_microbatches(_batch(), MICRO_BATCH, cp_size=1, cp_rank=0)


def _schedule(wiring: str, grouped: bool) -> dict:
    """One forward-backward pass of Bridge's forward_step through megatron-core's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        state = _state()
        metrics = instrument(chunks, vocab_size=TRUE_VOCAB, group_names=GROUPS if grouped else None)
        step = _wired_step(metrics, state)[wiring]()
        assert isinstance(step, functools.partial) and step.args == (state,) or wiring == WIRINGS[0]
        iterators = BRIDGE.train.make_data_iterator_list(model=chunks, data_iterator=iter(_microbatches()))
        get_forward_backward_func()(forward_step_func=step, data_iterator=iterators,
                                    model=chunks if len(chunks) > 1 else chunks[0],
                                    num_microbatches=len(_microbatches()), seq_length=SPEC.max_sequence_length,
                                    micro_batch_size=MICRO_BATCH)
        return metrics.calculate()


LAYOUTS = [Layout(tp=2, pp=2), Layout(pp=2, dp=2, vpp=2), Layout(tp=2, cp=2), Layout(cp=2, dp=2)]


@pytest.mark.parametrize("grouped", [False, True], ids=["global", "per_dataset"])
@pytest.mark.parametrize("wiring", WIRINGS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_both_wirings_equal_the_reference_on_every_layout(layout, wiring, grouped):
    want = reference()
    per_rank = run_distributed(_schedule, layout=layout, args=(wiring, grouped), timeout=TIMEOUT)
    assert all(r == per_rank[0] for r in per_rank), "every rank gets the same result"
    result = per_rank[0]
    keys = ["accuracy", "logprob", "entropy", "loss"]
    keys += [f"{key}/{group}" for key in keys for group in GROUPS] if grouped else []
    for key in keys:
        assert result[key] == pytest.approx(want[key], rel=1e-5), key
    assert result["total_tokens"] == want["total_tokens"]
    assert grouped or not any("/" in key for key in result)


# ------------------------------------------------------------------ Bridge's train_step pools the reports


class _NoUpdate:
    """The optimizer train_step calls: this test checks one step's reports, so the parameters stay as they are."""

    def zero_grad(self) -> None:
        pass

    def step(self) -> tuple:
        return True, None, None


class _Scheduler:
    def step(self, increment: int) -> None:
        pass


def _train_step(wiring: str) -> dict:
    """Bridge's train_step with instrument() given no model (Bridge's pretrain builds it): the statistics
    ride in the loss reports, which train_step pools over microbatches and DP×CP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        dp = parallel_state.get_data_parallel_world_size()
        init_num_microbatches_calculator(0, None, GLOBAL_BATCH, MICRO_BATCH, dp)
        model = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk,
                                         disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
        state = _state()
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS)  # no model: hooks attach at the first call
        step = _wired_step(metrics, state)[wiring]()
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        p2p = P2PCommunicator(pp_group=pg_collection.pp, config=chunks[0].config)
        loss_dict, skipped, *_ = BRIDGE.train.train_step(step, iter(_microbatches()), model, _NoUpdate(),
                                                         _Scheduler(), state, pg_collection,
                                                         get_forward_backward_func(), p2p)
        assert not skipped
        return {"reports": {key: float(value) for key, value in loss_dict.items()}, "calculated": metrics.calculate()}


@pytest.mark.parametrize("wiring", WIRINGS)
@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2, dp=2), Layout(pp=2, dp=2, vpp=2), Layout(tp=2, cp=2, dp=2)],
                         ids=str)
def test_bridges_train_step_pools_the_reports_into_the_reference(layout, wiring):
    want = reference()
    per_rank = run_distributed(_train_step, layout=layout, args=(wiring,), timeout=TIMEOUT)
    pooled = [r["reports"] for r in per_rank if r["reports"]]
    assert pooled and all(p == pooled[0] for p in pooled), "every last-stage rank (TP ranks too) logs the same"
    reports = pooled[0]
    assert reports["lm loss"] == pytest.approx(want["loss"], rel=1e-5)
    for key in ["accuracy", "logprob", "entropy"] + [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy")
                                                      for g in GROUPS]:
        assert reports[key] == pytest.approx(want[key], rel=1e-5), key
        assert per_rank[0]["calculated"][key] == pytest.approx(want[key], rel=1e-5), key
    for group in GROUPS:
        assert reports[f"lm loss/{group}"] == pytest.approx(want[f"loss/{group}"], rel=1e-5), group
