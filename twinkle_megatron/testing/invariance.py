"""Layout invariance in one call: :func:`assert_layout_invariant`, a metric on every layout against one process.

The same global batch must give the same metrics on every TP × PP × CP × DP
layout as in a single process, on every rank, whatever the microbatch split.
The caller says how its metric is fed (a ``feed`` that turns this rank's
:class:`~twinkle_megatron.testing.batches.RankView` of the global batch into
``accumulate`` calls); the helper runs that feed on each layout with forked
CPU gloo ranks and megatron-core's ``parallel_state``
(:mod:`~twinkle_megatron.testing.distributed`), with host syncs forbidden (or
counted) in ``accumulate`` and the collectives of ``accumulate`` and
``calculate`` counted at the dispatcher (:mod:`~twinkle_megatron.testing.guards`),
and compares every rank's ``calculate()`` with the single process's.

Works for the built-in metrics and for a metric of your own written Twinkle's
way (``accumulate`` / ``calculate`` / ``reset``, ``gather_results``): see
docs/testing.md. Needs megatron-core (imported when the ranks start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

from ..parallel import Layout
from .batches import RankView
from .distributed import run_distributed
from .guards import Guard, count_collectives

# Every kind of parallelism on at most four CPU ranks: data; tensor with pipeline; context with data.
LAYOUTS = (Layout(dp=2), Layout(tp=2, pp=2), Layout(cp=2, dp=2))
ABSOLUTE_TOLERANCE = 1e-12  # below this a difference is no difference (pytest.approx's default)


class Call(NamedTuple):
    """One ``metric.accumulate(inputs, outputs, **keywords)`` call; ``metric`` None: the metric under test."""

    inputs: Any
    outputs: Any
    keywords: Mapping[str, Any] = {}
    metric: Any = None


def run_calls(metric: Any, calls: Sequence[Call]) -> None:
    """Make the ``calls`` (each on its own ``metric`` when it names one)."""
    for call in calls:
        target = metric if call.metric is None else call.metric
        target.accumulate(call.inputs, call.outputs, **call.keywords)


@dataclass(frozen=True)
class RankRun:
    """What one rank did for one variant: its result, and the collectives (by name) of each phase."""

    result: dict
    accumulate_collectives: dict
    calculate_collectives: dict
    fed: bool  # whether this rank made any accumulate call
    host_syncs: tuple = ()  # what made the host wait inside accumulate (only when host syncs are allowed)
    calls: int = 0  # how many accumulate calls this rank made


Feed = Callable[[Any, Any, RankView, Any], Sequence[Call]]
Expected = Union[Mapping[str, Any], Callable[[Layout, Any], Mapping[str, Any]]]
Counts = Union[Mapping[str, int], Callable[[Layout, Any], Mapping[str, int]]]


def run_variants(metric_factory: Callable[[Any], Any], batch: Any, feed: Feed, variants: Sequence[Any],
                 view: RankView, allow_host_syncs: bool = False) -> list[RankRun]:
    """On this rank: for each variant, a fresh metric, fed this rank's view of ``batch``, then ``calculate()``."""
    runs = []
    for variant in variants:
        metric = metric_factory(variant)
        calls = list(feed(metric, batch, view, variant))
        with Guard(forbid=not allow_host_syncs).active() as guard:
            run_calls(metric, calls)
        with count_collectives() as calculated:
            result = metric.calculate()
        runs.append(RankRun(result, dict(guard.collectives), dict(calculated), bool(calls), tuple(guard.host_syncs),
                            len(calls)))
    return runs


def _on_megatron_rank(metric_factory: Callable[[Any], Any], batch: Any, feed: Feed, variants: Sequence[Any],
                      allow_host_syncs: bool) -> list[RankRun]:
    return run_variants(metric_factory, batch, feed, variants, RankView.megatron(), allow_host_syncs)


def _at(value: Any, layout: Layout, variant: Any) -> Any:
    return value(layout, variant) if callable(value) else value


def assert_layout_invariant(metric_factory: Callable[[Any], Any], batch: Any, layouts: Sequence[Layout] = LAYOUTS, *,
                            feed: Feed, variants: Sequence[Any] = (None,), expected: Optional[Expected] = None,
                            rel: float = 1e-5, rel_for: Optional[Mapping[str, float]] = None,
                            ignore: Sequence[str] = (), accumulate_collectives: Optional[Counts] = None,
                            calculate_collectives: Optional[Counts] = None, allow_host_syncs: bool = False,
                            host_syncs_per_call: Optional[int] = None, variants_agree: bool = False,
                            timeout: float = 60.0) -> dict[Layout, list[list[RankRun]]]:
    """Run a metric fed the way its caller feeds it on each layout; every rank must report the single-process result.

    For each ``layout`` (megatron-core ``parallel_state`` over forked gloo ranks; by default :data:`LAYOUTS`:
    DP=2, TP=2 × PP=2, CP=2 × DP=2) and each of ``variants`` (microbatch splits, input forms...; all variants
    of a layout run in one set of workers), every rank builds ``metric_factory(variant)`` (a ``Metric``, a
    ``MetricCollection``, anything with ``accumulate`` and ``calculate``), asks ``feed(metric, batch, view,
    variant)`` for this rank's ``accumulate`` calls (:class:`Call`; ``view`` is the rank's
    :class:`~twinkle_megatron.testing.batches.RankView`: its DP rows, CP chunks, TP vocab columns, whether it
    is the last stage), makes them with host syncs forbidden (``allow_host_syncs``: counted instead, for
    metrics that sync on purpose, such as one written Twinkle's way), and calls ``calculate()``. Then:

    * every rank returns the same dict, exactly;
    * that dict matches the reference (:func:`assert_matches`: the same keys but ``ignore``, counts and
      other non-floats exactly, floats within ``rel``, or ``rel_for[key]``). The reference is ``expected``
      (a dict, or a function of ``(layout, variant)``), by default the same factory and feed in this
      process on the whole batch (``RankView()``: a single process, no parallel_state);
    * ``accumulate_collectives`` (a ``{name: count}`` dict or a function of ``(layout, variant)``), when
      given, is what each rank that made calls issued inside ``accumulate``; a rank that made none issued
      none. ``calculate_collectives`` is what every rank issued inside ``calculate()``;
    * ``host_syncs_per_call``, when given (it allows host syncs), is how many host syncs each
      ``accumulate`` call made, on every rank, in every variant;
    * ``variants_agree``: the variants are only other ways of feeding the same batch (microbatch
      splits, input forms), so every variant reports what the first reports (in the single process,
      and on every layout), within the same tolerances.

    A failure raises ``AssertionError`` naming the layout, the variant, the key and both values.
    ``batch`` is the global batch (any object; forked workers inherit it). Returns every layout's runs,
    ``runs[layout][rank][variant index]`` (:class:`RankRun`: the result, the collectives of each phase,
    the host syncs), for checks of the caller's own.

    A metric written Twinkle's way, fed its label tokens in 1 and 2 microbatches on two layouts:

    >>> import torch
    >>> from twinkle_megatron import Metric
    >>> from twinkle_megatron.parallel import Layout
    >>> from twinkle_megatron.testing.batches import split_microbatches
    >>> class LabelTokens(Metric):
    ...     def __init__(self, device_mesh=None, process_group=None, **kwargs):
    ...         super().__init__(device_mesh, process_group, **kwargs)
    ...         self.reset()
    ...     def accumulate(self, inputs, outputs):
    ...         self.tokens += int((inputs["labels"] != -100).sum())  # one host sync per call (counted)
    ...     def calculate(self):
    ...         tokens = sum(self.gather_results([self.tokens]))  # every DP (and CP) rank's count
    ...         self.reset()
    ...         return {"label_tokens": tokens}
    ...     def reset(self):
    ...         self.tokens = 0
    >>> labels = torch.tensor([[1, 2, -100, -100], [3, 4, 5, -100], [6, -100, -100, -100], [7, 8, 9, 10]])
    >>> def feed(metric, labels, view, microbatches):  # this rank's rows and sequence chunks, if last stage
    ...     if not view.last_stage:
    ...         return []
    ...     return [Call({"labels": part}, {}) for part in split_microbatches(view.tokens(labels), microbatches)]
    >>> runs = assert_layout_invariant(lambda _: LabelTokens(), labels, [Layout(dp=2), Layout(cp=2)], feed=feed,
    ...                                variants=(1, 2), host_syncs_per_call=1)
    >>> rank0 = runs[Layout(dp=2)][0]  # rank 0's runs, one per variant
    >>> [(run.result, run.calculate_collectives, len(run.host_syncs)) for run in rank0]
    [({'label_tokens': 10}, {'all_gather': 2}, 1), ({'label_tokens': 10}, {'all_gather': 2}, 2)]
    """
    variants = tuple(variants)
    allow_host_syncs = allow_host_syncs or host_syncs_per_call is not None
    single = None if expected is not None else run_variants(metric_factory, batch, feed, variants, RankView(),
                                                            allow_host_syncs)
    if single is not None and variants_agree:
        _assert_variants_agree([run.result for run in single], variants, "single process", rel, rel_for, ignore)
    everything = {}
    for layout in layouts:
        per_rank = run_distributed(_on_megatron_rank, layout=layout, timeout=timeout,
                                   args=(metric_factory, batch, feed, variants, allow_host_syncs))
        if variants_agree and single is None:  # else: each variant matches the single process's, which agree
            _assert_variants_agree([run.result for run in per_rank[0]], variants, str(layout), rel, rel_for, ignore)
        for index, variant in enumerate(variants):
            where = f"{layout}, variant {variant!r}"
            runs = [rank_runs[index] for rank_runs in per_rank]
            first = runs[0].result
            for rank, run in enumerate(runs):
                assert run.result == first, f"{where}: rank {rank} reports {run.result}, rank 0 {first}"
            want = single[index].result if single is not None else _at(expected, layout, variant)
            source = "the single process" if single is not None else "expected"
            assert_matches(first, want, rel=rel, rel_for=rel_for, ignore=ignore, where=where, source=source)
            for rank, run in enumerate(runs):
                if accumulate_collectives is not None:
                    want_counts = dict(_at(accumulate_collectives, layout, variant)) if run.fed else {}
                    assert run.accumulate_collectives == want_counts, \
                        f"{where}: rank {rank} issued {run.accumulate_collectives} in accumulate, not {want_counts}"
                if calculate_collectives is not None:
                    want_counts = dict(_at(calculate_collectives, layout, variant))
                    assert run.calculate_collectives == want_counts, \
                        f"{where}: rank {rank} issued {run.calculate_collectives} in calculate, not {want_counts}"
                if host_syncs_per_call is not None:
                    assert len(run.host_syncs) == host_syncs_per_call * run.calls, \
                        f"{where}: rank {rank} made {len(run.host_syncs)} host syncs in {run.calls} accumulate " \
                        f"calls, not {host_syncs_per_call} per call: {list(run.host_syncs)}"
        everything[layout] = per_rank
    return everything


def _assert_variants_agree(results: Sequence[Mapping[str, Any]], variants: Sequence[Any], where: str, rel: float,
                           rel_for: Optional[Mapping[str, float]], ignore: Sequence[str]) -> None:
    for result, variant in zip(results[1:], variants[1:]):
        assert_matches(result, results[0], rel=rel, rel_for=rel_for, ignore=ignore,
                       where=f"{where}, variant {variant!r}", source=f"variant {variants[0]!r}")


def calculate_or_error(metric: Any, error: type[Exception]) -> Union[dict, str]:
    """``metric.calculate()``, or the message of the ``error`` it raised (for tests that a failure on some
    ranks is reported on every rank)."""
    try:
        return metric.calculate()
    except error as raised:
        return str(raised)


def assert_matches(got: Mapping[str, Any], want: Mapping[str, Any], *, rel: float = 1e-5,
                   rel_for: Optional[Mapping[str, float]] = None, ignore: Sequence[str] = (),
                   where: str = "", source: str = "expected") -> None:
    """``got`` reports what ``want`` says: the same keys (but ``ignore``); floats within ``rel`` (relative to
    ``want``, or :data:`ABSOLUTE_TOLERANCE`, as ``pytest.approx``; ``rel=0``: exactly) or ``rel_for[key]``;
    ints, bools and strings exactly; lists and dicts (records) item by item with their key's tolerance.
    ``source`` names ``want`` in the message (``the single process``)."""
    got = {key: value for key, value in got.items() if key not in ignore}
    want = {key: value for key, value in want.items() if key not in ignore}
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {source}'s {sorted(want)}"
    for key, value in want.items():
        _match(got[key], value, (rel_for or {}).get(key, rel), f"{where} [{key!r}]", source)


def _close(got: Any, want: float, rel: float) -> bool:
    if not isinstance(got, Real) or isinstance(got, bool):
        return False
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= max(rel * abs(want), ABSOLUTE_TOLERANCE)  # NaN is close to nothing


def _match(got: Any, want: Any, rel: float, where: str, source: str) -> None:
    mismatch = f"{where}: reports {got!r}, {source} {want!r}"
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping) and set(got) == set(want), mismatch
        for key in want:
            _match(got[key], want[key], rel, f"{where}[{key!r}]", source)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), mismatch
        for index, (item, wanted) in enumerate(zip(got, want)):
            _match(item, wanted, rel, f"{where}[{index}]", source)
    elif isinstance(want, float) and rel:
        assert _close(got, want, rel), f"{mismatch} (rel {rel})"
    else:
        assert got == want, mismatch
