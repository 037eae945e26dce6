"""The test kit: everything the tests share, each thing in one module.

* ``distributed``: ``run_distributed``, forked gloo ranks with megatron-core's ``parallel_state`` for a ``Layout``;
* ``batches``: a rank's part of a global batch (``RankView``: DP rows, CP chunks, TP vocab columns), microbatches;
* ``invariance``: ``assert_layout_invariant``, every layout against the single process, and ``assert_matches``;
* ``guards``: the one dispatch-level guard: host syncs forbidden, collectives counted;
  (these four are public in the package, ``twinkle_megatron.testing.<name>``, for users checking their own
  metrics, docs/testing.md; re-exported here under the names the tests use);
* ``references``: argmax, label log-prob and entropy from full logits in float64, and the metrics' keys from them;
* ``metric_cases``: every metric fed the way its callers feed it, from one synthetic batch;
* ``ops_cases``: the input families of the vocab-parallel ops and their check against the reference;
* ``megatron_gpt``: a tiny layout-independent megatron-core ``GPTModel`` and one step through its schedules;
* ``megatron_packed``: packed (THD) rows through that GPTModel, a block-diagonal stand-in for TE's attention;
* ``cuda_shim``: megatron-core's CUDA calls on the CPU (re-exported from ``twinkle_megatron.testing.cuda_shim``,
  which the examples import).
* ``readme``: the key tables of the README and docs/, to check them against the code's key lists.

Tests import the modules (``from kit.batches import RankView``); this file imports nothing, so that a script can
take ``kit.cuda_shim`` alone.
"""
