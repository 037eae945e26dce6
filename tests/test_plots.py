"""What the charts promise (docs/backends.md, docs/step-health.md): legends that hide no data, fraction axes that do
not magnify noise, and a per-layer gradient-norm chart drawn from a real megatron-core run's log.

Each figure is the one ``twinkle-megatron plot`` saves (``panel_figure`` / ``overview_figure``), laid out by
drawing it with matplotlib's Agg renderer, and read back through matplotlib's own geometry: the legend's window
extent against every plotted point in display coordinates.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from twinkle_megatron import keys  # noqa: E402
from twinkle_megatron.cli import main  # noqa: E402
from twinkle_megatron.logging.runlog import load_run  # noqa: E402
from twinkle_megatron.plots import (  # noqa: E402
    layer_grad_norm_grid,
    overview_figure,
    panel_figure,
    run_panels,
)


def write_log(directory, records) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "metrics.jsonl")
    with open(path, "w") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    return path


def dense_run(steps: int = 120, seed: int = 0) -> list[dict]:
    """Noisy curves that fill their panels top to bottom (the case where no corner is free for a legend): MoE
    routing health on both of its y axes, four datasets' loss and accuracy, the token metrics."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 2 + rng.random(), "train/loss_ema": 2.5, "accuracy": rng.random(),
                  "moe/imbalance_max": 1 + 3 * rng.random(), "moe/imbalance_p90": 1 + 3 * rng.random(),
                  "moe/imbalance_mean": 1 + 3 * rng.random(), "moe/dead_expert_fraction": rng.random(),
                  "moe/routing_entropy_norm": rng.random()}
        for name in ("web", "code", "math", "chat"):
            record[f"loss/{name}"] = 1 + 3 * rng.random()
            record[f"accuracy/{name}"] = rng.random()
        records.append(record)
    return records


def laid_out(figure):
    """``(figure, renderer)`` after a draw: the constrained layout applied, every extent final."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return figure, canvas.get_renderer()


def plotted_points(axes):
    """Display coordinates of every data point drawn on ``axes``: lines and scatter markers."""
    points = []
    for line in axes.lines:
        xy = line.get_xydata()
        finite = [(x, y) for x, y in xy if math.isfinite(x) and math.isfinite(y)]
        points += [tuple(p) for p in line.get_transform().transform(finite)] if finite else []
    for collection in axes.collections:
        offsets = collection.get_offsets()
        if len(offsets):
            points += [tuple(p) for p in collection.get_offset_transform().transform(offsets)]
    return points


def legends_and_points(figure, renderer):
    legends = [axes.get_legend() for axes in figure.axes if axes.get_legend() is not None]
    points = [point for axes in figure.axes for point in plotted_points(axes)]
    return [legend.get_window_extent(renderer) for legend in legends], points


@pytest.mark.parametrize("panel_name", ["moe_routing", "datasets", "loss", "accuracy"])
def test_a_legend_covers_no_plotted_point(tmp_path, panel_name):
    """Every point of every curve, on both y axes, lies outside the legend's box; the legend lies under the x axis'
    label (it hides no tick label either) and inside the saved picture."""
    log = load_run(write_log(tmp_path, dense_run()))
    panel = next(panel for panel in run_panels(log) if panel.name == panel_name)
    figure, renderer = laid_out(panel_figure(log, panel))
    boxes, points = legends_and_points(figure, renderer)
    assert len(boxes) == 1 and len(points) > 100
    box = boxes[0]
    covered = [point for point in points if box.contains(*point)]
    assert not covered, f"{panel_name}: the legend covers {len(covered)} of {len(points)} points"
    main_axes = figure.axes[0]
    assert box.y1 <= main_axes.xaxis.get_tightbbox(renderer).y0, "the legend overlaps the x axis' labels"
    assert figure.bbox.contains(box.x0, box.y0) and figure.bbox.contains(box.x1, box.y1), "cut off the picture"


def test_overview_legends_cover_no_point_and_no_other_panel(tmp_path):
    log = load_run(write_log(tmp_path, dense_run()))
    panels = [panel for panel in run_panels(log) if panel.name in ("moe_routing", "datasets", "loss", "accuracy")]
    figure, renderer = laid_out(overview_figure(log, panels))
    boxes, points = legends_and_points(figure, renderer)
    assert len(boxes) == 4
    for box in boxes:
        assert not [point for point in points if box.contains(*point)]
        others = [axes.get_window_extent(renderer) for axes in figure.axes]
        assert not [other for other in others if other.overlaps(box)], "a legend overlaps a panel"


def test_the_loss_by_position_legend_clears_its_turned_tick_labels(tmp_path):
    records = [{"step": step, **{f"loss/pos_{first}-{first + 511}": 3 - step / 10 + first / 4096
                                 for first in range(0, 8192, 512)}} for step in range(1, 11)]
    log = load_run(write_log(tmp_path, records))
    panel = next(panel for panel in run_panels(log) if panel.name == "positions")
    figure, renderer = laid_out(panel_figure(log, panel))
    (box,), points = legends_and_points(figure, renderer)
    assert not [point for point in points if box.contains(*point)]
    assert box.y1 <= figure.axes[0].xaxis.get_tightbbox(renderer).y0


def test_a_diverging_runs_accuracy_axis_does_not_magnify_noise(tmp_path):
    """Accuracy between 1.3 % and 1.9 % (a diverged run): the axis spans at least 0.1 inside [0, 1], so the noise
    is a flat line near 0, on the accuracy panel and on the per-dataset panel's accuracy axis."""
    rng = random.Random(1)
    records = [{"step": step, "loss": 7 + rng.random(), "accuracy": 0.013 + 0.006 * rng.random(),
                "eval/accuracy": 0.015, "loss/easy": 7.0, "accuracy/easy": 0.013 + 0.006 * rng.random(),
                "loss/hard": 7.5, "accuracy/hard": 0.99 + 0.01 * rng.random()} for step in range(1, 60)]
    log = load_run(write_log(tmp_path, records))
    accuracy = next(panel for panel in run_panels(log) if panel.name == "accuracy")
    low, high = panel_figure(log, accuracy).axes[0].get_ylim()
    assert (low, high) == pytest.approx((0.0, 0.1))  # centred on 1.6 %, shifted up to stay above 0
    datasets = next(panel for panel in run_panels(log) if panel.name == "datasets")
    right = panel_figure(log, datasets).axes[1]  # the twin axis: accuracy
    low, high = right.get_ylim()
    assert high - low > 0.9, "easy at 1.6 % and hard at 99.5 % already span the axis"

    records = [{"step": step, "accuracy": 0.995 + 0.004 * rng.random()} for step in range(1, 30)]
    log = load_run(write_log(tmp_path / "top", records))
    accuracy = next(panel for panel in run_panels(log) if panel.name == "accuracy")
    assert panel_figure(log, accuracy).axes[0].get_ylim() == pytest.approx((0.9, 1.0))  # shifted down below 1

    records = [{"step": step, "accuracy": 0.3 + step / 100} for step in range(1, 60)]
    log = load_run(write_log(tmp_path / "learning", records))
    accuracy = next(panel for panel in run_panels(log) if panel.name == "accuracy")
    low, high = panel_figure(log, accuracy).axes[0].get_ylim()
    assert low < 0.31 and 0.89 < high < 0.95, "a curve wider than 0.1 keeps matplotlib's fit"


# ------------------------------------------------------------------ per-layer gradient norms, from a real run


def _tracked_gpt_worker(log_dir: str) -> list[dict]:
    """World 1: a real megatron-core GPT, DDP and optimizer, 3 steps with record_grad_norms, logged to JSONL."""
    from kit.megatron_gpt import GPTSpec, make_batch
    from kit.megatron_training import build_trained_gpt, train_forward_backward

    from twinkle_megatron import MetricsTracker, TrackerConfig
    from twinkle_megatron.testing.cuda_shim import cpu_cuda_shim

    spec = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=8)
    records = []
    with cpu_cuda_shim():
        chunks, optimizer = build_trained_gpt(spec)
        tracker = MetricsTracker(config=TrackerConfig(log_interval=1, backends=("jsonl",), log_dir=log_dir))
        for step in range(1, 4):
            train_forward_backward(chunks, make_batch(spec, global_batch_size=4, seq_length=8, seed=step),
                                   micro_batch_size=2)
            tracker.record_grad_norms(chunks, optimizer)
            _, grad_norm, _ = optimizer.step()
            records.append(tracker.end_step(step, grad_norm=grad_norm))
        tracker.close()
    return records


def test_the_per_layer_gradient_norm_chart_of_a_real_run(tmp_path, capsys):
    """docs/step-health.md: the per-layer keys of record_grad_norms are charted. The heat map's cells are the
    logged norms, layer by layer and step by step, and `plot` writes layer_grad_norms.png."""
    from twinkle_megatron.testing.distributed import Layout, run_distributed

    run_dir = str(tmp_path / "run")
    records = run_distributed(_tracked_gpt_worker, layout=Layout(), args=(run_dir,), timeout=120)[0]
    log = load_run(run_dir)
    steps, layers, grid = layer_grad_norm_grid(log)
    assert steps == [1, 2, 3] and layers == [0, 1, 2, 3]
    for row, layer in enumerate(layers):
        key = keys.layer_grad_norm_key(keys.layer_part(layer, len(layers)))
        assert grid[row] == pytest.approx([record[key] for record in records], rel=1e-6)
        assert all(value > 0 for value in grid[row])

    panel = next(panel for panel in run_panels(log) if panel.name == "layer_grad_norms")
    figure, _ = laid_out(panel_figure(log, panel))
    (mesh,) = figure.axes[0].collections
    assert mesh.get_array().ravel().tolist() == pytest.approx([value for row in grid for value in row], rel=1e-6)
    assert main(["plot", run_dir]) == 0
    assert "layer_grad_norms.png" in os.listdir(os.path.join(run_dir, "plots"))
    assert "layer_grad_norms.png" in capsys.readouterr().out


def test_a_nonfinite_layer_norm_is_a_masked_cell(tmp_path):
    records = [{"step": step, **{keys.layer_grad_norm_key(keys.layer_part(layer, 3)): 0.1 * (layer + 1)
                                 for layer in range(3)}} for step in (10, 20, 30)]
    records[1][keys.layer_grad_norm_key("layer_01")] = None  # a NaN norm: null in the JSONL log
    log = load_run(write_log(tmp_path, records))
    panel = next(panel for panel in run_panels(log) if panel.name == "layer_grad_norms")
    (mesh,) = panel_figure(log, panel).axes[0].collections
    masked = mesh.get_array().mask.reshape(3, 3)
    assert masked.tolist() == [[False] * 3, [False, True, False], [False] * 3]
