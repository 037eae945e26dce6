"""Statistics by token position: each token's position in its own sequence, and position buckets.

A token-level metric built with ``position_buckets=`` also reports each of its
statistics per bucket of positions, ``key/pos_<first>-<last>`` (``loss/pos_0-511``,
``accuracy/pos_512-1023``), as a ``[B]`` twin state ``name/positions`` in the
collection's one sync (the partition mechanism of :mod:`.groups`):

* ``position_buckets=[e_0, e_1, …, e_B]``: increasing edges, bucket ``b`` holds
  positions ``e_b ≤ p < e_{b+1}``;
* ``position_buckets=B`` with ``seq_length=L``: ``B`` equal buckets over
  ``[0, L)`` (edges ``⌊b·L/B⌋``).

Tokens at positions outside ``[e_0, e_B)`` are in no bucket (the global
statistics keep them). A bucket's value is the statistic over its tokens
alone: sums and counts per bucket, the same reduction as the global key.

The **position** of a token is its index in its own sequence, the same under
every layout: under context parallelism a rank's chunks ``i`` and ``2·cp−1−i``
are mapped back (:func:`.context_parallel.global_positions`); in a packed row
(:mod:`..inputs.packed`) positions restart at 0 in every sub-sequence.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ...keys import position_bucket_key
from .groups import POSITIONS_SUFFIX, TokenGroups


class PositionBuckets(NamedTuple):
    """Bucket edges ``e_0 < … < e_B`` and the bucket names ``pos_<e_b>-<e_{b+1}−1>`` (``keys.position_bucket_key``)."""

    edges: tuple[int, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(position_bucket_key(first, end) for first, end in zip(self.edges[:-1], self.edges[1:]))

    @property
    def partition(self) -> tuple[str, tuple[str, ...]]:
        """(twin suffix, slice names): the partition of the tokens the buckets make (see :mod:`.groups`)."""
        return POSITIONS_SUFFIX, self.labels

    def of(self, positions: torch.Tensor, shape: torch.Size) -> TokenGroups:
        """The bucket of each token of ``shape`` (a :class:`TokenGroups` of the ``/positions`` partition) from
        its position; ``positions`` broadcasts to ``shape`` (one row of positions serves every row)."""
        edges = _edges_on(self.edges, positions.device)
        positions = positions.to(torch.int64)
        # The number of inner edges at or below p: B comparisons per position (B is small), no searchsorted.
        ids = (positions[..., None] >= edges[1:-1]).sum(-1)
        in_range = (positions >= edges[0]) & (positions < edges[-1])
        return TokenGroups(ids.expand(shape), in_range.expand(shape), len(self.edges) - 1, POSITIONS_SUFFIX)


@functools.lru_cache(maxsize=16)
def _edges_on(edges: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The edges as a device tensor, copied to each device once (not once per microbatch)."""
    return torch.tensor(edges, dtype=torch.int64, device=device)


def position_buckets(buckets: Union[None, int, Sequence[int]], seq_length: Optional[int] = None
                     ) -> Optional[PositionBuckets]:
    """``position_buckets`` (a count with ``seq_length``, or the edges) checked; None when not given."""
    if buckets is None:
        return None
    if isinstance(buckets, bool) or not isinstance(buckets, (int, list, tuple)):
        raise ValueError(f"position_buckets must be a number of buckets or a list of edges, got {buckets!r}")
    if isinstance(buckets, int):
        if buckets < 1 or seq_length is None or isinstance(seq_length, bool) or not isinstance(seq_length, int) \
                or seq_length < buckets:
            raise ValueError(f"position_buckets={buckets} (equal buckets) needs seq_length=L, an int >= the "
                             f"number of buckets, got seq_length={seq_length!r}")
        edges = tuple(index * seq_length // buckets for index in range(buckets + 1))
    else:
        edges = tuple(buckets)
        if len(edges) < 2 or any(isinstance(e, bool) or not isinstance(e, int) for e in edges) or edges[0] < 0 \
                or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
            raise ValueError(f"position_buckets edges must be at least two increasing ints >= 0, got {buckets!r}")
    return PositionBuckets(edges)
