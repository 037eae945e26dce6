"""PNG charts of a run log (``twinkle-megatron plot``).

Each panel is a small function drawing on one matplotlib ``Axes``; the same
function draws the panel's own PNG and its cell in ``overview.png``. A panel
is drawn only when the log has at least one of its keys (no GPU: no memory
panel; no peak FLOP/s known: throughput without MFU).

matplotlib is an optional extra (``pip install matplotlib``, or the ``plot`` extra) and
is imported only here, when a chart is drawn. Figures are built with
``matplotlib.figure.Figure`` rather than ``pyplot``: that renders PNGs with the
Agg backend directly, needs no display, and leaves the caller's pyplot state
and backend choice alone.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

from .. import keys
from .axes_style import fraction_axis, legend_below
from .incidents import mark_incidents
from .layer_norms import draw_layer_grad_norms, layer_grad_norm_keys
from .positions import draw_loss_by_position, position_keys

if TYPE_CHECKING:
    from ..logging.runlog import RunLog

MARKERS_UP_TO = 40  # points per series; fewer get markers, so a short run is more than a bare line


class MissingMatplotlib(ImportError):
    """Plotting was asked for and matplotlib is not installed."""


@dataclass(frozen=True)
class Panel:
    """One chart: ``draw(axes, log)`` is called when the log has any of ``keys``."""

    name: str  # file name: NAME.png
    title: Union[str, Callable[[RunLog], str]]  # or a function of the log, for a panel that adapts
    keys: Tuple[str, ...]
    draw: Callable[[Any, RunLog], None]


# ------------------------------------------------------------------ drawing helpers


def _line(axes: Any, log: RunLog, key: str, label: str, **style: Any) -> Optional[Any]:
    """Plot ``key`` over steps (NaN values leave gaps); ``None`` when the log has no finite value of it."""
    steps, values = log.series(key)
    if not any(math.isfinite(value) for value in values):
        return None
    if len(steps) <= MARKERS_UP_TO:
        style = {"marker": "o", "markersize": 3, **style}
    (handle,) = axes.plot(steps, values, label=label, **style)
    return handle


def _finish(axes: Any, handles: Sequence[Optional[Any]], ylabel: str, percent: bool = False) -> None:
    """Axis labels, grid, integer steps and one legend for the handles of both y axes, below the axes."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if percent:
        axes.yaxis.set_major_formatter(PercentFormatter(1.0))
    legend_below(axes, [handle for handle in handles if handle is not None])


def _twin(axes: Any, ylabel: str, color: str) -> Any:
    """A second y axis on the right for a series of another unit, coloured like it.

    The main axes are raised above it: their curves are the panel's subject
    and are drawn over the second axis' series.
    """
    right = axes.twinx()
    axes.set_zorder(right.get_zorder() + 1)
    axes.patch.set_visible(False)
    right.set_ylabel(ylabel, color=color)
    right.tick_params(axis="y", colors=color)
    return right


# ------------------------------------------------------------------ panels


def _draw_loss(axes: Any, log: RunLog) -> None:
    handles = [_line(axes, log, keys.LOSS, "loss", color="C0", alpha=0.45, linewidth=1),
               _line(axes, log, keys.LOSS_EMA, "loss (EMA)", color="C0", linewidth=2.2),
               _line(axes, log, "eval/loss", "eval loss", color="C3", linewidth=1.5)]
    steps, spikes = log.series(keys.LOSS_SPIKE)
    losses = dict(zip(*log.series(keys.LOSS)))
    spiked = [step for step, spike in zip(steps, spikes) if spike == 1 and step in losses]
    if spiked:  # where the loss jumped above its EMA by more than the tracker's threshold
        handles.append(axes.scatter(spiked, [losses[step] for step in spiked], marker="x", color="C3", s=40,
                                    zorder=3, label="loss spike"))
    handles.append(mark_incidents(axes, log.path))  # incidents.jsonl beside the log: named samples
    _finish(axes, handles, "loss")


def _draw_accuracy(axes: Any, log: RunLog) -> None:
    handles = [_line(axes, log, "accuracy", "token accuracy", color="C2", linewidth=1.8),
               _line(axes, log, "eval/accuracy", "eval accuracy", color="C3", linewidth=1.5)]
    fraction_axis(axes)
    _finish(axes, handles, "accuracy", percent=True)


def _draw_token_stats(axes: Any, log: RunLog) -> None:
    handles = [_line(axes, log, "entropy", "entropy of the prediction", color="C4", linewidth=1.8),
               _line(axes, log, "logprob", "log-probability of the label", color="C1", linewidth=1.8)]
    axes.axhline(0.0, color="black", linewidth=0.6, alpha=0.5)
    _finish(axes, handles, "nats per token")


def _draw_throughput(axes: Any, log: RunLog) -> None:
    handles = [_line(axes, log, keys.TOKENS_PER_SECOND, "tokens/s", color="C0", alpha=0.45, linewidth=1),
               _line(axes, log, keys.TOKENS_PER_SECOND_EMA, "tokens/s (EMA)", color="C0", linewidth=2.2)]
    _second_scale(axes, log, keys.TOKENS_PER_SECOND, keys.TOKENS_PER_SECOND_PER_GPU, "tokens/s per GPU")
    axes.set_ylim(bottom=0)
    _finish(axes, handles, "tokens/s (all GPUs)")


def _draw_mfu(axes: Any, log: RunLog) -> None:
    """MFU needs a known peak FLOP/s (GPUs); without it the achieved TFLOP/s are charted alone."""
    if keys.MFU in log.keys or keys.MFU_EMA in log.keys:
        handles = [_line(axes, log, keys.MFU, "MFU", color="C3", alpha=0.45, linewidth=1),
                   _line(axes, log, keys.MFU_EMA, "MFU (EMA)", color="C3", linewidth=2.2)]
        _second_scale(axes, log, keys.MFU, keys.TFLOPS_PER_GPU, "TFLOP/s per GPU")
        axes.set_ylim(bottom=0)
        _finish(axes, handles, "model FLOPs utilization", percent=True)
    else:
        handles = [_line(axes, log, keys.TFLOPS_PER_GPU, "TFLOP/s per GPU", color="C3", linewidth=1.5)]
        axes.set_ylim(bottom=0)
        _finish(axes, handles, "TFLOP/s per GPU")


def _mfu_title(log: RunLog) -> str:
    return "Model FLOPs utilization" if keys.MFU in log.keys else "TFLOP/s per GPU (no known peak, so no MFU)"


def _second_scale(axes: Any, log: RunLog, key: str, other: str, label: str) -> None:
    """A right-hand axis reading the same curve in ``other``'s unit, when ``other`` is proportional to ``key``.

    tokens/s per GPU = tokens/s / GPUs and TFLOP/s = MFU · peak: a second line
    would lie exactly on the first, so a second scale says the same more clearly.
    """
    pairs = dict(zip(*log.series(key)))
    ratios = [value / pairs[step] for step, value in zip(*log.series(other))
              if step in pairs and math.isfinite(value) and math.isfinite(pairs[step]) and pairs[step] != 0]
    if not ratios:
        return
    factor = sorted(ratios)[len(ratios) // 2]  # the median: constant anyway, robust to a stray record
    if factor <= 0:
        return
    right = axes.secondary_yaxis("right", functions=(lambda x: x * factor, lambda y: y / factor))
    right.set_ylabel(label)


def _draw_memory(axes: Any, log: RunLog) -> None:
    handles = [_line(axes, log, keys.MEMORY_ALLOCATED, "allocated", color="C0", linewidth=1.8),
               _line(axes, log, keys.MEMORY_PEAK_ALLOCATED, "peak allocated", color="C0", linestyle="--"),
               _line(axes, log, keys.MEMORY_RESERVED, "reserved", color="C1", linewidth=1.8),
               _line(axes, log, keys.MEMORY_PEAK_RESERVED, "peak reserved", color="C1", linestyle="--"),
               _line(axes, log, keys.MEMORY_TOTAL, "device capacity", color="black", linestyle=":")]
    _finish(axes, handles, "GiB (max over ranks)")


def _draw_step_time(axes: Any, log: RunLog) -> None:
    """The band spans the fastest to the slowest rank: a wide band means a straggler holds everyone up."""
    handles: List[Optional[Any]] = []
    steps, slowest = log.series(keys.STEP_TIME)
    fastest = dict(zip(*log.series(keys.STEP_TIME_MIN)))
    banded = [(step, fastest[step], value) for step, value in zip(steps, slowest) if step in fastest]
    if banded:
        handles.append(axes.fill_between([s for s, _, _ in banded], [low for _, low, _ in banded],
                                         [high for _, _, high in banded], color="C0", alpha=0.2, linewidth=0,
                                         label="fastest..slowest rank"))
    handles += [_line(axes, log, keys.STEP_TIME, "step time (slowest rank)", color="C0", linewidth=1.2),
                _line(axes, log, keys.STEP_TIME_EMA, "step time (EMA)", color="navy", linewidth=2, alpha=0.8)]
    rank_steps, ranks = log.series(keys.SLOWEST_RANK)
    top_rank = max([r for r in ranks if math.isfinite(r)], default=0)
    if top_rank > 0:  # always rank 0 (one process, say): nothing to point at
        from matplotlib.ticker import MaxNLocator

        right = _twin(axes, "slowest rank", "C3")
        handles.append(right.scatter(rank_steps, ranks, color="C3", marker="D", s=14, label="slowest rank"))
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_ylim(-0.5, top_rank + 0.5)
    axes.set_ylim(bottom=0)
    _finish(axes, handles, "seconds per step")


def _draw_optimizer(axes: Any, log: RunLog) -> None:
    from matplotlib.ticker import FormatStrFormatter

    handles = [_line(axes, log, keys.GRAD_NORM, "gradient norm", color="C0", linewidth=1.5)]
    if keys.LEARNING_RATE in log.keys:
        right = _twin(axes, "learning rate", "C1")
        handles.append(_line(right, log, keys.LEARNING_RATE, "learning rate", color="C1", linewidth=1.5))
        right.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))  # no "1e-4" offset text over the title
    _finish(axes, handles, "gradient norm")


PANELS: Tuple[Panel, ...] = (
    Panel("loss", "Loss", (keys.LOSS, keys.LOSS_EMA, "eval/loss"), _draw_loss),
    Panel("accuracy", "Token accuracy", ("accuracy", "eval/accuracy"), _draw_accuracy),
    Panel("token_stats", "Entropy and label log-probability", ("entropy", "logprob"), _draw_token_stats),
    Panel("throughput", "Throughput", (keys.TOKENS_PER_SECOND, keys.TOKENS_PER_SECOND_EMA), _draw_throughput),
    Panel("mfu", _mfu_title, (keys.MFU, keys.MFU_EMA, keys.TFLOPS_PER_GPU), _draw_mfu),
    Panel("memory", "Device memory", (keys.MEMORY_ALLOCATED, keys.MEMORY_PEAK_ALLOCATED, keys.MEMORY_RESERVED,
                                      keys.MEMORY_PEAK_RESERVED), _draw_memory),
    Panel("step_time", "Step time and stragglers", (keys.STEP_TIME, keys.STEP_TIME_EMA), _draw_step_time),
    Panel("optimizer", "Gradient norm and learning rate", (keys.GRAD_NORM, keys.LEARNING_RATE), _draw_optimizer),
)


def key_panel(key: str) -> Panel:
    """A panel of one key (``--keys``), with its ``eval/`` counterpart when the log has one."""
    def draw(axes: Any, log: RunLog) -> None:
        handles = [_line(axes, log, key, key, color="C0", linewidth=1.5)]
        if not key.startswith("eval/"):
            handles.append(_line(axes, log, f"eval/{key}", f"eval/{key}", color="C3", linewidth=1.5))
        _finish(axes, handles, key)

    return Panel(re.sub(r"[^A-Za-z0-9_.-]+", "_", key), key, (key,), draw)


# ------------------------------------------------------------------ figures


def plot_run(log: RunLog, output_dir: str, extra_keys: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """Write ``overview.png`` and one ``<panel>.png`` per panel with data to ``output_dir``.

    Returns the paths written (overview first) and the names of the panels
    skipped because the log has none of their keys. Raises
    :class:`MissingMatplotlib` when matplotlib is not installed.
    """
    _figure_class()  # no matplotlib: say so before anything is written
    panels = run_panels(log, extra_keys)
    present = set(log.keys)
    drawn = [panel for panel in panels if _has_data(log, panel, present)]
    skipped = [panel.name for panel in panels if panel not in drawn]
    if not drawn:
        return [], skipped
    os.makedirs(output_dir, exist_ok=True)
    written = [_save(overview_figure(log, drawn), os.path.join(output_dir, "overview.png"))]
    for panel in drawn:
        written.append(_save(panel_figure(log, panel), os.path.join(output_dir, f"{panel.name}.png")))
    return written, skipped


def run_panels(log: RunLog, extra_keys: Sequence[str] = ()) -> List[Panel]:
    """Every panel :func:`plot_run` considers for ``log``: the fixed ones, then those the log's keys call for
    (per dataset, by position, per layer, MoE), then one per extra key."""
    by_position = [Panel("positions", "Loss by position", tuple(key for *_, key in position_keys(log)),
                         draw_loss_by_position)] if position_keys(log) else []
    return [*PANELS, *dataset_panels(log), *by_position, *layer_norm_panels(log), *moe_panels(log),
            *(key_panel(key) for key in extra_keys)]


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingMatplotlib("matplotlib is not installed") from error
    return Figure


def _run_title(log: RunLog) -> str:
    steps = [record["step"] for record in log.records]
    return f"{os.path.basename(os.path.dirname(os.path.abspath(log.path))) or log.path}: " \
           f"steps {steps[0]}..{steps[-1]}, {len(log.records)} records"


def overview_figure(log: RunLog, panels: Sequence[Panel]) -> Any:
    """The figure of ``overview.png``: ``panels`` in two columns (one for a single panel), under the run's title."""
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    overview = _figure_class()(figsize=(7.5 * columns, 3.8 * rows), dpi=100, layout="constrained")
    overview.suptitle(_run_title(log), fontsize="large")
    for index, panel in enumerate(panels):
        axes = overview.add_subplot(rows, columns, index + 1)
        axes.set_title(_title(panel, log))
        panel.draw(axes, log)
    return overview


def panel_figure(log: RunLog, panel: Panel) -> Any:
    """The figure of ``<panel>.png``: the panel alone, titled with the run."""
    figure = _figure_class()(figsize=(8, 4.5), dpi=110, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(f"{_title(panel, log)} ({_run_title(log)})", fontsize="medium")
    panel.draw(axes, log)
    return figure


def _title(panel: Panel, log: RunLog) -> str:
    return panel.title(log) if callable(panel.title) else panel.title


def _has_data(log: RunLog, panel: Panel, present: set) -> bool:
    """Any of the panel's keys with at least one finite value (an all-null key draws nothing)."""
    return any(key in present and any(math.isfinite(v) for v in log.series(key)[1]) for key in panel.keys)


def _save(figure: Any, path: str) -> str:
    figure.savefig(path, format="png")
    return path


# ------------------------------------------------------------------ MoE routing health (moe/ keys)

_EXPERT_UTILIZATION = re.compile(r"^moe/layer_(\d+)/expert_(\d+)_utilization$")


def _draw_moe_routing(axes: Any, log: RunLog) -> None:
    """Imbalance across layers (mean, p90, max; 1 = balanced) on the left; shares in [0, 1] on the right."""
    handles = [_line(axes, log, keys.MOE_IMBALANCE_MAX, "imbalance, worst layer", color="C3", linewidth=1.8),
               _line(axes, log, keys.MOE_IMBALANCE_P90, "imbalance p90", color="C1", linewidth=1.5),
               _line(axes, log, keys.MOE_IMBALANCE_MEAN, "imbalance mean", color="C0", linewidth=1.8)]
    axes.axhline(1.0, color="black", linewidth=0.6, alpha=0.5)
    right = _twin(axes, "share", "C2")
    handles += [_line(right, log, keys.MOE_DEAD_EXPERT_FRACTION, "dead experts", color="C2", linestyle="--"),
                _line(right, log, keys.MOE_ROUTING_ENTROPY_NORM, "exp(routing entropy) / experts", color="C4",
                      linestyle="--")]
    right.set_ylim(0, 1.05)
    _finish(axes, handles, "max expert load / balanced load")


def expert_load_grid(log: RunLog) -> Tuple[List[int], List[List[float]]]:
    """``(layers, grid)`` of the last record with per-expert utilisation keys: ``grid[i][e]`` is expert ``e``'s
    utilisation in layer ``layers[i]`` (NaN where the record lacks it); ``([], [])`` when no record has one."""
    for record in reversed(log.records):
        cells = {}
        for key, value in record.items():
            match = _EXPERT_UTILIZATION.match(key)
            if match:
                cells[int(match.group(1)), int(match.group(2))] = value
        if cells:
            layers = sorted({layer for layer, _ in cells})
            experts = max(expert for _, expert in cells) + 1
            return layers, [[cells.get((layer, e), math.nan) for e in range(experts)] for layer in layers]
    return [], []


def _draw_moe_load(axes: Any, log: RunLog) -> None:
    """Layer × expert utilisation of the last interval; 1 (white) is the balanced share, 0 a dead expert."""
    from matplotlib.colors import TwoSlopeNorm

    layers, grid = expert_load_grid(log)
    finite = [value for row in grid for value in row if math.isfinite(value)]
    top = max(2.0, max(finite, default=2.0))
    image = axes.imshow(grid, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top),
                        interpolation="nearest")
    axes.figure.colorbar(image, ax=axes, label="utilisation (1 = balanced)")
    axes.set_xlabel("expert")
    axes.set_ylabel("layer")
    axes.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    experts = len(grid[0]) if grid else 0
    if experts <= 32:
        axes.set_xticks(range(experts))
    for row, layer_values in enumerate(grid):  # dead experts stand out as crosses
        for expert, value in enumerate(layer_values):
            if value == 0:
                axes.plot(expert, row, marker="x", color="black", markersize=6)


def _moe_load_title(log: RunLog) -> str:
    steps = [record["step"] for record in log.records if any(_EXPERT_UTILIZATION.match(k) for k in record)]
    return f"Expert load, step {steps[-1]} (interval ending there)" if steps else "Expert load"


# ------------------------------------------------------------------ per dataset (group_names)

def _groups(log: RunLog, statistic: str) -> List[str]:
    """The datasets of the ``<statistic>/<name>`` keys (a position bucket's ``loss/pos_0-511`` has its own panel)."""
    names = [key[len(statistic) + 1:] for key in log.keys if key.startswith(statistic + "/")]
    return [name for name in names if name and "/" not in name and keys.parse_position_bucket_key(name) is None]


def _draw_datasets(axes: Any, log: RunLog) -> None:
    """Each dataset's loss (solid, left) and token accuracy (dashed, right), one colour per dataset."""
    groups = sorted(set(_groups(log, "loss")) | set(_groups(log, "accuracy")))
    handles = [_line(axes, log, f"loss/{group}", f"loss: {group}", color=f"C{index}", linewidth=1.8)
               for index, group in enumerate(groups)]
    if _groups(log, "accuracy"):
        right = _twin(axes, "token accuracy", "black")
        handles += [_line(right, log, f"accuracy/{group}", f"accuracy: {group}", color=f"C{index}", linestyle="--",
                          linewidth=1.4) for index, group in enumerate(groups)]
        from matplotlib.ticker import PercentFormatter

        right.yaxis.set_major_formatter(PercentFormatter(1.0))
        fraction_axis(right)
    _finish(axes, handles, "loss")


def dataset_panels(log: RunLog) -> List[Panel]:
    """For a log with per-dataset keys (``loss/<name>``, ``accuracy/<name>``): their curves on one panel."""
    keys_present = tuple(f"{stat}/{name}" for stat in (keys.LOSS, "accuracy") for name in _groups(log, stat))
    return [Panel("datasets", "Per dataset", keys_present, _draw_datasets)] if keys_present else []


def moe_panels(log: RunLog) -> List[Panel]:
    """For a log with ``moe/`` keys (none otherwise: a dense run is not told it skipped MoE panels): the
    routing-health line panel, and the expert-load heat map when the log has per-layer load keys."""
    if not any(key.startswith(keys.MOE_PREFIX) for key in log.keys):
        return []
    panels = [Panel("moe_routing", "MoE routing health", (keys.MOE_IMBALANCE_MEAN, keys.MOE_IMBALANCE_MAX,
                                                          keys.MOE_DEAD_EXPERT_FRACTION), _draw_moe_routing)]
    load_keys = tuple(key for key in log.keys if _EXPERT_UTILIZATION.match(key))
    if load_keys:
        panels.append(Panel("moe_load", _moe_load_title, load_keys, _draw_moe_load))
    return panels


# ------------------------------------------------------------------ per-layer norms (record_grad_norms)

def layer_norm_panels(log: RunLog) -> List[Panel]:
    """For a log with per-layer gradient norms (``grad_norm/layer_NN``): their layer × step heat map."""
    layer_keys = tuple(key for _, key in layer_grad_norm_keys(log))
    return [Panel("layer_grad_norms", "Gradient norm per layer", layer_keys, draw_layer_grad_norms)] \
        if layer_keys else []
