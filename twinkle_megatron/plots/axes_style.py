"""What every chart of :mod:`twinkle_megatron.plots` shares: a legend that covers no data, and axes for fractions
that do not magnify noise."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

# The narrowest span of a fraction's axis (accuracy, shares in [0, 1]): a run whose accuracy moves between 1.3 %
# and 1.9 % is drawn as a flat line near the bottom, not as swings across the whole panel.
FRACTION_MIN_SPAN = 0.1
# Below the axes: the x tick labels and the x label, in points (tick 3.5 + pad 3.5 + label 10 + pad 4 + label 10,
# matplotlib's defaults), and a gap.
BELOW_X_LABEL_POINTS = 36


def legend_below(axes: Any, handles: Sequence[Any], below_points: float = BELOW_X_LABEL_POINTS) -> Optional[Any]:
    """One legend for ``handles`` ``below_points`` under the axes (under their x label), in up to three columns;
    None without handles.

    Outside the axes, so it never covers a curve: ``loc="best"`` sees only the
    curves of its own axes (not those of a second y axis) and finds no free
    corner in a dense panel. The constrained layout of :func:`plot_run` makes
    room for it.
    """
    from matplotlib.transforms import offset_copy

    if not handles:
        return None
    anchor = offset_copy(axes.transAxes, fig=axes.figure, y=-below_points, units="points")
    return axes.legend(handles, [handle.get_label() for handle in handles], loc="upper center",
                       bbox_to_anchor=(0.5, 0.0), bbox_transform=anchor, borderaxespad=0.0,
                       ncol=min(3, len(handles)), fontsize="small", framealpha=0.9)


def fraction_axis(axes: Any, min_span: float = FRACTION_MIN_SPAN) -> None:
    """Y limits for fractions in [0, 1] (accuracy, shares) spanning at least ``min_span``, inside [0, 1].

    matplotlib fits the axis to the data, so a curve that moves by 0.5 % fills
    the panel and noise reads as big swings. Data spanning less than
    ``min_span`` is centred in a ``min_span`` window, shifted to stay inside
    [0, 1]; wider data keeps matplotlib's limits.
    """
    low, high = axes.dataLim.intervaly
    if not (math.isfinite(low) and math.isfinite(high)) or high - low >= min_span:
        return
    bottom = min(max((low + high) / 2 - min_span / 2, 0.0), 1.0 - min_span)
    axes.set_ylim(bottom, bottom + min_span)

