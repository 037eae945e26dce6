r"""CompletionRewardMetric: reward, completion-length and rollout-time statistics over all ranks.

Twinkle's version keeps Python lists and never communicates, so each rank
reports its own completions. Here every statistic is a sum (value, square,
count) in the collection's one sync, so the mean and the sample standard
deviation cover all completions of all data-parallel ranks.

Reward functions are named by the caller (``rewards={'accuracy': [...], …}``),
but state shapes must be declared identically on every rank, including ranks
that never see a reward. So each name takes a slot (in order of first
appearance, up to ``max_reward_functions``) and its characters travel as
numbers in a ``max`` state (and a ``min`` state, to detect ranks that put
different names in one slot): every rank learns the names from the same sync,
without an extra collective.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..inputs.microbatches import call_value
from ..inputs.tensors import all_host_numbers, to_device
from ..state.base import Metric, Number, SyncedStates

GENERATE_TIME = "profiling/Time taken: generate"
WEIGHT_SYNC_TIME = "profiling/Time taken: move_model_to_sampler"
REWARD_STATES = ("reward_sum", "reward_square_sum", "reward_count", "reward_nonfinite")  # per slot: Σx, Σx², n, NaN/inf


class CompletionRewardMetric(Metric):
    r"""Twinkle's ``CompletionRewardMetric``, data-parallel for real.

    ``accumulate(inputs=None, outputs=None, *, rewards=None, completion_lengths=None,
    completions=None, generate_time=None, weight_sync_time=None)``, in the forms
    of Twinkle's code and of its documentation alike:

    * ``rewards``: ``{name: values}`` (Twinkle's code: one entry per reward
      function, values a list or tensor with one per completion), or a plain
      list / tensor of values (the docs: one unnamed reward function, reported
      as ``train/reward`` and ``train/reward_std``);
    * ``completion_lengths``: one number per completion; or ``completions``
      (the docs): the completions themselves, whose length is their ``len()``:
      characters for a string (no tokenizer is at hand: pass
      ``completion_lengths`` for token counts), tokens for a list of token ids;
    * ``generate_time`` (the code) or ``generation_time`` (the docs), and
      ``weight_sync_time``: one number per call, in seconds.

    Each is a per-call value (keyword first, then ``outputs``). Over all
    completions ``x`` of all calls and ranks (``n`` finite values):

    ============================================== =====================================
    ``train/{name}_reward``                        Σx / n
    ``train/{name}_reward_std``                    sqrt((Σx² − (Σx)²/n) / (n − 1))   (0 when n = 1)
    ``train/completion_length``                    mean completion length
    ``profiling/Time taken: generate``             mean of the generate times passed
    ``profiling/Time taken: move_model_to_sampler`` mean of the weight-sync times passed
    ============================================== =====================================

    Sums are float64. Keys appear only when their values were passed (Twinkle
    reports -1.0 for a missing time). Non-finite rewards are left out and
    counted in ``train/{name}_nonfinite_rewards`` (when > 0). Completions are whole on every CP rank,
    so ``cp_gathered`` defaults to True; like every metric, values passed on
    the last pipeline stage, TP rank 0, count. Every rank must name its
    reward functions in the same order; a conflict raises ``ValueError``.

    >>> from twinkle_megatron import CompletionRewardMetric
    >>> metric = CompletionRewardMetric()
    >>> metric.accumulate(None, None, rewards={"format": [1.0, 0.0, 1.0]}, completion_lengths=[10, 20, 30],
    ...                   generate_time=2.5)
    >>> result = metric.calculate()
    >>> result["train/format_reward_std"] == 1 / 3 ** 0.5, result["train/completion_length"]
    (True, 20.0)
    """

    token_statistics = ()  # reads no logits

    call_keywords = ("rewards", "completion_lengths", "completions", "generate_time", "generation_time",
                     "weight_sync_time")

    def __init__(self, device_mesh: Any = None, process_group: Any = None, cp_gathered: bool = True,
                 max_reward_functions: int = 16, max_name_length: int = 64, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, cp_gathered=cp_gathered, **kwargs)
        self.max_reward_functions = max_reward_functions
        self.max_name_length = max_name_length
        slots, width = (max_reward_functions,), (max_reward_functions, max_name_length)
        for name in REWARD_STATES:
            self.add_state(name, "sum", slots)
        self.add_state("reward_names", "max", width)  # character codes; -inf: slot unused
        self.add_state("reward_names_min", "min", width)  # equal to reward_names unless ranks disagree
        for name in ("completion_length_sum", "completions", "generate_time_sum", "generate_times",
                     "weight_sync_time_sum", "weight_sync_times"):
            self.add_state(name, "sum")
        self._slots: dict[str, int] = {}
        self._named_slots: dict[str, int] = {}  # the slots whose names the name states hold

    def accumulate(self, inputs: Any = None, outputs: Any = None, **kwargs: Any) -> None:
        rewards = call_value("rewards", kwargs, outputs)
        if rewards is not None:
            self._accumulate_rewards(rewards if isinstance(rewards, Mapping) else {"": rewards})
        lengths = call_value("completion_lengths", kwargs, outputs)
        if lengths is None:
            completions = call_value("completions", kwargs, outputs)
            lengths = None if completions is None else [len(completion) for completion in completions]
        if lengths is not None and _host_list(lengths):  # kept on the host until the sync
            self._add("completion_length_sum", math.fsum(float(length) for length in lengths))
            self._add("completions", len(lengths))
        elif lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
            self._add("completion_length_sum", lengths.sum())
            self._add("completions", lengths.numel())
        for name in ("generate_time", "weight_sync_time"):
            seconds = call_value(name, kwargs, outputs, aliases=("generation_time",) if name == "generate_time" else ())
            if seconds is not None:
                self._add(f"{name}_sum", seconds)
                self._add(f"{name}s", 1.0)

    def _accumulate_rewards(self, rewards: Mapping[str, Any]) -> None:
        given = {self._slot(name): value for name, value in rewards.items()}
        if not given:
            return
        if self._named_slots != self._slots:  # the names into their states (again after a reset)
            codes = torch.full((self.max_reward_functions, self.max_name_length), float("-inf"), dtype=torch.float64)
            for name, slot in self._slots.items():
                codes[slot] = torch.tensor(_encode(name, self.max_name_length), dtype=torch.float64)
            self._maximum("reward_names", codes)
            self._minimum("reward_names_min", torch.where(torch.isinf(codes), float("inf"), codes))
            self._named_slots = dict(self._slots)
        if all(_host_list(value) for value in given.values()):  # Twinkle's lists: summed on the host
            rows = [[0.0] * self.max_reward_functions for _ in REWARD_STATES]
            for slot, value in given.items():
                finite = [float(x) for x in value if math.isfinite(x)]
                totals = (math.fsum(finite), math.fsum(x * x for x in finite), len(finite), len(value) - len(finite))
                for row, total in zip(rows, totals):
                    row[slot] = float(total)
            for name, row in zip(REWARD_STATES, rows):
                self._add(name, row)
            return
        values = {slot: torch.as_tensor(value, dtype=torch.float64).reshape(-1) for slot, value in given.items()}
        device = next(iter(values.values())).device
        per_slot = []  # each slot's [Σx, Σx², n, non-finite] (device ops: rewards are never read on the host here)
        for value in values.values():
            finite = torch.isfinite(value := to_device(value, device))
            value = torch.where(finite, value, 0.0)
            per_slot.append(torch.stack([value, value * value, finite, ~finite]).sum(-1, dtype=torch.float64))
        slots = torch.tensor(list(values), device=device)
        rows = torch.zeros(4, self.max_reward_functions, dtype=torch.float64, device=device)
        rows.index_copy_(1, slots, torch.stack(per_slot, 1))
        self._apply_totals(dict(zip(REWARD_STATES, rows.unbind(0))))

    def _slot(self, name: str) -> int:
        if name not in self._slots:
            if len(self._slots) == self.max_reward_functions:
                raise ValueError(f"more than {self.max_reward_functions} reward functions ({sorted(self._slots)} "
                                 f"and {name!r}); raise CompletionRewardMetric(max_reward_functions=...)")
            if len(name) > self.max_name_length or "\0" in name:
                raise ValueError(f"reward function name {name!r} is longer than {self.max_name_length} characters "
                                 "(raise max_name_length) or contains a NUL character")
            self._slots[name] = len(self._slots)
        return self._slots[name]

    def compute(self, states: SyncedStates) -> dict[str, Number]:
        results: dict[str, Number] = {}
        if states["weight_sync_times"] > 0:
            results[WEIGHT_SYNC_TIME] = states["weight_sync_time_sum"] / states["weight_sync_times"]
        if states["generate_times"] > 0:
            results[GENERATE_TIME] = states["generate_time_sum"] / states["generate_times"]
        names, names_min = states["reward_names"], states["reward_names_min"]
        for slot in range(self.max_reward_functions):
            if names[slot, 0] == float("-inf"):
                continue
            if not torch.equal(names[slot], names_min[slot]):
                raise ValueError(f"ranks passed reward functions in different orders (slot {slot} holds "
                                 f"{_decode(names[slot])!r} and {_decode(names_min[slot])!r}); pass the same names "
                                 "in the same order on every rank")
            name = _decode(names[slot])
            prefix = f"train/{name}_" if name else "train/"  # the unnamed reward of a plain list: train/reward
            nonfinite = int(states["reward_nonfinite"][slot])
            if nonfinite:
                results[f"{prefix}nonfinite_rewards"] = nonfinite
            count = float(states["reward_count"][slot])
            if count == 0:
                continue
            total, squares = float(states["reward_sum"][slot]), float(states["reward_square_sum"][slot])
            results[f"{prefix}reward"] = total / count
            variance = (squares - total * total / count) / (count - 1) if count > 1 else 0.0
            results[f"{prefix}reward_std"] = math.sqrt(max(variance, 0.0))
        if states["completions"] > 0:
            results["train/completion_length"] = states["completion_length_sum"] / states["completions"]
        return results

    def reset(self) -> None:
        super().reset()
        self._slots, self._named_slots = {}, {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        names = self._states["reward_names"].cpu()
        self._slots = {_decode(names[slot]): slot for slot in range(self.max_reward_functions)
                       if names[slot, 0] != float("-inf")}
        self._named_slots = {}  # written again at the next call (the same codes: no change)


def _host_list(values: Any) -> bool:
    """A list or tuple of Python numbers (Twinkle's form)."""
    return isinstance(values, (list, tuple)) and all_host_numbers(values)


def _encode(name: str, width: int) -> list[float]:
    """A name as ``width`` character codes, padded with 0."""
    return [float(ord(c)) for c in name] + [0.0] * (width - len(name))


def _decode(codes: torch.Tensor) -> str:
    return "".join(chr(int(c)) for c in codes.tolist() if 0 < c < float("inf"))
