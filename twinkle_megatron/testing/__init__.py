"""Testing support: the layout-invariance kit, and megatron-core on CPU for tests, demos and examples.

Nothing in the library imports this package (``tests/test_layering.py`` keeps it so), and this
file imports nothing: take the module you need.

The layout-invariance kit (docs/testing.md): check a metric, a built-in one or your own, on
TP × PP × CP × DP layouts of forked CPU gloo ranks against its single-process value, in one call.

* ``invariance``: ``assert_layout_invariant(metric_factory, batch, feed=...)``, every rank on every
  layout against the single process, with the collectives (and host syncs) of ``accumulate`` and
  ``calculate`` counted; ``Call``, one ``accumulate`` call of a feed; ``LAYOUTS``, the default layouts;
* ``batches``: ``RankView``, the part of a global batch a rank holds (DP rows, CP chunks, TP vocab
  columns, last pipeline stage); ``split_microbatches``;
* ``distributed``: ``run_distributed(fn, layout=Layout(...))``, a function on forked gloo ranks with
  megatron-core's ``parallel_state`` initialised (megatron-core imported only then);
* ``guards``: ``forbid_host_sync()`` and ``count_collectives()``, at the dispatcher.

The CPU support:

* ``cuda_shim``: ``cpu_cuda_shim()``, megatron-core's direct CUDA calls (schedules, p2p,
  ``GPTModel.forward``) redirected to the CPU inside a ``with`` block;
* ``router_without_te``: ``allow_router_without_te()``, megatron-core's MoE router without
  Transformer Engine installed.

On GPUs neither is needed: megatron-core runs as it is.
"""
