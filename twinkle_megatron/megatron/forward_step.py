"""Where a Megatron ``forward_step`` takes its data iterator and its model: by parameter name, never by position.

Megatron's schedules call ``forward_step_func(data_iterator, model)`` (some
releases add ``checkpoint_activations_microbatch`` or
``return_schedule_plan=True``). Megatron-LM's step is ``forward_step(data_iterator,
model)``; Megatron-Bridge's is ``forward_step(state: GlobalState, data_iterator,
model, return_schedule_plan=False)``, and Bridge binds the state first
(``functools.partial(forward_step, state)``); users bind their own options with
``functools.partial`` too. So the arguments of a call are matched to the names
of the innermost function's parameters, after what its partials already bind
(positional or keyword): the data iterator is the argument named
``data_iterator``, the model the one named ``model``, wherever they stand.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

DATA_ITERATOR = "data_iterator"  # the name in Megatron-LM's and Megatron-Bridge's forward_step
MODEL = "model"


@dataclass(frozen=True)
class StepSignature:
    """A ``forward_step`` seen through its ``functools.partial`` layers: the innermost callable, what the
    partials bind, and that callable's signature."""

    func: Callable
    bound_args: tuple = ()
    bound_kwargs: dict = field(default_factory=dict)
    signature: Optional[inspect.Signature] = None  # None: not introspectable (a builtin)

    @classmethod
    def of(cls, forward_step: Callable) -> StepSignature:
        func, args, kwargs = forward_step, (), {}
        while isinstance(func, functools.partial):  # outer partials' arguments come after (keywords win)
            func, args, kwargs = func.func, func.args + args, {**func.keywords, **kwargs}
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError):
            signature = None
        return cls(func, args, kwargs, signature)

    def takes(self, name: str) -> bool:
        """Whether the step has a parameter ``name`` that a call can fill (not ``*args`` / ``**kwargs``)."""
        parameter = self.signature.parameters.get(name) if self.signature is not None else None
        return parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)

    def require(self, name: str, forward_step: Callable, why: str) -> None:
        """``TypeError`` (at ``wrap()`` time, not inside the schedule) when the step has no parameter ``name``."""
        if self.takes(name):
            return
        shown = f"{getattr(self.func, '__qualname__', type(self.func).__name__)}{self.signature or '(...)'}"
        bound = " (after what its functools.partial binds)" if isinstance(forward_step, functools.partial) else ""
        raise TypeError(
            f"wrap(): the forward_step {shown}{bound} has no parameter named {name!r}. wrap() finds the data "
            f"iterator and the model by their parameter names, {DATA_ITERATOR!r} and {MODEL!r}, as in Megatron-LM's "
            f"forward_step(data_iterator, model) and Megatron-Bridge's forward_step(state, data_iterator, model), "
            f"never by position; it needs {name!r} {why}. Name that parameter {name!r}.")

    def bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        """One call's arguments, the partials' included, by parameter name (``TypeError`` if they do not fit)."""
        return self.signature.bind(*self.bound_args, *args, **{**self.bound_kwargs, **kwargs})

    def call(self, arguments: inspect.BoundArguments) -> Any:
        """Call the step with ``arguments`` (as :meth:`bind` returned them, possibly changed)."""
        return self.func(*arguments.args, **arguments.kwargs)


class BatchReader:
    """A data iterator, read through: ``on_batch`` sees each batch the step takes from it, then the step does."""

    def __init__(self, iterator: Any, on_batch: Callable[[Any], None]) -> None:
        self.iterator, self.on_batch = iterator, on_batch

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = next(self.iterator)
        self.on_batch(batch)
        return batch


def loss_mask_of(loss_func: Callable, labels: torch.Tensor, given: Optional[torch.Tensor] = None
                 ) -> Optional[torch.Tensor]:
    """The loss mask: ``given`` (to the model), else the one bound in the ``loss_func`` partial: its
    ``loss_mask`` keyword, else the first bound tensor with as many elements as ``labels`` (Megatron-LM's and
    Bridge's ``partial(loss_func, loss_mask)``)."""
    if given is not None:
        return given
    bound = []
    while isinstance(loss_func, functools.partial):
        bound += [loss_func.keywords.get("loss_mask"), *loss_func.args, *loss_func.keywords.values()]
        loss_func = loss_func.func
    for value in bound:
        if isinstance(value, torch.Tensor) and value.numel() == labels.numel() and value.numel() > 1:
            return value
    return None
