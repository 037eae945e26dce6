"""The demo diverging, end to end: `examples/train_gpt.py --lr 1e6` (NaN) and `--lr 0.3` (a loss that climbs).

The records, the console and the incidents must tell the same story: a NaN step is counted as a non-finite
loss step beside its per-token counts, its loss reads nan / null, and its incident says every sample is
non-finite (step-wide) instead of naming one; a climbing loss is blamed on the step, whose typical samples
never reach the skip list.
"""

from __future__ import annotations

import json
from pathlib import Path

from kit.fork_server import run_python

from twinkle_megatron.tracker.incidents import load_incidents, read_skip_list

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def _run(tmp_path: Path, lr: str, steps: int) -> tuple[str, list[dict], list[dict]]:
    flags = ["--steps", str(steps), "--log-interval", "1", "--lr", lr, "--layer-norms", "--log-dir", str(tmp_path),
             "--run-name", "run", "--backends", "stdout", "jsonl"]
    done = run_python([str(SCRIPT), *flags], timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    records = [_strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    incidents = [_strict(line) for line in (run / "incidents.jsonl").read_text().splitlines()]
    return done.stdout, records, incidents


def test_a_nan_run_is_counted_one_way(tmp_path):
    stdout, records, incidents = _run(tmp_path, "1e6", steps=2)
    step2 = records[1]
    assert step2["step"] == 2 and step2["train/nonfinite_loss_steps"] == 1
    # Per-token losses (instrument() passes GPTModel's): the loss and the token statistics count the same tokens.
    assert step2["nonfinite_losses"] == step2["nonfinite_tokens"] == 992
    assert step2["loss"] is None and step2["nonfinite"]["/loss"] == "NaN"
    line = next(line for line in stdout.splitlines() if line.startswith("step 2 |"))
    assert "loss nan" in line and "NONFINITE_LOSS_STEPS 1 | NONFINITE_LOSSES 992" in line
    incident = incidents[0]
    assert incident["step"] == 2 and "nonfinite_loss" in incident["reasons"]
    assert incident["nonfinite_samples"] == len(incident["samples"]) == 8 and incident["step_wide"] is True
    assert incident["learning_rate"] == 1e6 and incident["loss"] is None
    printed = next(line for line in stdout.splitlines() if line.startswith("[incident] step 2"))
    assert "8 non-finite samples" in printed and "step-wide" in printed and "top sample" not in printed
    assert read_skip_list(str(tmp_path / "run"), per_incident=8) == set()


def test_a_climbing_loss_is_blamed_on_the_step(tmp_path):
    stdout, records, incidents = _run(tmp_path, "0.3", steps=6)
    flagged = [record["step"] for record in records if record.get("train/loss_spike")]
    assert flagged and [incident["step"] for incident in incidents] == flagged
    for incident in load_incidents(str(tmp_path / "run")):
        assert incident["learning_rate"] == 0.3 and incident["grad_norm"] > 0
        assert set(incident["dataset_losses"]) == {"easy", "hard"}
        assert all(name.startswith("pos_") for name in incident["position_losses"])
        assert incident["step_wide"] is True, incident  # every sample within 1.5x the step's loss
        assert f"[incident] step {incident['step']}: loss_spike" in stdout
    assert read_skip_list(str(tmp_path / "run"), per_incident=8) == set()
