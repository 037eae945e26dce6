"""No silent typos, no silent guesses: what a metric would ignore or guess is said once (``MetricInputWarning``).

The misspellings of the first-hour report (issue 21) each warn once and name the
right keyword; the call forms that are right today (every metric fed as its
callers feed it, Twinkle's constructor and forward keywords) stay silent;
numpy arrays give the numbers tensors give.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from kit.metric_cases import CASE_IDS, CASES, global_data

import twinkle_megatron.metric as metric_package
from twinkle_megatron import (
    Accuracy,
    CompletionRewardMetric,
    GRPOMetric,
    LossMetric,
    Metric,
    MetricCollection,
    MetricInputWarning,
    TokenStatsMetric,
    TrainMetric,
)
from twinkle_megatron.metric.inputs.keywords import TWINKLE_CONSTRUCTOR_KEYWORDS, constructor_keywords

ALL_METRICS = sorted({type(case.make()) for case in CASES}, key=lambda cls: cls.__name__)


def input_warnings(record: list) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, MetricInputWarning)]


@pytest.fixture
def silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MetricInputWarning)
        yield


def padded_logits() -> torch.Tensor:
    """Two tokens of a 3-word vocabulary padded to 4 columns; the padding column is the largest."""
    return torch.tensor([[[0.0, 1.0, 0.0, 5.0], [0.0, 0.0, 1.0, 5.0]]])


# ------------------------------------------------------------------ the report's misspellings

def test_a_misspelt_constructor_keyword_warns_once_naming_the_right_one():
    labels = torch.tensor([[1, 2]])
    with pytest.warns(MetricInputWarning, match=r"Accuracy\(\): unknown keyword 'vocab_sise'.*did you mean "
                                                r"'vocab_size'\?") as record:
        metric = Accuracy(vocab_sise=3)
    assert len(input_warnings(record)) == 1
    assert record[0].filename == __file__  # points at the user's line, not inside the package
    metric.accumulate({"labels": labels}, {"logits": padded_logits()})
    assert metric.calculate()["accuracy"] == 0.0  # the padding column won: the number the warning explains
    right = Accuracy(vocab_size=3)
    right.accumulate({"labels": labels}, {"logits": padded_logits()})
    assert right.calculate()["accuracy"] == 1.0


def test_an_unknown_constructor_keyword_without_a_near_name_lists_the_valid_ones():
    with pytest.warns(MetricInputWarning, match=r"unknown keyword 'colour'.*its keywords: .*loss_reduction"):
        LossMetric(colour="red")


def test_a_misspelt_accumulate_keyword_warns_once_per_metric_naming_the_right_one():
    metric = LossMetric()
    with pytest.warns(MetricInputWarning, match=r"keyword 'loss_reductoin' is not read \(did you mean "
                                                r"'loss_reduction'\?\)") as record:
        for _ in range(3):
            metric.accumulate([{}, {}], {"loss": [6.0, 2.0], "num_tokens": [3, 1]}, loss_reductoin="sum")
    assert len(input_warnings(record)) == 1 and record[0].filename == __file__
    assert metric.calculate() == {"loss": 4.0}  # the mean of the values, as the warning says: not the 'sum' asked
    with pytest.warns(MetricInputWarning, match="loss_reductoin"):  # another metric warns once of its own
        LossMetric().accumulate({}, {"loss": 1.0}, loss_reductoin="sum")


def test_outputs_without_what_the_metric_reads_warn_at_calculate_naming_the_keys_present():
    metric = Accuracy()
    for _ in range(2):
        metric.accumulate({"labels": torch.tensor([[1, 2]])}, {"logit": padded_logits()})
    with pytest.warns(MetricInputWarning, match=r"Accuracy: no accumulate call's outputs held 'logits' or "
                                                r"'token_stats' \(keys present: 'logit'\)") as record:
        assert metric.calculate() == {}
        metric.accumulate({"labels": torch.tensor([[1, 2]])}, {"logit": padded_logits()})
        metric.calculate()
    assert len(input_warnings(record)) == 1 and record[0].filename == __file__
    loss = LossMetric()
    loss.accumulate({}, {"losses": 1.0})
    with pytest.warns(MetricInputWarning, match=r"LossMetric: .*held 'loss' \(keys present: 'losses'\)"):
        loss.calculate()


def test_what_one_call_lacks_another_may_bring(silent):
    """``record_microbatch(logits=...)`` in a logits hook, ``record_microbatch(loss=...)`` in the loss_func: each
    call feeds every metric of the collection, half of them without what they read."""
    metrics = MetricCollection([Accuracy(), LossMetric()])
    metrics.accumulate({"labels": torch.tensor([[1, 2]])}, {"logits": padded_logits()})
    metrics.accumulate({"labels": torch.tensor([[1, 2]])}, {"loss": 2.0, "num_tokens": 2}, loss_reduction="sum")
    assert metrics.calculate() == {"accuracy": 0.0, "correct_tokens": 0, "total_tokens": 2, "loss": 1.0}


def square_sbv_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``[s, b, V]`` logits with s == b == 4: 3 of the 16 tokens right (0.1875) when read as
    ``[s, b, V]``, 1 (0.0625, the diagonal one) when misread as ``[b, s, V]``."""
    generator = torch.Generator().manual_seed(5)
    logits_bsv = torch.randn(4, 4, 7, generator=generator)
    top = logits_bsv.argmax(-1)
    # Every label differs from the argmax under both readings, except at the three positions below.
    labels = torch.tensor([[min(set(range(7)) - {int(top[i, j]), int(top[j, i])}) for j in range(4)]
                           for i in range(4)])
    right = ((0, 0), (1, 2), (3, 1))
    for row, col in right:
        labels[row, col] = top[row, col]
    assert all(top[col, row] != top[row, col] for row, col in right[1:])  # the misreading misses them
    return logits_bsv.transpose(0, 1).contiguous(), labels


def test_square_logits_warn_unless_their_layout_is_declared():
    logits, labels = square_sbv_batch()
    guessed = Accuracy()
    with pytest.warns(MetricInputWarning, match=r"logits of shape \(4, 4, 7\) fit both.*logits_layout='sbv'"):
        guessed.accumulate({"labels": labels}, {"logits": logits})
    assert guessed.calculate()["accuracy"] == 1 / 16  # read as [b, s, V]: the guess the warning reports
    for declared in (Accuracy(logits_layout="sbv"), Accuracy()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", MetricInputWarning)
            keywords = {} if declared.logits_layout else {"logits_layout": "sbv"}  # constructor or per call
            declared.accumulate({"labels": labels}, {"logits": logits}, **keywords)
        assert declared.calculate()["accuracy"] == 3 / 16


def test_square_logits_warn_in_grpo_entropy_too():
    logits, labels = square_sbv_batch()
    logps = torch.log_softmax(logits.transpose(0, 1), -1).gather(-1, labels[..., None])[..., 0]
    with pytest.warns(MetricInputWarning, match="fit both"):
        GRPOMetric().accumulate({"labels": labels}, {"logps": logps, "logits": logits})


# ------------------------------------------------------------------ what is right today stays silent

@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_metric_fed_as_its_callers_feed_it_is_silent(case, silent):
    metric = case.make()
    case.feed(metric, global_data())
    assert metric.calculate()


@pytest.mark.parametrize("cls", ALL_METRICS, ids=lambda cls: cls.__name__)
def test_twinkles_constructor_and_forward_keywords_are_accepted_silently(cls, silent):
    """What Twinkle's ``add_metric`` passes (device_mesh, process_group, the keywords of its own metrics), and
    what its optimizer group passes every metric (its keywords, then the forward keywords, whatever they are)."""
    twinkles = {"ignore_index": -100, "temperature": 1.0, "epsilon": 0.2, "epsilon_high": 0.28, "top_k_kl": 0,
                "beta": 0.1}
    assert set(twinkles) == TWINKLE_CONSTRUCTOR_KEYWORDS
    metric = cls(device_mesh=None, process_group=None, **twinkles)
    metric.accumulate([{"labels": torch.tensor([[1, 2]])}], {"loss": 1.0, "logits": [], "logps": None, "values": None},
                      lr=[1e-4], step=1, gradient_accumulation_steps=1, grad_norm=0.5, loss_reduction="mean",
                      temperature=1.0, adapter_name="default", micro_batch_size=2, return_logits=True,
                      steps_per_generation=4, ref_outputs=None, old_logps=None, advantages=None)


def test_earlier_pipeline_stages_and_empty_outputs_are_silent(silent):
    for metric in (Accuracy(), LossMetric(), GRPOMetric()):
        metric.accumulate([{"labels": torch.tensor([[1, 2]])}], {"logits": [], "logps": None, "loss": None})
        metric.accumulate(None, None)
        metric.accumulate({}, {})
    TrainMetric().accumulate(None, {"anything": 1}, lr=1e-4)  # reads no outputs: no complaint about them


def test_a_user_subclass_taking_its_own_keywords_is_not_checked(silent):
    class Scaled(Accuracy):
        def __init__(self, device_mesh=None, process_group=None, **kwargs):
            self.scale = kwargs.pop("scale", 1.0)
            super().__init__(device_mesh, process_group, **kwargs)

    Scaled(scale=2.0)


def test_constructor_keywords_are_read_up_to_the_metric_base_only():
    """With Twinkle installed, Metric derives from ``twinkle.metric.Metric``, whose ``__init__`` takes anything:
    the classes above Metric are not read, so the check stays on."""

    class TwinkleBase:
        def __init__(self, device_mesh, process_group, **kwargs):
            pass

    class Base(TwinkleBase):
        def __init__(self, device_mesh=None, process_group=None, *, strict=True, **kwargs):
            pass

    class Child(Base):
        def __init__(self, device_mesh=None, process_group=None, vocab_size=None, **kwargs):
            pass

    Base.__module__ = Child.__module__ = "twinkle_megatron.metric.example"
    assert constructor_keywords(Child, Base) == {"device_mesh", "process_group", "strict", "vocab_size"}
    assert constructor_keywords(Child, TwinkleBase) is None  # a class outside the package taking **kwargs
    assert {"vocab_size", "logits_layout", "group_names"} <= constructor_keywords(Accuracy, Metric)


def test_the_warning_category_filters_like_any_other():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=MetricInputWarning)
        Accuracy(vocab_sise=3)
    assert not input_warnings(record) and issubclass(MetricInputWarning, UserWarning)


# ------------------------------------------------------------------ numpy

def as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {key: as_numpy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_numpy(item) for item in value]
    return value


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_numpy_arrays_give_the_numbers_tensors_give(case, silent):
    data = global_data()
    expected, given = case.make(), case.make()
    case.feed(expected, data)
    for call in case.calls(data):
        given.accumulate(as_numpy(call.inputs), as_numpy(call.outputs), **as_numpy(dict(call.keywords)))
    timings = ("speed", "total time elapse")  # TrainMetric's clock readings
    results = [{k: v for k, v in m.calculate().items() if k not in timings} for m in (given, expected)]
    assert results[0].keys() == results[1].keys()
    for key, value in results[1].items():  # numbers within float error; records (GRPO's top-k KL) equal
        assert results[0][key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key


def test_a_collection_converts_numpy_once_and_shares_the_pass(silent):
    logits, labels = torch.randn(2, 3, 5, dtype=torch.float64), torch.tensor([[1, 2, 3], [4, 0, -100]])
    expected = MetricCollection([Accuracy(), TokenStatsMetric()])
    expected.accumulate({"labels": labels}, {"logits": logits})
    metrics = MetricCollection([Accuracy(), TokenStatsMetric()])
    metrics.accumulate({"labels": labels.numpy()}, {"logits": logits.numpy()})
    assert metrics.calculate() == pytest.approx(expected.calculate())
    rewards = CompletionRewardMetric()
    rewards.accumulate(rewards=np.array([1.0, 0.0]), completion_lengths=np.array([3, 5]))
    assert rewards.calculate()["train/reward"] == 0.5


# ------------------------------------------------------------------ the declarations match the code

def _call_value_names(function: ast.AST) -> set[str]:
    """Names read by ``call_value`` in ``function``: literals, aliases, and a loop variable's literal values."""
    loops = {}
    for node in ast.walk(function):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List)):
            loops[node.target.id] = {e.value for e in node.iter.elts if isinstance(e, ast.Constant)}
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "call_value":
            first = node.args[0]
            names |= {first.value} if isinstance(first, ast.Constant) else loops.get(getattr(first, "id", ""), set())
            names |= {e.value for kw in node.keywords if kw.arg == "aliases" for e in ast.walk(kw.value)
                      if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


def test_every_call_value_a_metric_reads_is_in_its_call_keywords():
    """A keyword read but not declared could never warn for its misspelling."""
    checked = 0
    for cls in {c for c in vars(metric_package).values() if inspect.isclass(c) and issubclass(c, Metric)}:
        tree = ast.parse(Path(inspect.getfile(cls)).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                read = _call_value_names(node)
                assert read <= set(cls.call_keywords), f"{cls.__name__} reads {sorted(read - set(cls.call_keywords))}"
                checked += len(read)
    assert checked >= 20
