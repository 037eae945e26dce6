"""Support for running megatron-core on CPU in tests, the CPU demo and the documentation's examples.

Nothing in the library imports this package (``tests/test_layering.py`` keeps it so), and this
file imports nothing: take the module you need.

* ``cuda_shim``: ``cpu_cuda_shim()``, megatron-core's direct CUDA calls (schedules, p2p,
  ``GPTModel.forward``) redirected to the CPU inside a ``with`` block;
* ``router_without_te``: ``allow_router_without_te()``, megatron-core's MoE router without
  Transformer Engine installed.

On GPUs neither is needed: megatron-core runs as it is.
"""
