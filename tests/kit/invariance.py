"""Layout invariance in one call, public in the package (``twinkle_megatron.testing.invariance``); re-exported for
the tests."""

from twinkle_megatron.testing.invariance import (
    LAYOUTS,
    Call,
    RankRun,
    assert_layout_invariant,
    assert_matches,
    calculate_or_error,
    run_calls,
    run_variants,
)

__all__ = ["LAYOUTS", "Call", "RankRun", "assert_layout_invariant", "assert_matches", "calculate_or_error",
           "run_calls", "run_variants"]
