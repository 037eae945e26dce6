"""ParallelContext: resolved from megatron, device meshes, explicit groups, or nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist

from twinkle_megatron import Accuracy, LossMetric, MetricCollection, ParallelContext
from twinkle_megatron.testing.distributed import Layout, run_distributed


def _from_megatron() -> tuple:
    from megatron.core import parallel_state as ps

    context = ParallelContext.resolve()
    assert context == ParallelContext.from_megatron()
    assert (context.tp_size, context.pp_size, context.cp_size, context.dp_size) == (
        ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())
    return (context.tp_rank, context.pp_rank, context.cp_rank, context.dp_rank, context.is_last_stage,
            context.counts_here(), context.counts_here(cp_gathered=True), context.reduce_size)


def test_from_megatron_tp_pp_cp():
    results = run_distributed(_from_megatron, layout=Layout(tp=2, pp=2, cp=2))
    # megatron's default order is tp-cp-ep-dp-pp: rank = tp + 2·cp + 4·pp.
    for rank, (tp, pp, cp, dp, last, holds, holds_gathered, reduce_size) in enumerate(results):
        assert (tp, cp, pp, dp) == (rank % 2, rank // 2 % 2, rank // 4, 0)
        assert last == (pp == 1) and reduce_size == 8
        assert holds == (last and tp == 0)
        assert holds_gathered == (last and tp == 0 and cp == 0)


def test_from_megatron_with_virtual_stages():
    results = run_distributed(_from_megatron, layout=Layout(pp=2, dp=2, vpp=2))
    assert [r[4] for r in results] == [False, False, True, True]


def _from_torch_mesh() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    context = ParallelContext.resolve(device_mesh=mesh)
    # Each TP pair passes the same per-token loss; DP ranks pass different ones.
    metric = LossMetric(device_mesh=mesh, loss_reduction="sum")
    metric.accumulate({}, {"loss": torch.tensor(10.0 * (context.dp_rank + 1)), "num_tokens": 5})
    return {"tp": (context.tp_size, context.tp_rank), "dp": (context.dp_size, context.dp_rank),
            "result": metric.calculate()}


def test_from_torch_device_mesh_counts_tp_duplicates_once():
    results = run_distributed(_from_torch_mesh, 4)
    assert [r["tp"] for r in results] == [(2, 0), (2, 1), (2, 0), (2, 1)]
    assert [r["dp"] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert all(r["result"] == {"loss": 30.0 / 10} for r in results)


def _torch_mesh_with_two_data_parallel_dims() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    context = ParallelContext.resolve(device_mesh=mesh)
    members = [None] * context.dp_size
    dist.all_gather_object(members, dist.get_rank(), group=context.dp_group)
    metric = LossMetric(device_mesh=mesh, loss_reduction="sum")
    metric.accumulate({}, {"loss": torch.tensor(float(context.dp_rank + 1)), "num_tokens": 1})
    return {"dp": (context.dp_size, context.dp_rank), "members": members, "result": metric.calculate()}


def test_torch_mesh_data_parallel_dims_together_form_the_data_parallel_group():
    results = run_distributed(_torch_mesh_with_two_data_parallel_dims, 8)
    # ranks (replicate, shard, tp): the DP group of a rank is every rank with its tp coordinate.
    assert [r["members"] for r in results] == [[0, 2, 4, 6], [1, 3, 5, 7]] * 4
    assert [r["dp"] for r in results] == [(4, 0), (4, 0), (4, 1), (4, 1), (4, 2), (4, 2), (4, 3), (4, 3)]
    assert all(r["result"] == {"loss": (1 + 2 + 3 + 4) / 4} for r in results), "TP duplicates counted once"


class TwinkleStyleMesh:
    """What Twinkle's DeviceMesh exposes (duck-typed; Twinkle is not a dependency): dp × fsdp × pp × tp.

    ``get_dim_group`` follows twinkle-kit 0.5.1's ``DeviceMesh.get_dim_group``: one dim (a name, or a tuple
    of one name) gives the group of the ranks that differ only along it, made once and cached; a tuple of
    several dims gives the group of the ranks that differ only along those (``create_process_group``),
    made anew at every call. Twinkle has each rank make only its own group there, which hangs on gloo
    (REFERENCE.md); here every rank makes every group of the request, in the same order. ``requested``
    lists the dims asked for, in order.
    """

    def __init__(self, dp: int, pp: int, tp: int, fsdp: int = 1):
        import numpy as np

        self.mesh = np.arange(dp * fsdp * pp * tp).reshape(dp, fsdp, pp, tp)
        self.mesh_dim_names = ("dp", "fsdp", "pp", "tp")
        self.dp_world_size, self.pp_world_size, self.tp_world_size, self.cp_world_size = dp, pp, tp, 1
        coords = np.argwhere(self.mesh == dist.get_rank())[0]
        self.dp_rank, _, self.pp_rank, self.tp_rank = (int(c) for c in coords)
        self._groups = {}
        self.requested: list[tuple] = []

    def is_pp_last_rank(self) -> bool:
        return self.pp_rank == self.pp_world_size - 1

    def get_dim_group(self, dims):
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        self.requested.append(dims)
        if len(dims) > 1:
            return self._new_groups(dims)
        if dims[0] not in self._groups:
            self._groups[dims[0]] = self._new_groups(dims)
        return self._groups[dims[0]]

    def _new_groups(self, dims: tuple):
        """Every group of ranks that differ only along ``dims`` (collectively, over the world); this rank's."""
        import numpy as np

        if not set(dims) <= set(self.mesh_dim_names):
            raise ValueError(f"Dimension {dims} not found in mesh_dim_names")
        axes = [self.mesh_dim_names.index(d) for d in dims]
        kept = [axis for axis in range(self.mesh.ndim) if axis not in axes]
        size = int(np.prod([self.mesh.shape[axis] for axis in axes]))
        mine = None
        for ranks in np.transpose(self.mesh, kept + axes).reshape(-1, size):
            group = dist.new_group(sorted(int(r) for r in ranks))
            if dist.get_rank() in ranks:
                mine = group
        return mine


def _from_twinkle_mesh() -> tuple:
    mesh = TwinkleStyleMesh(dp=2, pp=2, tp=2)
    metric = LossMetric(device_mesh=mesh, loss_reduction="sum")
    # Only the last stage accumulates (the first use of the layout there must not create groups).
    if mesh.is_pp_last_rank():
        metric.accumulate({}, {"loss": torch.tensor(4.0 * (mesh.dp_rank + 1)), "num_tokens": 2})
    dist.barrier()  # stands for the pipeline schedule's p2p: no rank may be stuck creating a group
    context = metric.context
    return (context.tp_rank, context.dp_rank, context.is_last_stage, metric.calculate(),
            metric.gather_results([context.dp_rank]))


def _fsdp_mesh_and_shared_groups() -> tuple:
    mesh = TwinkleStyleMesh(dp=1, fsdp=2, pp=1, tp=2)
    collection = MetricCollection([LossMetric(device_mesh=mesh), Accuracy(device_mesh=mesh)])
    collection.accumulate({"labels": torch.zeros(1, 2, dtype=torch.long)},
                          {"loss": float(dist.get_rank() // 2), "logits": torch.zeros(1, 2, 3)})
    context = collection.metrics[0].context
    return context.dp_size, context.dp_rank, collection.metrics[0].gather_results([context.dp_rank]), \
        collection.calculate()


def test_twinkle_fsdp_dims_are_data_parallel_and_metrics_on_one_mesh_share_groups():
    results = run_distributed(_fsdp_mesh_and_shared_groups, 4, timeout=30)
    assert [r[:2] for r in results] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert all(r[2] == [0, 1] for r in results)
    assert all(r[3]["loss"] == 0.5 and r[3]["total_tokens"] == 4 for r in results)


def _dp_and_fsdp_mesh() -> dict:
    mesh = TwinkleStyleMesh(dp=2, fsdp=2, pp=1, tp=2)
    collection = MetricCollection([LossMetric(device_mesh=mesh), Accuracy(device_mesh=mesh)])
    context = collection.metrics[0].context
    members = [None] * context.dp_size
    dist.all_gather_object(members, dist.get_rank(), group=context.dp_group)
    # Each DP×FSDP rank its own loss; the TP pair the same one (counted once).
    collection.accumulate({"labels": torch.zeros(1, 2, dtype=torch.long)},
                          {"loss": float(context.dp_rank), "logits": torch.zeros(1, 2, 3)})
    return {"dp": (context.dp_size, context.dp_rank), "tp": (context.tp_size, context.tp_rank),
            "members": members, "gathered": collection.metrics[1].gather_results([context.dp_rank]),
            "result": collection.calculate(), "requested": mesh.requested}


def test_twinkle_dp_and_fsdp_dims_together_form_the_data_parallel_group():
    results = run_distributed(_dp_and_fsdp_mesh, 8, timeout=30)
    # ranks (dp, fsdp, tp): the DP group of a rank is every rank with its tp coordinate, ordered dp-major.
    assert [r["dp"] for r in results] == [(4, rank // 2) for rank in range(8)]
    assert [r["tp"] for r in results] == [(2, rank % 2) for rank in range(8)]
    assert [r["members"] for r in results] == [[0, 2, 4, 6], [1, 3, 5, 7]] * 4
    assert all(r["gathered"] == [0, 1, 2, 3] for r in results)
    assert all(r["result"]["loss"] == 1.5 and r["result"]["total_tokens"] == 8 for r in results)
    # The DP×FSDP group is asked for once per mesh, as a tuple (Twinkle makes a new group at every such call).
    assert all(r["requested"].count(("dp", "fsdp")) == 1 for r in results), results[0]["requested"]


def _metric_built_before_megatron() -> tuple:
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ps.destroy_model_parallel()
    metric = LossMetric()  # torch.distributed is up, megatron's parallel_state not yet
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if ps.is_pipeline_last_stage():
        metric.accumulate({}, {"loss": 1.0 + ps.get_data_parallel_rank()})
    return metric.context.tp_size, metric.calculate()


def test_a_metric_built_before_megatron_is_initialised_uses_its_layout():
    results = run_distributed(_metric_built_before_megatron, layout=Layout(tp=2, pp=2))
    assert all(r == (2, {"loss": 1.0}) for r in results)


def test_from_twinkle_style_mesh():
    results = run_distributed(_from_twinkle_mesh, 8, timeout=30)
    for rank, (tp, dp, last, result, gathered) in enumerate(results):
        assert (tp, dp, last) == (rank % 2, rank // 4, rank // 2 % 2 == 1)
        assert result == {"loss": 12.0 / 4}
        assert gathered == [0, 1]


def _from_process_group_and_world() -> tuple:
    group = dist.new_group([0, 1])
    other = dist.new_group([2, 3])
    mine = group if dist.get_rank() < 2 else other
    metric = LossMetric(process_group=mine)
    metric.accumulate({}, {"loss": float(dist.get_rank())})
    world = LossMetric()
    world.accumulate({}, {"loss": float(dist.get_rank())})
    return metric.calculate(), world.calculate(), world.context.dp_size


def test_process_group_alone_is_data_parallel_and_world_is_the_default():
    results = run_distributed(_from_process_group_and_world, 4)
    assert [r[0]["loss"] for r in results] == [0.5, 0.5, 2.5, 2.5]
    assert all(r[1] == {"loss": 1.5} and r[2] == 4 for r in results)


def test_single_process():
    context = ParallelContext.resolve()
    assert context == ParallelContext.single() and not context.distributed and context.counts_here()
    assert ParallelContext.resolve(device_mesh=context) is context


WORLD_FREED_ON_DESTROY = """
import gc, weakref
import torch, torch.distributed as dist
from twinkle_megatron import Accuracy, MetricCollection, TokenStatsMetric

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
world = weakref.ref(dist.group.WORLD)
metrics = MetricCollection([Accuracy(vocab_size=8), TokenStatsMetric(vocab_size=8)])
metrics.accumulate({"labels": torch.tensor([[1, 2]])}, {"logits": torch.randn(1, 2, 8)})
metrics.calculate()
dist.destroy_process_group()
gc.collect()
assert world() is None, "a metric keeps the world's process group alive after destroy_process_group()"
"""


def test_metrics_do_not_keep_the_world_group_alive_after_destroy_process_group():
    """With the world's group object held past ``destroy_process_group()``, gloo's worker thread can still be
    releasing the last collective when the interpreter exits: std::terminate, SIGABRT (about one two-rank run in
    15 of the docs' example, seen in CI). A context over the world therefore names it ``None``, as torch does."""
    done = subprocess.run([sys.executable, "-c", WORLD_FREED_ON_DESTROY], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
