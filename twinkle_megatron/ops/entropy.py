r"""Vocab-parallel entropy of the softmax, two collectives.

.. math::

    H = -\sum_{v<V} p_v \log p_v = \log Z - \frac{1}{Z} \sum_{v<V} e^{x_v - m}(x_v - m),
    \qquad Z = \sum_{v<V} e^{x_v - m}, \quad m = \max_{v<V} x_v

in nats, over the true vocabulary ``V``. Both sums are computed per shard
relative to the shard's maximum, rescaled to the global maximum after one
all-reduce MAX, and summed by one all-reduce SUM (see
:mod:`.token_stats`). Since :math:`x_v - m \le 0` the two terms of :math:`H`
are non-negative: no cancellation for large logits. A token with a non-finite
logit gets NaN.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .token_stats import _token_stats

__all__ = ["vocab_parallel_entropy"]


def vocab_parallel_entropy(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                           vocab_size: Optional[int] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """Entropy (nats) of the softmax of vocab-parallel ``logits [..., V_local]``, shape ``logits.shape[:-1]``.

    Identical on every rank of ``group``; float32 (float64 for float64 logits).
    """
    return _token_stats(logits, None, group, vocab_size, None, -100, need_sums=True, kernel=kernel).entropy
