"""The runnable examples in the public docstrings (the metrics, the collection, the ops) run and say what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["twinkle_megatron.metric.language.accuracy", "twinkle_megatron.metric.language.token_stats",
           "twinkle_megatron.metric.language.loss", "twinkle_megatron.metric.language.train",
           "twinkle_megatron.metric.rl.grpo",
           "twinkle_megatron.metric.rl.dpo", "twinkle_megatron.metric.language.embedding",
           "twinkle_megatron.metric.rl.completion_reward", "twinkle_megatron.metric.rl.ppo",
           "twinkle_megatron.metric.collection", "twinkle_megatron.ops.token_stats",
           "twinkle_megatron.testing.invariance"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0
