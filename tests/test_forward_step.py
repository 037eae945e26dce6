"""wrap(forward_step) finds the data iterator and the model by name; instrument() without a model; loss reports.

Through megatron-core's own schedules on forked CPU ranks (the tiny GPTModel of the
kit): a step whose first parameter is not the iterator (Megatron-Bridge's
``forward_step(state, data_iterator, model)``), wrapped before or after its state is
bound, keeps the per-dataset metrics equal to the single-process reference; so does
``instrument()`` with no model (Megatron-LM's ``pretrain()``), whose hooks attach to
the chunks the step receives, and whose loss reports, pooled the way Megatron-LM's
``train_step`` pools them, give the same numbers. Megatron-Bridge's real code runs in
``tests/bridge`` (``make test-bridge``).
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from kit.megatron_gpt import (
    GPTSpec,
    blended_batch,
    blended_reference,
    build_gpt_model,
    gpt_forward_step,
    pool_loss_reports,
    run_forward_backward,
)

from twinkle_megatron.megatron import MegatronInstrumentation, instrument
from twinkle_megatron.megatron.forward_step import StepSignature
from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim
from twinkle_megatron.testing.distributed import Layout, run_distributed
from twinkle_megatron.testing.guards import host_sync_free

SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
TRUE_VOCAB = 60
GROUPS = ("web", "code", "math")
TIMEOUT = 120


class State:
    """What Megatron-Bridge injects first: a step's own state (here: a count of its calls)."""

    def __init__(self) -> None:
        self.calls = 0


def stateful_step(state: State, data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-Bridge's form: the state first, then the iterator and the model."""
    state.calls += 1
    return gpt_forward_step(data_iterator, model)


def _batch() -> dict:
    return blended_batch(SPEC, TRUE_VOCAB)


@functools.cache
def reference() -> dict:
    return blended_reference(SPEC, TRUE_VOCAB, GROUPS, TIMEOUT)


def _wired(wiring: str, model_given: bool) -> dict:
    """One step through the schedule; ``wiring``: how the state reaches the step."""
    state = State()
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(chunks if model_given else None, vocab_size=TRUE_VOCAB, group_names=GROUPS)
        if wiring == "wrap the bound partial":
            step = metrics.wrap(functools.partial(stateful_step, state))
        else:  # wrap the step, then bind the state, as Megatron-Bridge's prepare_forward_step_func does
            step = functools.partial(metrics.wrap(stateful_step), state)
        reports = run_forward_backward(chunks, _batch(), micro_batch_size=2, forward_only=True, forward_step_func=step)
        return {"calculated": metrics.calculate(), "pooled": pool_loss_reports(reports), "calls": state.calls,
                "hooks": len(metrics._handles)}


WIRINGS = ["wrap the bound partial", "wrap the step, bind the state after"]


@pytest.mark.parametrize("wiring", WIRINGS)
@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(pp=2, dp=2, vpp=2)], ids=str)
def test_a_leading_state_parameter_keeps_per_dataset_metrics_right(layout, wiring):
    want = reference()
    per_rank = run_distributed(_wired, layout=layout, args=(wiring, True), timeout=TIMEOUT)
    assert all(r["calculated"] == per_rank[0]["calculated"] for r in per_rank)
    result = per_rank[0]["calculated"]
    for key in [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy", "loss") for g in GROUPS] + ["accuracy"]:
        assert result[key] == pytest.approx(want[key], rel=1e-5), key
    assert all(r["calls"] > 0 for r in per_rank), "the state reached the step"
    assert all(r["pooled"] is None or "accuracy" not in r["pooled"] for r in per_rank), \
        "with a model given, the reports stay Megatron's own (loss_reports defaults to off)"


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(pp=2, dp=2, vpp=2), Layout(tp=2, cp=2)], ids=str)
def test_without_a_model_hooks_attach_to_the_chunks_and_the_reports_carry_the_statistics(layout):
    want = reference()
    per_rank = run_distributed(_wired, layout=layout, args=("wrap the step, bind the state after", False),
                               timeout=TIMEOUT)
    assert all(r["calculated"] == per_rank[0]["calculated"] for r in per_rank)
    pooled = [r["pooled"] for r in per_rank if r["pooled"] is not None]
    assert pooled and all(p == pooled[0] for p in pooled), "every last-stage rank (TP ranks too) logs the same"
    for key in ["accuracy", "logprob", "entropy"] + [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy")
                                                      for g in GROUPS]:
        assert per_rank[0]["calculated"][key] == pytest.approx(want[key], rel=1e-5), key
        assert pooled[0][key] == pytest.approx(want[key], rel=1e-5), key
    for group in GROUPS:
        assert pooled[0][f"lm loss/{group}"] == pytest.approx(want[f"loss/{group}"], rel=1e-5), group
    assert pooled[0]["lm loss"] == pytest.approx(want["loss"], rel=1e-5)
    # One pre-hook and one output_layer hook per last-stage language model, attached once (not per microbatch).
    assert {r["hooks"] for r in per_rank} <= {0, 2}


# ------------------------------------------------------------------ refused at wrap(), not inside the schedule


def test_a_step_whose_iterator_cannot_be_found_is_refused_at_wrap():
    def by_other_names(batches, model):
        raise AssertionError("never called")

    grouped = instrument(torch.nn.Linear(2, 2), group_names=("a", "b"))
    with pytest.raises(TypeError, match=r"by_other_names\(batches, model\) has no parameter named 'data_iterator'"
                                        r".*to read each batch's 'dataset_id' \(group_names\)"):
        grouped.wrap(by_other_names)
    with pytest.raises(TypeError, match=r"\(\*args, \*\*kwargs\).*no parameter named 'data_iterator'"):
        grouped.wrap(lambda *args, **kwargs: None)
    with pytest.raises(TypeError, match=r"after what its functools.partial binds"):
        grouped.wrap(functools.partial(by_other_names, iter([])))
    with pytest.raises(TypeError, match=r"no parameter named 'model'.*instrument\(\) was given no model"):
        instrument().wrap(lambda data_iterator, net: None)
    # Nothing needs the iterator or the model: any step is accepted, as before.
    instrument(torch.nn.Linear(2, 2)).wrap(by_other_names)


def test_the_wrapped_step_keeps_the_signature_bridge_injects_its_state_by():
    wrapped = instrument().wrap(stateful_step)
    assert inspect.signature(wrapped) == inspect.signature(stateful_step)
    assert inspect.signature(wrapped, eval_str=True).parameters["state"].annotation is State
    assert wrapped.__name__ == "stateful_step"


def test_arguments_are_found_by_name_through_partials():
    def step(state, data_iterator, model, *, loss_func=None):
        return state, data_iterator, model, loss_func

    cases = [(functools.partial(step, "s"), ("it", "m"), {}),
             (functools.partial(functools.partial(step, "s"), loss_func="f"), ("it",), {"model": "m"}),
             (functools.partial(step, model="m", state="s"), (), {"data_iterator": "it"}),
             (functools.partial(step, "s", "it"), ("m",), {})]
    for func, args, kwargs in cases:
        signature = StepSignature.of(func)
        arguments = signature.bind(args, kwargs)
        assert (arguments.arguments["data_iterator"], arguments.arguments["model"]) == ("it", "m")
        assert signature.call(arguments)[:3] == func(*args, **kwargs)[:3] == ("s", "it", "m")


# ------------------------------------------------------------------ no host sync in the reports


class _Guarded(MegatronInstrumentation):
    _before_model = host_sync_free(MegatronInstrumentation._before_model)
    _after_output_layer = host_sync_free(MegatronInstrumentation._after_output_layer)
    _accumulate = host_sync_free(MegatronInstrumentation._accumulate)


def _guarded_reports() -> dict:
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = _Guarded(None, vocab_size=TRUE_VOCAB, group_names=GROUPS)
        reports = run_forward_backward(chunks, _batch(), micro_batch_size=2, forward_only=True,
                                       forward_step_func=metrics.wrap(gpt_forward_step))
        kinds = {key: (type(value).__name__, tuple(value.shape), str(value.dtype))
                 for report in reports for key, value in report.items()}
        return {"result": metrics.calculate(), "kinds": kinds, "keys": [list(r) for r in reports]}


def test_the_report_entries_are_device_tensors_built_without_a_host_sync():
    per_rank = run_distributed(_guarded_reports, layout=Layout(tp=2, pp=2), timeout=TIMEOUT)
    last = [r for r in per_rank if r["keys"]]
    assert last and per_rank[0]["result"]["total_tokens"] > 0  # calculate() raises if a hook synced
    for r in last:
        assert all(keys == r["keys"][0] for keys in r["keys"]), "every microbatch reports the same keys, in order"
        assert r["keys"][0][:4] == ["lm loss", "accuracy", "entropy", "logprob"]
        assert all(kind == ("Tensor", (2,), "torch.float32") for key, kind in r["kinds"].items() if key != "lm loss")


def _moe_without_a_model() -> list:
    import warnings

    from kit.megatron_moe import MoESpec, build_moe_model, moe_config

    spec = GPTSpec(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_sequence_length=8)
    with cpu_cuda_shim(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chunks = build_moe_model(spec, moe_config(spec, MoESpec(num_experts=4, topk=2), add_bias_linear=False))
        metrics = instrument(vocab_size=TRUE_VOCAB)
        step = metrics.wrap(gpt_forward_step)
        for _ in range(2):  # the warning comes once, at the first call with the chunk
            run_forward_backward(chunks, _batch(), micro_batch_size=2, forward_only=True, forward_step_func=step)
        assert metrics.moe is None and "moe/" not in " ".join(metrics.calculate())
    return [str(w.message) for w in caught if "MoE routing" in str(w.message)]


def test_outside_megatrons_own_loop_moe_routing_health_is_left_out_with_one_warning():
    """Without a model the routers are hooked through the step end of Megatron's own loop (pretrain()); a schedule
    run without it (no global arguments, no finalize_model_grads_func) leaves them out and says so once."""
    (messages,) = run_distributed(_moe_without_a_model, layout=Layout(), timeout=TIMEOUT)
    assert len(messages) == 1 and "need Megatron's own loop" in messages[0]


def megatron_lm_style_step(data_iterator, model):
    """Megatron-LM's ``get_batch_on_this_tp_rank``: TP rank 0 takes the batch from the iterator and broadcasts
    fixed keys (no ``dataset_id``) to the other TP ranks, which never read their iterator."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    batch = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    shared = [None if batch is None else {key: batch[key] for key in ("tokens", "labels", "loss_mask",
                                                                        "position_ids")}]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
    return gpt_forward_step(iter(shared), model)


def _tp_rank0_batches() -> dict:
    with cpu_cuda_shim():
        chunks = build_gpt_model(SPEC)
        metrics = instrument(vocab_size=TRUE_VOCAB, group_names=GROUPS)
        reports = run_forward_backward(chunks, _batch(), micro_batch_size=2, forward_only=True,
                                       forward_step_func=metrics.wrap(megatron_lm_style_step))
        return {"pooled": pool_loss_reports(reports), "calculated": metrics.calculate()}


def test_per_dataset_reports_under_tp_when_only_tp_rank_0_reads_the_batch():
    """The last rank writes Megatron-LM's log; its TP rank never saw a dataset_id: rank 0's ids reach it."""
    want = reference()
    per_rank = run_distributed(_tp_rank0_batches, layout=Layout(tp=2, pp=2), timeout=TIMEOUT)
    pooled = [r["pooled"] for r in per_rank if r["pooled"] is not None]
    assert len(pooled) == 2 and pooled[0] == pooled[1]
    for key in [f"{k}/{g}" for k in ("accuracy", "logprob", "entropy") for g in GROUPS]:
        assert pooled[1][key] == pytest.approx(want[key], rel=1e-5), key
        assert per_rank[0]["calculated"][key] == pytest.approx(want[key], rel=1e-5), key
    for group in GROUPS:
        assert pooled[1][f"lm loss/{group}"] == pytest.approx(want[f"loss/{group}"], rel=1e-5), group


# ------------------------------------------------------------------ mistakes told once where Megatron logs


def _without_dataset_id() -> dict:
    return {key: value for key, value in _batch().items() if key != "dataset_id"}


def _options(mistake: str) -> dict:
    from twinkle_megatron import GRPOMetric, LossMetric

    return {"labels outside vocab_size": dict(vocab_size=20),
            "group_names without dataset_id": dict(vocab_size=TRUE_VOCAB, group_names=GROUPS),
            # A metric passed in with its own buckets (the defaults' buckets go through Megatron's step end).
            "position_buckets": dict(metrics=[LossMetric(position_buckets=[0, 4, 8])]),
            "metrics the reports cannot carry": dict(metrics=[LossMetric(), GRPOMetric()]),
            "none": dict(vocab_size=TRUE_VOCAB, group_names=GROUPS)}[mistake]


MISTAKES = {  # mistake -> what its one warning says (None: no warning)
    "labels outside vocab_size": "lie outside the vocabulary (vocab_size=20)",
    "group_names without dataset_id": "batches carry no 'dataset_id'",
    "position_buckets": "cannot carry position_buckets=",
    "metrics the reports cannot carry": "cannot carry metrics=['GRPOMetric']",
    "none": None,
}


def _counted(calls: list, func, *args):
    calls.append(args)
    return func(*args)


def _pretrain_steps(steps: int = 3) -> dict:
    """Megatron-LM's pretrain() as its train_step runs, for each mistake: instrument() without a model, the wrapped
    Megatron-LM-style step (TP rank 0 reads the batch) through megatron-core's schedule with Megatron's DDP and
    optimizer, the reports pooled the way train_step pools them; nobody calls calculate().
    Returns the (step, message) of each of our warnings on this rank, per mistake, and how often it read the
    counts on the host."""
    import warnings

    import torch.distributed as dist
    from kit.megatron_training import build_trained_gpt, train_forward_backward

    seen = {}
    for mistake in MISTAKES:
        batch = _without_dataset_id() if mistake == "group_names without dataset_id" else _batch()
        with cpu_cuda_shim(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chunks, optimizer = build_trained_gpt(SPEC)
            metrics = instrument(**_options(mistake))
            step = metrics.wrap(megatron_lm_style_step)
            reads = []
            counts = metrics._checks.counts
            counts.at_step_start = functools.partial(_counted, reads, counts.at_step_start)
            told = []
            for index in range(steps):
                reports = train_forward_backward(chunks, batch, micro_batch_size=2, forward_step_func=step)
                pool_loss_reports(reports)
                optimizer.step()
                told += [(index, str(w.message)) for w in caught if "twinkle-megatron" in str(w.message)
                         and "twinkle_megatron" in w.filename]  # not megatron.core's: a filter of those keeps ours
                caught.clear()
            seen[mistake] = told
            seen[mistake, "reads per step"] = len(reads) / steps
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "seen": seen, "chunks": len(chunks)}


@pytest.mark.parametrize("layout", [Layout(tp=2, pp=2), Layout(pp=2, dp=2, vpp=2)], ids=str)
def test_mistakes_in_the_pretrain_path_warn_once_on_the_rank_that_logs(layout):
    per_rank = run_distributed(_pretrain_steps, layout=layout, timeout=TIMEOUT)
    for rank in per_rank:
        if rank["rank"] != rank["world"] - 1:
            assert all(not rank["seen"][mistake] for mistake in MISTAKES), f"rank {rank['rank']}: {rank['seen']}"
            continue
        # The counts are read on the host once per model chunk per step (its first microbatch), never per microbatch.
        assert all(rank["seen"][mistake, "reads per step"] == rank["chunks"] for mistake in MISTAKES), rank["seen"]
        for mistake, expected in MISTAKES.items():
            told = rank["seen"][mistake]
            if expected is None:
                assert told == [], told
                continue
            assert len(told) == 1 and expected in told[0][1], (mistake, told)
            # Options are known at the first call; data mistakes are read at the next step's start (CPU).
            assert told[0][0] == (0 if "cannot carry" in expected else 1), (mistake, told)


def test_step_starts_are_the_schedules_first_microbatches_or_every_doubling_of_the_calls():
    from twinkle_megatron.megatron.mistakes import StepStarts

    class Chunk(torch.nn.Module):  # what megatron-core's schedules number: the decoder layers
        def __init__(self) -> None:
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(1, 1)])

    chunk, starts = Chunk(), StepStarts()
    seen = []
    for microbatch in [0, 1, 2, 0, 1, 2]:
        chunk.decoder.layers[0].current_microbatch = microbatch
        seen.append(starts(chunk))
    assert seen == [True, False, False, True, False, False]
    unnumbered = StepStarts()  # no numbers (another schedule, no model): calls 1, 2, 4, 8
    assert [unnumbered(None) for _ in range(9)] == [True, True, False, True, False, False, False, True, False]
