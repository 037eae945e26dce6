"""PNG charts of a run log (``twinkle-megatron plot``): the panels and ``overview.png`` (:mod:`.run`), the
loss-by-position chart (:mod:`.positions`), the per-layer gradient-norm chart (:mod:`.layer_norms`), the incident
marks (:mod:`.incidents`), and what every chart shares (:mod:`.axes_style`: legends below the axes, fraction axes).
"""

from .axes_style import fraction_axis, legend_below
from .incidents import mark_incidents
from .layer_norms import layer_grad_norm_grid
from .run import (
    MissingMatplotlib,
    Panel,
    dataset_panels,
    expert_load_grid,
    key_panel,
    layer_norm_panels,
    moe_panels,
    overview_figure,
    panel_figure,
    plot_run,
    run_panels,
)

__all__ = ["MissingMatplotlib", "Panel", "plot_run", "run_panels", "overview_figure", "panel_figure", "key_panel",
           "dataset_panels", "layer_norm_panels", "moe_panels", "expert_load_grid", "layer_grad_norm_grid",
           "mark_incidents", "legend_below", "fraction_axis"]
