"""The test kit: what the tests share beyond the package's public kit, each thing in one module.

The multi-rank harness is public in the package, and the tests import it from there, as a user checking their own
metrics does (docs/testing.md): ``twinkle_megatron.testing.distributed`` (``run_distributed``, forked gloo ranks
with megatron-core's ``parallel_state`` for a ``Layout``), ``.batches`` (``RankView``: a rank's part of a global
batch), ``.invariance`` (``assert_layout_invariant``), ``.guards`` (host syncs forbidden, collectives counted) and
``.cuda_shim`` (megatron-core's CUDA calls on the CPU). This package holds the rest:

* ``references``: argmax, label log-prob and entropy from full logits in float64, and the metrics' keys from them;
* ``metric_cases``: every metric fed the way its callers feed it, from one synthetic batch;
* ``collection_cases``: all the metrics in one collection on one global batch, fed per rank;
* ``grpo_cases``: GRPO, GSPO and CISPO on one global batch: its float64 reference and each rank's feed;
* ``op_counts``: the device ops a call dispatches, counted (views excluded), for the per-microbatch budgets;
* ``ops_cases``: the input families of the vocab-parallel ops and their check against the reference;
* ``megatron_gpt``: a tiny layout-independent megatron-core ``GPTModel`` and one step through its schedules;
* ``megatron_training``: that GPTModel under Megatron's DDP and optimizer, one real training step;
* ``megatron_lm``: Megatron-LM's ``train()`` loop (``train_step``, ``training_log``, ``evaluate``, the
  ``megatron.training`` writers) mirrored line for line at ``core_v0.16.1`` over that training step;
* ``megatron_moe``: the same with MoE layers; ``moe_cases``: hand-made routing maps;
* ``megatron_packed``: packed (THD) rows through that GPTModel, a block-diagonal stand-in for TE's attention;
* ``megatron_bridge``: Megatron-Bridge's own training code, downloaded and imported behind the smallest stubs;
  ``bridge_config``: its run configuration (Megatron's own logger, training and validation dataclasses with
  Bridge's added fields); ``bridge_loop``: its ``train()`` iteration around its own ``train_step``,
  ``training_log`` and evaluation;
* ``logger_readers``: what TensorBoard, MLflow and W&B hold, read back by each tool's own reader;
* ``owners``: which metric or tracker part returned each key;
* ``fork_server``: ``python ...`` runs (docs blocks, the demo, the Slurm recipe's dry runs) forked from one
  process that imported torch and megatron-core once;
* ``readme``: the key tables of the README and docs/, to check them against the code's key lists.

Tests import the modules (``from kit.references import full_vocab_stats``); this file imports nothing.
"""
