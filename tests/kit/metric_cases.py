"""Every metric, fed the way its callers feed it, from one synthetic global batch: for tests over all metrics.

A :class:`Case` builds its metric and feeds it a block of rows (sequences) of
:func:`global_data` — a DP rank's share, or all of it for the single-process
reference. Tests poison or mask entries of the data (``poison`` and
``mask_like``), keep tensors that require grad, or save and resume mid-way.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from twinkle_megatron import (
    Accuracy,
    CISPOMetric,
    CompletionRewardMetric,
    DPOMetric,
    EmbeddingMetric,
    GRPOMetric,
    GSPOMetric,
    LossMetric,
    Metric,
    PPOMetric,
    PPOValueMetric,
    TokenStatsMetric,
    TrainMetric,
)
from twinkle_megatron.testing.batches import RankView
from twinkle_megatron.testing.invariance import Call, run_calls

ROWS, COLS, VOCAB, DIM = 8, 6, 11, 5


def global_data(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, (ROWS, COLS), generator=generator)
    labels[:, 0] = -100
    logps = -torch.rand(ROWS, COLS, generator=generator, dtype=torch.float64) * 2
    return {
        "logits": torch.randn(ROWS, COLS, VOCAB, generator=generator, dtype=torch.float64),
        "labels": labels,
        "token_loss": torch.rand(ROWS, COLS, generator=generator, dtype=torch.float64) * 3,
        "logps": logps,
        "old_logps": logps + 0.3 * torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64),
        "ref_logps": logps + 0.2 * torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64),
        "entropies": torch.rand(ROWS, COLS, generator=generator, dtype=torch.float64) * 2,
        "advantages": torch.randn(ROWS, generator=generator, dtype=torch.float64),
        "values": torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64),
        "old_values": torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64),
        "returns": torch.randn(ROWS, COLS, generator=generator, dtype=torch.float64),
        "embeddings": torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64),
        "anchors": torch.tensor([1, 0] * (ROWS // 2)),
        "row_loss": torch.rand(ROWS, generator=generator, dtype=torch.float64) + 1,
        "rewards": torch.rand(ROWS, generator=generator, dtype=torch.float64),
        "lengths": torch.randint(5, 50, (ROWS,), generator=generator).double(),
        "call_loss": torch.rand((), generator=generator, dtype=torch.float64) + 0.5,  # one per call, every rank
    }


def _counted(labels: torch.Tensor, row: int) -> torch.Tensor:
    return labels[row] != -100


def _ragged(values: torch.Tensor, labels: torch.Tensor) -> list:
    """Twinkle's per-sequence arrays: each sequence's counted tokens' values, in order."""
    return [values[r][_counted(labels, r)] for r in range(values.shape[0])]


def _split(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Two microbatches when each keeps whole (chosen, rejected) pairs, else one."""
    return list(tensor.chunk(2)) if tensor.shape[0] % 4 == 0 else [tensor]


def feed_logits(d: dict) -> list[Call]:
    return [Call([{"labels": labels} for labels in _split(d["labels"])], {"logits": _split(d["logits"])})]


def feed_token_loss(d: dict) -> list[Call]:
    return [Call([{"labels": labels} for labels in _split(d["labels"])], {"loss": _split(d["token_loss"])})]


def feed_row_loss(d: dict) -> list[Call]:
    """One loss value per microbatch (a row each), averaged with equal weight."""
    rows = range(d["labels"].shape[0])
    return [Call([{"labels": d["labels"][r:r + 1]} for r in rows], {"loss": list(d["row_loss"].unbind())})]


def feed_policy(d: dict) -> list[Call]:
    # Twinkle's forms: logps per microbatch, ragged old_logps, one advantage per sequence, entropies.
    return [Call([{"labels": labels} for labels in _split(d["labels"])],
                 {"logps": _split(d["logps"]), "entropies": _split(d["entropies"])},
                 {"old_logps": _ragged(d["old_logps"], d["labels"]), "advantages": list(d["advantages"].unbind())})]


def feed_value_head(d: dict) -> list[Call]:
    return [Call({"labels": d["labels"]}, {"values": d["values"]},
                 {"old_values": _ragged(d["old_values"], d["labels"]), "returns": _ragged(d["returns"], d["labels"]),
                  "advantages": list(d["advantages"].unbind())})]


def feed_pairs(d: dict) -> list[Call]:
    return [Call([{"labels": labels} for labels in _split(d["labels"])], {"logps": _split(d["logps"])},
                 {"ref_outputs": {"logps": _split(d["ref_logps"])}})]


def feed_embeddings(d: dict) -> list[Call]:
    return [Call({"labels": d["anchors"]}, {"embeddings": d["embeddings"], "loss": d["call_loss"] * 1},
                 {"grad_norm": d["call_loss"] * 2})]


def feed_rewards(d: dict) -> list[Call]:
    return [Call(None, None, {"rewards": {"accuracy": d["rewards"]}, "completion_lengths": d["lengths"],
                              "generate_time": 1.5})]


def feed_train(d: dict) -> list[Call]:
    return [Call(None, None, {"lr": [1e-4], "step": 4, "gradient_accumulation_steps": 2})]


@dataclass(frozen=True)
class Case:
    """A metric and its caller; ``poisonable``: inputs -> (unit, count key) for the non-finite tests."""

    name: str
    make: Callable[[], Metric]
    calls: Callable[[dict], list[Call]]  # the caller's accumulate calls for some data
    poisonable: tuple = ()
    grad_inputs: tuple = ()  # tensors a training step would hand over with requires_grad

    def feed(self, metric: Metric, d: dict) -> None:
        run_calls(metric, self.calls(d))


TOKEN_POLICY = (("logps", "token", "train/nonfinite_tokens"), ("old_logps", "token", "train/nonfinite_tokens"),
                ("entropies", "token", "train/nonfinite_tokens"), ("advantages", "row", "train/nonfinite_tokens"))

CASES = [
    Case("Accuracy", lambda: Accuracy(vocab_size=VOCAB), feed_logits, (("logits", "token", "nonfinite_tokens"),),
         ("logits",)),
    Case("TokenStatsMetric", lambda: TokenStatsMetric(vocab_size=VOCAB), feed_logits,
         (("logits", "token", "nonfinite_tokens"),), ("logits",)),
    Case("LossMetric/per-token", LossMetric, feed_token_loss, (("token_loss", "token", "nonfinite_losses"),),
         ("token_loss",)),
    Case("LossMetric/per-value", LossMetric, feed_row_loss, (("row_loss", "value", "nonfinite_losses"),),
         ("row_loss",)),
    Case("GRPOMetric", lambda: GRPOMetric(top_k_kl=3), feed_policy, TOKEN_POLICY, ("logps", "entropies")),
    Case("GSPOMetric", lambda: GSPOMetric(top_k_kl=3), feed_policy, TOKEN_POLICY, ("logps",)),
    Case("CISPOMetric", CISPOMetric, feed_policy, TOKEN_POLICY, ("logps",)),
    Case("PPOMetric", PPOMetric, feed_policy, TOKEN_POLICY, ("logps",)),
    Case("PPOValueMetric", PPOValueMetric, feed_value_head,
         (("values", "token", "train/nonfinite_tokens"), ("returns", "token", "train/nonfinite_tokens")),
         ("values",)),
    Case("DPOMetric", DPOMetric, feed_pairs,
         (("logps", "pair", "nonfinite_pairs"), ("ref_logps", "pair", "nonfinite_pairs")), ("logps", "ref_logps")),
    Case("EmbeddingMetric", EmbeddingMetric, feed_embeddings,
         (("embeddings", "positive", "nonfinite_embeddings"),), ("embeddings", "call_loss")),
    Case("CompletionRewardMetric", CompletionRewardMetric, feed_rewards,
         (("rewards", "reward", "train/accuracy_nonfinite_rewards"),), ("rewards",)),
    Case("TrainMetric", TrainMetric, feed_train),
]
CASE_IDS = [case.name for case in CASES]
# One metric per family of keys: a collection of these reports each key once.
COLLECTION_CASES = [case for case in CASES if case.name in (
    "Accuracy", "TokenStatsMetric", "LossMetric/per-token", "GRPOMetric", "PPOValueMetric", "DPOMetric",
    "CompletionRewardMetric", "TrainMetric")]


def rows_of(d: dict, view: RankView) -> dict:
    """The rows of ``d`` a DP rank holds (``view.rows``); per-call values stay whole."""
    return {key: view.rows(value) if value.dim() >= 1 and value.shape[0] == ROWS else value
            for key, value in d.items()}


def poison(d: dict, key: str, row: int, col: int = 2) -> dict:
    """``d`` with a NaN in ``d[key]`` at (row, col) (the row's entry for per-row data)."""
    d = copy.deepcopy(d)
    tensor = d[key]
    if tensor.dim() == 1:
        tensor[row] = math.nan
    elif tensor.dim() == 2:
        tensor[row, col] = math.nan
    else:
        tensor[row, col, 3] = math.nan
    return d


def mask_like(d: dict, unit: str, row: int, col: int = 2) -> Optional[dict]:
    """``d`` with the entries a NaN of this ``unit`` poisons masked out, the way a caller masks them."""
    d = copy.deepcopy(d)
    if unit == "token":
        d["labels"][row, col] = -100
    elif unit == "row":
        d["labels"][row] = -100
    elif unit == "pair":
        pair = row - row % 2
        d["labels"][pair:pair + 2] = -100
    elif unit == "positive":
        d["anchors"][row - 1] = 0  # the poisoned row is the positive of the anchor before it
    else:
        return None  # values and rewards: the masked reference drops the entry, see ``dropped``
    return d


def dropped(case: Case, d: dict, row: int) -> list[Call]:
    """The calls for ``d`` without entry ``row`` of a per-value or per-reward input."""
    keep = [r for r in range(ROWS) if r != row]
    if case.calls is feed_row_loss:
        return [Call([{"labels": d["labels"][r:r + 1]} for r in keep], {"loss": [d["row_loss"][r] for r in keep]})]
    return [Call(None, None, {"rewards": {"accuracy": d["rewards"][keep]}}),
            Call(None, None, {"completion_lengths": d["lengths"], "generate_time": 1.5})]


def tensors_held(value: Any, seen: Optional[set] = None) -> list[torch.Tensor]:
    """Every tensor reachable from ``value`` (attributes, containers), each once."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return []
    return [tensor for item in items for tensor in tensors_held(item, seen)]
