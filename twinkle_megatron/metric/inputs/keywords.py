"""Inputs a metric would otherwise ignore or guess silently, each said once with the likely intended name.

* **Constructor keywords**: a keyword no ``__init__`` of the metric's class names
  (``Accuracy(vocab_sise=3)``) warns with the closest valid name (:mod:`difflib`).
  ``device_mesh``, ``process_group`` and the keywords Twinkle's own metric
  constructors take (:data:`TWINKLE_CONSTRUCTOR_KEYWORDS`) stay accepted by every
  metric, as Twinkle's accept them. A user subclass whose ``__init__`` takes
  ``**kwargs`` may read them itself: its keywords are not checked.
* **accumulate keywords**: Twinkle passes its forward keywords through to every
  metric, so unknown keywords stay accepted silently, except one close to a
  keyword the metric reads (its :attr:`call_keywords`) and read by no metric:
  ``loss_reductoin`` warns "did you mean 'loss_reduction'?".
* **Outputs**: ``calculate()`` warns, naming the keys present, when the metric was
  fed (non-empty) outputs but no call held a key it reads (its :attr:`output_keys`;
  ``outputs={"logit": ...}`` for ``Accuracy``). An entry that is present but empty
  (``logits=[]`` on earlier pipeline stages) counts as present.
* **Logits layout**: logits whose first two dimensions are equal fit both
  ``[b, s, V]`` and Megatron's ``[s, b, V]``; unless ``logits_layout`` declares
  one they are read as ``[b, s, V]``, and a warning says so.

Every warning is a :class:`MetricInputWarning` (filter it like any warning
category), given once per metric instance and key. Per call the cost is a few
dictionary look-ups: what a set of keyword names means for a class is computed
once and cached.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import warnings
import weakref
from typing import Any, Mapping, Optional

# The keywords twinkle-kit 0.5.1's metric constructors take besides device_mesh and process_group
# (GRPOMetric, PPOMetric, DPOMetric); its other metrics accept and ignore them through **kwargs.
TWINKLE_CONSTRUCTOR_KEYWORDS = frozenset({"ignore_index", "temperature", "epsilon", "epsilon_high", "top_k_kl",
                                          "beta"})
SIMILARITY = 0.8  # difflib ratio from which an unknown keyword is taken for a misspelling of a known one

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> keys already warned about
_read_by_any_metric: set[str] = set()  # every metric class's call_keywords
_outputs_read: weakref.WeakSet = weakref.WeakSet()  # metrics fed what they read at least once
_outputs_lacking: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # metric -> keys of a call without it
_misspellings: dict[tuple[type, frozenset], tuple[tuple[str, str], ...]] = {}  # (class, names) -> (name, meant)


class MetricInputWarning(UserWarning):
    """An input a metric ignores or guesses: an unknown keyword, outputs without what it reads, an ambiguous
    logits layout. Filter with ``warnings.filterwarnings("ignore", category=MetricInputWarning)``."""


def warn_once(owner: object, key: str, message: str) -> None:
    """``warnings.warn(message, MetricInputWarning)`` the first time ``owner`` meets ``key``; the warning points
    at the first caller outside this package."""
    seen = _warned.setdefault(owner, set())
    if key in seen:
        return
    seen.add(key)
    warnings.warn(message, MetricInputWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    frame, level = inspect.currentframe().f_back.f_back, 2  # the caller of warn_once
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _closest(name: str, candidates: Any) -> Optional[str]:
    matches = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=SIMILARITY)
    return matches[0] if matches else None


# ------------------------------------------------------------------ constructor keywords

@functools.cache
def constructor_keywords(cls: type, base: type) -> Optional[frozenset]:
    """The keywords ``cls(...)`` takes: every parameter named by an ``__init__`` of ``cls`` and its bases up to
    ``base`` (above it, Twinkle's ``Metric`` takes anything). None when a class outside this package takes
    ``**kwargs`` (it may read them itself)."""
    names: set[str] = set()
    mro = cls.__mro__
    for klass in mro[:mro.index(base) + 1]:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        users_class = not (getattr(klass, "__module__", "") or "").startswith("twinkle_megatron")
        if users_class and any(p.kind is p.VAR_KEYWORD for p in parameters):
            return None
        names.update(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    return frozenset(names - {"self"})


def check_constructor_keywords(metric: object, unknown: Mapping[str, Any], base: type) -> None:
    """Warn once for each keyword of ``unknown`` (what reached ``base.__init__``) the metric does not take."""
    if not unknown:
        return
    cls = type(metric)
    accepted = constructor_keywords(cls, base)
    if accepted is None:
        return
    for name in unknown:
        if name in accepted or name in TWINKLE_CONSTRUCTOR_KEYWORDS:
            continue
        meant = _closest(name, accepted)
        hint = f"did you mean {meant!r}?" if meant else f"its keywords: {', '.join(sorted(accepted))}"
        warn_once(metric, f"__init__:{name}", f"{cls.__name__}(): unknown keyword {name!r} is ignored ({hint})")


# ------------------------------------------------------------------ accumulate

def register_call_keywords(names: Any) -> None:
    """Keywords some metric reads in ``accumulate``: never taken for another metric's misspelling."""
    if not set(names) <= _read_by_any_metric:
        _read_by_any_metric.update(names)
        _misspellings.clear()


def check_call(metric: Any, outputs: Any, kwargs: Mapping[str, Any]) -> None:
    """Warn once for an ``accumulate`` keyword that looks like a misspelt one the metric reads; note whether
    the outputs hold a key the metric reads (see :func:`check_outputs_read`)."""
    cls = type(metric)
    if kwargs:
        names = frozenset(kwargs)
        misspelt = _misspellings.get((cls, names))
        if misspelt is None:
            misspelt = _misspellings[(cls, names)] = _misspelt(cls.call_keywords, names)
        for name, meant in misspelt:
            warn_once(metric, f"accumulate:{name}", f"{cls.__name__}.accumulate: keyword {name!r} is not read "
                      f"(did you mean {meant!r}?)")
    wanted = cls.output_keys
    if wanted and metric not in _outputs_read and outputs and (type(outputs) is dict or isinstance(outputs, Mapping)):
        if any(key in outputs or key in kwargs for key in wanted):
            _outputs_read.add(metric)
        else:
            _outputs_lacking.setdefault(metric, tuple(outputs))


def check_outputs_read(metric: Any) -> None:
    """At ``calculate()``: warn once when the metric was fed outputs, but none of its calls held what it reads
    (what one call lacks another may bring: ``record_microbatch(logits=...)``, then ``(loss=...)``)."""
    present = _outputs_lacking.get(metric) if metric not in _outputs_read else None
    if present is not None:
        warn_once(metric, "outputs", f"{type(metric).__name__}: no accumulate call's outputs held "
                  f"{' or '.join(map(repr, type(metric).output_keys))} (keys present: {', '.join(map(repr, present))});"
                  " nothing was added")


def _misspelt(reads: tuple[str, ...], names: frozenset) -> tuple[tuple[str, str], ...]:
    found = []
    for name in sorted(names - set(reads) - _read_by_any_metric - {"inputs", "outputs"}):
        meant = _closest(name, reads)
        if meant is not None:
            found.append((name, meant))
    return tuple(found)


# ------------------------------------------------------------------ logits layout

def check_layout_declared(owner: object, logits: Any, labels: Any, layout: Optional[str]) -> None:
    """Warn once when ``logits`` fit both ``[b, s, V]`` and ``[s, b, V]`` (equal first two dimensions; the
    labels ``[b, s]`` cannot tell them apart either) and no ``logits_layout`` was declared."""
    if layout is None and getattr(logits, "ndim", 0) == 3 and getattr(labels, "ndim", 0) == 2 \
            and logits.shape[0] == logits.shape[1]:
        warn_once(owner, "logits_layout", f"{type(owner).__name__}: logits of shape {tuple(logits.shape)} fit both "
                  "[b, s, V] and Megatron's [s, b, V] (b == s); read as [b, s, V]. Pass logits_layout='sbv' "
                  "(Megatron's layout) or logits_layout='bsv' to declare it")
