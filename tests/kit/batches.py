"""A rank's part of a global batch, public in the package (``twinkle_megatron.testing.batches``); re-exported for
the tests."""

from twinkle_megatron.testing.batches import RankView, cp_positions, cp_slice, split_microbatches, thd_positions

__all__ = ["RankView", "cp_positions", "cp_slice", "split_microbatches", "thd_positions"]
