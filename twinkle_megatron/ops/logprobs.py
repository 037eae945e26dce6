r"""Vocab-parallel label log-probabilities, two collectives.

.. math::

    \log p(y) = x_y - m - \log \sum_{v < V} e^{x_v - m}, \qquad m = \max_{v < V} x_v

over the true vocabulary ``V`` (padding columns carry no probability). The
rank owning column ``y`` contributes :math:`x_y`, every rank its partial
:math:`\sum e^{x_v - m}`; collectives over ``group``: one all-reduce MAX (the
maximum) and one all-reduce SUM (partial sums and the label logit packed
together), for all tokens at once.

Labels equal to ``ignore_index`` give 0; labels outside ``[0, V)`` give NaN, and
so does a token with a non-finite logit. This is the shared pass of
:func:`~.token_stats.vocab_parallel_token_stats` (its entropy comes for free).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .token_stats import _token_stats

__all__ = ["vocab_parallel_logprobs"]


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                            group: Optional[dist.ProcessGroup] = None, vocab_size: Optional[int] = None,
                            ignore_index: int = -100, kernel: Optional[str] = None) -> torch.Tensor:
    """log p(``labels``) under vocab-parallel ``logits [..., V_local]``, shape ``logits.shape[:-1]``.

    Identical on every rank of ``group``; float32 (float64 for float64 logits).
    """
    if labels is None:
        raise ValueError("vocab_parallel_logprobs needs labels")
    return _token_stats(logits, labels, group, vocab_size, None, ignore_index, need_sums=True,
                        kernel=kernel).logprobs
