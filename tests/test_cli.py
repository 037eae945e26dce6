"""The ``twinkle-megatron`` command line: charts and summaries of a JSONL run log, and clear errors for bad logs."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from kit.fork_server import run_python

from twinkle_megatron.cli import main
from twinkle_megatron.logging.runlog import load_run
from twinkle_megatron.tracker import MetricsTracker, TrackerConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PANELS = ["overview.png", "loss.png", "accuracy.png", "token_stats.png", "throughput.png", "mfu.png", "memory.png",
              "step_time.png", "optimizer.png"]


def gpu_run_records(steps=range(10, 121, 10)) -> list[dict]:
    """A GPU-like run with every key the tracker and the token metrics report (loss falls, accuracy rises)."""
    records = []
    for step in steps:
        loss = 3.0 * math.exp(-step / 40) + 0.5
        step_time = 0.5 + (0.3 if step == 60 else 0.0)  # one straggler step
        records.append({
            "step": step, "loss": loss, "train/loss_ema": loss + 0.2, "train/loss_spike": int(step == 90),
            "accuracy": 1 - 0.9 * math.exp(-step / 40), "logprob": -loss, "entropy": 0.8 * loss,
            "grad_norm": None if step == 70 else 1 / step, "learning rate": 3e-4,
            "perf/tokens_per_second": 4096 / step_time, "perf/tokens_per_second_ema": 8000.0,
            "perf/tflops_per_gpu": 300.0, "perf/mfu": 0.4, "perf/mfu_ema": 0.39, "perf/step_time": step_time,
            "perf/step_time_min": 0.45, "perf/step_time_ema": 0.52, "perf/slowest_rank": 3 if step == 60 else 0,
            "memory/allocated_gib": 20.0, "memory/peak_allocated_gib": 50.0, "memory/reserved_gib": 60.0,
            "memory/peak_reserved_gib": 62.0, "memory/total_gib": 80.0, "memory/utilization": 0.775,
        })
    records.append({"step": 120, "eval/loss": 0.8, "eval/accuracy": 0.9})
    return records


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def run_cli(*argv: str) -> int:
    """``main(argv)``'s exit status, whether it returns or exits."""
    try:
        return main(list(argv))
    except SystemExit as exit_:
        return exit_.code


def assert_png(path: str) -> None:
    with open(path, "rb") as file:
        assert file.read(8) == PNG_MAGIC, f"{path} is not a PNG"
    assert os.path.getsize(path) > 10_000, f"{path} is suspiciously small: an empty chart?"


# ------------------------------------------------------------------ plot


def test_plot_writes_every_panel_of_a_full_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_jsonl(tmp_path / "metrics.jsonl", gpu_run_records())
    out = tmp_path / "plots"
    assert run_cli("plot", log, "-o", str(out)) == 0
    assert sorted(os.listdir(out)) == sorted(ALL_PANELS)
    for name in ALL_PANELS:
        assert_png(str(out / name))
    printed = capsys.readouterr().out
    assert f"wrote {len(ALL_PANELS)} charts to {out}" in printed
    assert all(name in printed for name in ALL_PANELS)
    assert "skipped" not in printed


def test_plot_draws_per_dataset_curves_on_one_panel(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    records = [{"step": step, "loss": 2.0, "loss/web": 3.0 - step / 100, "loss/code": 1.0 + step / 200,
                "accuracy/web": 0.3, "accuracy/code": step / 200} for step in range(10, 101, 10)]
    log = write_jsonl(tmp_path / "metrics.jsonl", records)
    out = tmp_path / "plots"
    assert run_cli("plot", log, "-o", str(out)) == 0
    assert "datasets.png" in os.listdir(out)
    assert_png(str(out / "datasets.png"))
    assert run_cli("summary", log) == 0
    printed = capsys.readouterr().out
    assert "loss/web" in printed and "accuracy/code" in printed


def test_plot_of_a_real_cpu_tracker_log_skips_what_cpu_runs_lack(tmp_path, capsys):
    """The tracker's own JSONL (CPU: no memory, no MFU) → the charts it can have, default output dir."""
    pytest.importorskip("matplotlib")
    tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=("jsonl",), log_dir=str(tmp_path / "run")))
    for step in range(1, 9):
        tracker.start_step()
        tracker.end_step(step, loss=torch.tensor([64.0 * 2 / step, 64.0]), grad_norm=1 / step, lr=1e-3, tokens=64)
    tracker.log_eval(loss=0.3)
    tracker.close()

    assert run_cli("plot", str(tmp_path / "run")) == 0  # a run directory works; charts go to RUN_DIR/plots
    out = tmp_path / "run" / "plots"
    assert sorted(os.listdir(out)) == sorted(["overview.png", "loss.png", "throughput.png", "step_time.png",
                                              "optimizer.png"])
    for name in os.listdir(out):
        assert_png(str(out / name))
    assert "skipped (keys not in the log): accuracy, token_stats, mfu, memory" in capsys.readouterr().out


def test_plot_extra_keys_and_unknown_keys(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = write_jsonl(tmp_path / "metrics.jsonl",
                      [{"step": step, "reward/mean": step / 10, "kl": 0.01} for step in range(1, 6)])
    out = tmp_path / "plots"
    assert run_cli("plot", log, "-o", str(out), "--keys", "reward/mean") == 0
    assert sorted(os.listdir(out)) == ["overview.png", "reward_mean.png"]
    assert_png(str(out / "reward_mean.png"))
    assert run_cli("plot", log, "-o", str(out), "--keys", "rewards") == 2
    assert "--keys rewards: not in" in capsys.readouterr().err
    assert run_cli("plot", log, "-o", str(tmp_path / "none")) == 2  # no charted key, no --keys
    assert "nothing to plot" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    log = write_jsonl(tmp_path / "metrics.jsonl", gpu_run_records())
    assert run_cli("plot", log, "-o", str(tmp_path / "plots")) == 1
    err = capsys.readouterr().err
    assert "pip install matplotlib" in err and "pip install -e '.[plot]'" in err


# ------------------------------------------------------------------ summary


def test_summary_prints_a_table(tmp_path, capsys):
    records = gpu_run_records()
    log = write_jsonl(tmp_path / "metrics.jsonl", records)
    assert run_cli("summary", log) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run: {log}"
    assert lines[1] == "records: 13 (steps 10..120; 1 with eval/* keys)"
    assert lines[3].split() == ["key", "n", "non-finite", "first", "last", "min", "max", "mean"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[4:]}
    losses = [record["loss"] for record in records if "loss" in record]
    assert rows["loss"] == ["12", "0", f"{losses[0]:.5g}", f"{losses[-1]:.5g}", f"{min(losses):.5g}",
                            f"{max(losses):.5g}", f"{sum(losses) / len(losses):.5g}"]
    assert rows["grad_norm"][:2] == ["11", "1"]  # the null (non-finite) value is counted apart
    assert rows["perf/slowest_rank"] == ["12", "0", "0", "0", "0", "3", "0.25"]
    assert rows["perf/tokens_per_second"][2] == "8192"  # whole numbers print without an exponent
    assert list(rows)[:3] == ["loss", "train/loss_ema", "train/loss_spike"]  # reading order, eval/* last
    assert list(rows)[-2:] == ["eval/accuracy", "eval/loss"]


def test_a_half_written_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    """A run still writing its log can be looked at; a broken line elsewhere cannot (see below)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert run_cli("summary", str(path)) == 0
    captured = capsys.readouterr()
    assert "records: 2 (steps 1..2)" in captured.out
    assert "line 3: incomplete last line skipped" in captured.err
    assert [record["step"] for record in load_run(str(path)).records] == [1, 2]


# ------------------------------------------------------------------ bad logs: exit 2, a clear message, no traceback

BAD_LOGS = {
    "empty": ("", "is empty: it holds no records"),
    "blank lines only": ("\n  \n\n", "is empty: it holds no records"),
    "malformed line": ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": }\n{"step": 3}\n',
                       "line 2: not valid JSON (Expecting value, column 21)"),
    "not an object": ('{"step": 1}\n[1, 2]\n', "line 2: expected a JSON object"),
    "no step": ('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n', 'line 2: the record has no "step" (keys: loss)'),
    "step not an integer": ('{"step": "ten", "loss": 2.0}\n', 'line 1: "step" must be an integer, got \'ten\''),
}


@pytest.mark.parametrize("command", ["plot", "summary"])
@pytest.mark.parametrize("case", sorted(BAD_LOGS))
def test_bad_logs_are_rejected_with_the_line(tmp_path, capsys, command, case):
    text, message = BAD_LOGS[case]
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    assert run_cli(command, str(path), *(["-o", str(tmp_path / "plots")] if command == "plot" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinkle-megatron: error: ") and message in err, err
    assert not (tmp_path / "plots").exists()  # nothing written for a bad log


@pytest.mark.parametrize("command", ["plot", "summary"])
def test_missing_file_and_directory_without_log(tmp_path, capsys, command):
    assert run_cli(command, str(tmp_path / "nope.jsonl")) == 2
    assert f"twinkle-megatron: error: {tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err
    assert run_cli(command, str(tmp_path)) == 2
    assert "is a directory without a metrics.jsonl" in capsys.readouterr().err


def test_help_and_usage_errors(capsys):
    assert run_cli("--help") == 0
    assert "plot" in capsys.readouterr().out
    assert run_cli("plot", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "overview.png" in text
    assert "(default: a 'plots' directory next to the log)" in text and "(default: none)" in text
    assert run_cli("--version") == 0
    from twinkle_megatron import __version__

    assert capsys.readouterr().out.strip() == f"twinkle-megatron {__version__}"
    assert run_cli() == 2  # no command: argparse's usage error
    assert "error:" in capsys.readouterr().err


def test_the_module_runs_as_a_program_without_a_traceback(tmp_path):
    """What the console script does: a real process, a malformed log, exit 2 and one clear line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n')
    result = run_python(["-m", "twinkle_megatron.cli", "summary", str(path)], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"twinkle-megatron: error: {path}, line 2: not valid JSON " \
                                    "(Expecting value, column 1)"


# ------------------------------------------------------------------ logs that hold more than one timeline


def test_repeated_and_backward_steps_warn_and_the_later_value_wins(tmp_path, capsys):
    """Two runs appended to one log by other means (not the tracker, whose restarts supersede)."""
    records = [{"step": 1, "loss": 3.0}, {"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.0},
               {"step": 10, "eval/loss": 1.1},  # same step, other key: normal, no warning
               {"step": 5, "loss": 2.5}, {"step": 10, "loss": 1.5}]  # restarted at 5 without superseding
    log = write_jsonl(tmp_path / "metrics.jsonl", records)
    assert run_cli("summary", log) == 0
    captured = capsys.readouterr()
    assert "steps go backwards 1 time(s), first at line 5: step 5 after step 10 (line 4)" in captured.err
    assert "2 value(s) logged twice for the same step, first 'loss' at step 5 (lines 2 and 5); " \
           "the later value is used" in captured.err
    rows = {line.split()[0]: line.split()[1:] for line in captured.out.splitlines()[4:]}
    assert rows["loss"][:3] == ["3", "3", "1.5"], "n, first, last: steps 1, 5, 10 once each, later values"
    assert load_run(log).series("loss") == ([1, 5, 10], [3.0, 2.5, 1.5])
    assert load_run(log).series("eval/loss") == ([10], [1.1])


def test_a_tracker_log_after_a_restart_reads_without_warnings(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    for _ in range(2):  # a requeue before the first checkpoint: the run starts at step 1 again
        tracker = MetricsTracker(config=TrackerConfig(log_interval=2, backends=("jsonl",), log_dir=str(tmp_path)))
        for step in range(1, 5):
            tracker.end_step(step, loss=1.0)
        tracker.close()
    assert run_cli("summary", str(path)) == 0
    assert capsys.readouterr().err == ""
