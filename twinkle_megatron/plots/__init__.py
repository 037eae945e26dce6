"""PNG charts of a run log (``twinkle-megatron plot``): the panels and ``overview.png`` (:mod:`.run`), the
loss-by-position chart (:mod:`.positions`) and the incident marks (:mod:`.incidents`)."""

from .incidents import mark_incidents
from .run import MissingMatplotlib, Panel, dataset_panels, expert_load_grid, key_panel, moe_panels, plot_run

__all__ = ["MissingMatplotlib", "Panel", "plot_run", "key_panel", "dataset_panels", "moe_panels", "expert_load_grid",
           "mark_incidents"]
