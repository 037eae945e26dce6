"""The per-layer gradient-norm chart of a run log (keys ``grad_norm/layer_NN``, see ``record_grad_norms``).

A heat map: x is the step, y the global 0-based layer, the colour ‖g‖₂ of that
layer at that step on a log scale (layer norms span orders of magnitude, and a
layer whose norm grows tenfold should stand out whatever its size). A
non-finite norm is drawn black. The layer of each key is read by
:func:`twinkle_megatron.keys.parse_layer_part`, the reader of the names
:func:`twinkle_megatron.keys.layer_part` makes. Drawn on a matplotlib ``Axes``
given by :mod:`.run`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Tuple

from .. import keys

if TYPE_CHECKING:
    from ..logging.runlog import RunLog


def layer_grad_norm_keys(log: RunLog) -> List[Tuple[int, str]]:
    """``(layer, key)`` of every ``grad_norm/layer_NN`` key of the log, by layer."""
    found = []
    for key in log.keys:
        if key.startswith(keys.GRAD_NORM_PREFIX):
            layer = keys.parse_layer_part(key[len(keys.GRAD_NORM_PREFIX):])
            if layer is not None:
                found.append((layer, key))
    return sorted(found)


def layer_grad_norm_grid(log: RunLog) -> Tuple[List[int], List[int], List[List[float]]]:
    """``(steps, layers, grid)``: ``grid[i][j]`` is layer ``layers[i]``'s gradient norm at ``steps[j]`` (NaN where
    the record lacks it), over the records holding any layer norm; empty lists when none does."""
    columns = layer_grad_norm_keys(log)
    records = [record for record in log.records if any(key in record for _, key in columns)]
    steps = [record["step"] for record in records]
    grid = [[record.get(key, math.nan) for record in records] for _, key in columns]
    return steps, [layer for layer, _ in columns], grid


def _edges(centres: List[float]) -> List[float]:
    """Cell edges around sorted centres (midpoints between neighbours; a single centre gets a width of 1)."""
    if len(centres) == 1:
        return [centres[0] - 0.5, centres[0] + 0.5]
    middles = [(a + b) / 2 for a, b in zip(centres, centres[1:])]
    return [centres[0] - (middles[0] - centres[0]), *middles, centres[-1] + (centres[-1] - middles[-1])]


def draw_layer_grad_norms(axes: Any, log: RunLog) -> None:
    """Layer × step heat map of the gradient norms, log colour scale, non-finite cells black."""
    import numpy
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    steps, layers, grid = layer_grad_norm_grid(log)
    values = numpy.array(grid, dtype=float)
    positive = values[numpy.isfinite(values) & (values > 0)]
    low, high = (positive.min(), positive.max()) if positive.size else (1.0, 10.0)
    if high <= low:  # one value: a decade around it, so the colour bar has a scale
        low, high = low / 3, high * 3
    # A zero norm (a frozen layer) takes the lowest colour; only a non-finite one is masked (black).
    cells = numpy.ma.masked_invalid(numpy.where(numpy.isfinite(values), numpy.maximum(values, low), numpy.nan))
    colours = colormaps["viridis"].with_extremes(bad="black")
    mesh = axes.pcolormesh(_edges([float(step) for step in steps]), _edges([float(layer) for layer in layers]),
                           cells, cmap=colours, norm=LogNorm(vmin=low, vmax=high), shading="flat")
    axes.figure.colorbar(mesh, ax=axes, label="‖g‖₂ of the layer (log scale; black: non-finite)")
    axes.set_xlabel("step")
    axes.set_ylabel("layer (global, 0-based)")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(len(layers), 12)))
