r"""Vocab-parallel argmax: the global top-1 vocabulary id of each token, one collective.

.. math::

    \hat y = \min \{\, v < V : x_v = \max_{u < V} x_u \,\}

(the lowest global id on ties, like ``torch.argmax``; columns at or beyond the
true vocabulary size ``V`` are never candidates).

Each rank reduces its shard to a per-token (maximum, first column) pair in one
chunked pass, packs it into one int64 key (see :mod:`._shard`) and joins **one**
all-reduce MAX over ``group`` for all tokens; no collective without a group or
without tokens. A NaN counts as larger than everything (as in ``torch.argmax``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .token_stats import _token_stats

__all__ = ["vocab_parallel_argmax"]


def vocab_parallel_argmax(logits: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                          vocab_size: Optional[int] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """int64 global argmax of vocab-parallel ``logits [..., V_local]``, shape ``logits.shape[:-1]``.

    Identical on every rank of ``group``; ``group=None`` (or one rank) means the
    whole vocabulary is local. See :func:`~.token_stats.vocab_parallel_token_stats`.
    """
    return _token_stats(logits, None, group, vocab_size, None, -100, need_sums=False, kernel=kernel).argmax
