"""MoE routing health as a user sees it: the key table of the docs, the plot's routing panel and heat map,
and the demo's MoE variant (its run log, its chart and its refused flags).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from kit.example_script import load_train_gpt
from kit.fork_server import run_python
from kit.moe_cases import routing_map, small_moe_metric
from kit.readme import key_table

from twinkle_megatron import keys

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the key table, the plot


def test_the_docs_list_exactly_the_moe_key_table():
    assert key_table("moe") == [key for key, _ in keys.MOE_KEYS]
    assert all(key.startswith(keys.MOE_PREFIX) for key, _ in keys.MOE_KEYS)


def test_plot_draws_the_routing_panel_and_the_expert_load_heat_map(tmp_path):
    pytest.importorskip("matplotlib")
    from twinkle_megatron.cli import main

    metric = small_moe_metric(per_layer=True)
    log = tmp_path / "metrics.jsonl"
    with log.open("w") as file:
        for step in (1, 2):
            metric.record_routing(1, routing_map([(0, 1), (0, 2), (0, 3), (1, 2)]))
            metric.record_routing(3, routing_map([(0, 1)] * 4))
            file.write(json.dumps({"step": step, "loss": 1.0 / step, **metric.calculate()}) + "\n")
    assert main(["plot", str(log), "-o", str(tmp_path / "plots")]) == 0
    written = {path.name for path in (tmp_path / "plots").iterdir()}
    assert {"moe_routing.png", "moe_load.png", "overview.png"} <= written
    from twinkle_megatron.cli import load_run
    from twinkle_megatron.plots import expert_load_grid

    layers, grid = expert_load_grid(load_run(str(log)))
    assert layers == [0, 2] and grid == [[1.5, 1.0, 1.0, 0.5], [2.0, 2.0, 0.0, 0.0]]


# ------------------------------------------------------------------ the demo's MoE variant


def test_the_moe_demo_logs_and_charts_routing_health(tmp_path):
    """examples/train_gpt.py --moe-experts 4 --moe-topk 2 on PP2 × DP2 × EP2 CPU ranks (Megatron's DDP,
    optimizer and 1F1B schedule): every record has the moe/ aggregates and the per-layer loads; plot charts them."""
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--tp", "1", "--pp", "2", "--dp", "2",
               "--ep", "2", "--moe-experts", "4", "--moe-topk", "2", "--steps", "2", "--log-interval", "1",
               "--log-dir", str(tmp_path), "--run-name", "run", "--backends", "jsonl", "stdout"]
    done = run_python(command[1:], timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = tmp_path / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    aggregates = {key for key, _ in keys.MOE_KEYS} - {keys.MOE_NONFINITE_ROUTER_TOKENS,
                                                       "moe/seq_load_balancing_loss", "moe/global_load_balancing_loss"}
    for record in records:
        assert aggregates <= set(record), aggregates - set(record)
        assert record[keys.MOE_TOKENS] == 4 * 4 * 32 * 2  # microbatches × micro batch × sequence × DP, per layer
        assert all(f"moe/layer_{i}/expert_{e}_utilization" in record for i in range(4) for e in range(4))
        assert 1.0 <= record[keys.MOE_IMBALANCE_MAX] <= 4 / 2
    line = next(line for line in done.stdout.splitlines() if line.startswith("step 2 |"))
    assert "moe/imbalance_max" in line and "moe/layer_" not in line, "per-layer keys stay off the console line"
    pytest.importorskip("matplotlib")
    from twinkle_megatron.cli import main

    assert main(["plot", str(log), "-o", str(tmp_path / "plots")]) == 0
    assert {"moe_routing.png", "moe_load.png"} <= {path.name for path in (tmp_path / "plots").iterdir()}


@pytest.mark.parametrize("flags, message", [
    (dict(moe_experts=4, moe_topk=5), "--moe-topk 5 is more than --moe-experts 4"),
    (dict(moe_experts=6, ep=4, dp=4), "--moe-experts 6 is not divisible by --ep 4"),
    (dict(moe_experts=4, ep=4, dp=2), "--ep 4 does not divide --dp 2"),
    (dict(moe_experts=4, tp=2), "use --tp 1 on CPU"),
    (dict(ep=2), "--ep 2 needs MoE layers"),
])
def test_impossible_moe_flags_are_refused(flags, message):
    script = load_train_gpt("train_gpt_moe")
    args = script.parse_args(["--tp", "1", "--dp", "2", "--device", "cpu"])
    problems = script.flag_problems(argparse.Namespace(**{**vars(args), **flags}))
    assert any(message in problem for problem in problems), problems
