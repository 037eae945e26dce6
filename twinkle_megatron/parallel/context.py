"""Where this rank sits in the parallel layout, and which group reduces metric states.

A :class:`ParallelContext` names the tensor- (TP), pipeline- (PP), context- (CP)
and data-parallel (DP) groups of this rank, its rank and size in each, whether it
is on the last pipeline stage, and the *reduction group*: every rank that calls
``calculate()`` together. Metric states are reduced over the reduction group in
one pass; ranks that hold no data, or only a duplicate of another rank's data,
contribute identity values (see :meth:`ParallelContext.counts_here`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means "the default (world) group"

_MESH_CONTEXTS: dict = {}  # id(mesh) -> (mesh, its context)


@dataclass(frozen=True)
class ParallelContext:
    """TP/PP/CP/DP coordinates of this rank and the group that reduces metric states.

    ``reduce_group`` is ``None`` for the default (world) group. ``distributed`` is
    False for a single process, in which case no collective is ever issued.
    """

    tp_group: ProcessGroup = None
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    is_last_stage: bool = True
    cp_group: ProcessGroup = None
    cp_size: int = 1
    cp_rank: int = 0
    dp_group: ProcessGroup = None
    dp_size: int = 1
    dp_rank: int = 0
    reduce_group: ProcessGroup = None
    distributed: bool = False

    def __deepcopy__(self, memo: dict) -> ParallelContext:
        """The same context: a copy of a metric (``instrument()``'s validation copy) sits on the same ranks and
        reduces over the same process groups, which cannot be copied (nor should be: groups are made together,
        once, by every rank)."""
        return self

    # ------------------------------------------------------------------ queries

    def counts_here(self, cp_gathered: bool = False) -> bool:
        """Whether this rank's metric states count in the global reduction.

        Only the last pipeline stage sees outputs; TP ranks hold identical
        (duplicated) statistics, so only TP rank 0 counts; CP ranks hold
        different chunks of each sequence and all count, unless the data is
        already complete on every CP rank (``cp_gathered``), then only CP rank 0.
        """
        if not self.is_last_stage or self.tp_rank != 0:
            return False
        return not cp_gathered or self.cp_rank == 0

    @property
    def reduce_size(self) -> int:
        if not self.distributed:
            return 1
        return dist.get_world_size(self.reduce_group)

    def without_tp(self) -> ParallelContext:
        """This layout with every tensor-parallel rank holding the whole of the data (e.g. the whole
        vocabulary after an output layer gathered its output): no TP group, TP size 1."""
        return replace(self, tp_group=None, tp_size=1)

    def communication_device(self) -> torch.device:
        """The device collectives on ``reduce_group`` need (CUDA for NCCL, else CPU)."""
        if self.distributed and dist.get_backend(self.reduce_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------ constructors

    @classmethod
    def single(cls) -> ParallelContext:
        """One process, nothing sharded; never communicates."""
        return cls()

    @classmethod
    def from_megatron(cls) -> ParallelContext:
        """From megatron-core's initialised ``parallel_state`` (reduction over the world)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron-core parallel_state is not initialised")
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            # The last virtual stage always lives on the last pipeline rank.
            is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
            cp_group=ps.get_context_parallel_group(),
            cp_size=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            dp_group=ps.get_data_parallel_group(),
            dp_size=ps.get_data_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            reduce_group=None,
            distributed=True,
        )

    @classmethod
    def from_groups(cls, tp_group: ProcessGroup = None, cp_group: ProcessGroup = None,
                    dp_group: ProcessGroup = None, pp_group: ProcessGroup = None,
                    reduce_group: ProcessGroup = None) -> ParallelContext:
        """From explicit process groups; a missing group means that dimension is not sharded.

        ``reduce_group`` defaults to the world. With no groups at all and
        ``torch.distributed`` initialised, the whole world is data-parallel.
        """
        if not _dist_ready():
            return cls.single()
        pp_size, pp_rank = _size_rank(pp_group)
        tp_size, tp_rank = _size_rank(tp_group)
        cp_size, cp_rank = _size_rank(cp_group)
        dp_size, dp_rank = _size_rank(dp_group)
        if all(g is None for g in (tp_group, cp_group, dp_group, pp_group)):
            # The reduction group is data-parallel. It stays None when it is the world, not the world's group
            # object: a context holding that object keeps it alive past destroy_process_group(), and gloo's
            # worker thread can then still be releasing the last collective while the interpreter exits
            # (std::terminate, SIGABRT, about 1 run in 15 of a two-rank torchrun on CPU).
            dp_group = reduce_group
            dp_size, dp_rank = dist.get_world_size(reduce_group), dist.get_rank(reduce_group)
        return cls(tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank,
                   pp_size=pp_size, pp_rank=pp_rank, is_last_stage=pp_rank == pp_size - 1,
                   cp_group=cp_group, cp_size=cp_size, cp_rank=cp_rank,
                   dp_group=dp_group, dp_size=dp_size, dp_rank=dp_rank,
                   reduce_group=reduce_group, distributed=True)

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> ParallelContext:
        """From a Twinkle ``DeviceMesh`` (duck-typed) or a torch ``DeviceMesh`` with named dims.

        Twinkle meshes name dims ``dp``/``fsdp`` (both data-parallel), ``tp``,
        ``pp``, ``cp``; torch meshes are read by the same names.
        """
        if isinstance(mesh, ParallelContext):
            return mesh
        if not _dist_ready():
            return cls.single()
        # One context per mesh: every metric on it must reduce over the same group object, and
        # reading a mesh may create process groups (collective over the world) only once.
        cached = _MESH_CONTEXTS.get(id(mesh))
        if cached is not None and cached[0] is mesh:
            return cached[1]
        if hasattr(mesh, "tp_world_size"):
            context = cls._from_twinkle_mesh(mesh)
        elif hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "get_group"):
            context = cls._from_torch_mesh(mesh)
        else:
            raise TypeError(f"cannot read a parallel layout from {type(mesh).__name__}: expected a Twinkle "
                            "DeviceMesh, a torch DeviceMesh with named dims, or a ParallelContext")
        _MESH_CONTEXTS[id(mesh)] = (mesh, context)
        return context

    @classmethod
    def _from_twinkle_mesh(cls, mesh: Any) -> ParallelContext:
        def group(dims: Sequence[str], size: int) -> ProcessGroup:
            return mesh.get_dim_group(tuple(dims) if len(dims) > 1 else dims[0]) if size > 1 else None

        tp_size = int(mesh.tp_world_size or 1)
        pp_size = int(mesh.pp_world_size or 1)
        cp_size = int(getattr(mesh, "cp_world_size", 1) or 1)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        # Data parallelism is every dp and fsdp dim together (Twinkle shards data over both).
        dp_dims = [d for d in ("dp", "fsdp") if d in names and int(mesh.mesh.shape[names.index(d)]) > 1]
        if dp_dims:
            dp_size = 1
            for d in dp_dims:
                dp_size *= int(mesh.mesh.shape[names.index(d)])
        else:
            dp_dims, dp_size = ["dp"], int(mesh.dp_world_size or 1)
        tp_group, cp_group, dp_group = group(["tp"], tp_size), group(["cp"], cp_size), group(dp_dims, dp_size)
        dp_rank = _rank_of(mesh, "dp_rank", dp_group) if dp_dims == ["dp"] else dist.get_rank(dp_group)
        return cls(tp_group=tp_group, tp_size=tp_size, tp_rank=_rank_of(mesh, "tp_rank", tp_group),
                   pp_size=pp_size, pp_rank=int(getattr(mesh, "pp_rank", 0) or 0),
                   is_last_stage=bool(mesh.is_pp_last_rank()) if pp_size > 1 else True,
                   cp_group=cp_group, cp_size=cp_size, cp_rank=_rank_of(mesh, "cp_rank", cp_group),
                   dp_group=dp_group, dp_size=dp_size, dp_rank=dp_rank,
                   reduce_group=_group_over(_mesh_ranks(mesh)), distributed=True)

    @classmethod
    def _from_torch_mesh(cls, mesh: Any) -> ParallelContext:
        names = tuple(mesh.mesh_dim_names or ())

        def dim(name: str) -> tuple[ProcessGroup, int, int]:
            if name not in names or mesh.size(names.index(name)) == 1:
                return None, 1, 0
            group = mesh.get_group(name)
            return group, dist.get_world_size(group), dist.get_rank(group)

        tp_group, tp_size, tp_rank = dim("tp")
        pp_group, pp_size, pp_rank = dim("pp")
        cp_group, cp_size, cp_rank = dim("cp")
        dp_names = [n for n in ("dp", "fsdp", "dp_shard", "dp_replicate") if n in names]
        if len(dp_names) > 1:
            dp_group = _group_over_dims(mesh.mesh, [names.index(n) for n in dp_names])
            dp_size, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        else:
            dp_group, dp_size, dp_rank = dim(dp_names[0]) if dp_names else (None, 1, 0)
        return cls(tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank,
                   pp_size=pp_size, pp_rank=pp_rank, is_last_stage=pp_rank == pp_size - 1,
                   cp_group=cp_group, cp_size=cp_size, cp_rank=cp_rank,
                   dp_group=dp_group, dp_size=dp_size, dp_rank=dp_rank,
                   reduce_group=_group_over(mesh.mesh.flatten().tolist()), distributed=True)

    @classmethod
    def resolve(cls, device_mesh: Any = None, process_group: ProcessGroup = None) -> ParallelContext:
        """The context a metric uses, from its ``(device_mesh, process_group)`` arguments.

        First that applies: a ``ParallelContext`` or a device mesh given as
        ``device_mesh``; megatron-core's initialised ``parallel_state``; a
        ``process_group`` alone (that group is data-parallel, nothing else is
        sharded); an initialised ``torch.distributed`` (the world is
        data-parallel); otherwise a single process.
        """
        if device_mesh is not None:
            return cls.from_device_mesh(device_mesh)
        if _megatron_initialized():
            return cls.from_megatron()
        if process_group is not None:
            return cls.from_groups(dp_group=process_group, reduce_group=process_group)
        if _dist_ready():
            return cls.from_groups()
        return cls.single()


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _megatron_initialized() -> bool:
    # Whoever initialised parallel_state has imported it: no need to pay megatron's import here.
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and _dist_ready() and ps.model_parallel_is_initialized()


def _size_rank(group: ProcessGroup) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _rank_of(mesh: Any, attribute: str, group: ProcessGroup) -> int:
    value = getattr(mesh, attribute, None)
    if value is not None:
        return int(value)
    return dist.get_rank(group) if group is not None else 0


def _mesh_ranks(mesh: Any) -> list[int]:
    ranks = getattr(mesh, "mesh", None)
    if ranks is None:
        return list(range(dist.get_world_size()))
    return [int(r) for r in (ranks.flatten().tolist() if hasattr(ranks, "flatten") else ranks)]


def _group_over_dims(ranks: torch.Tensor, dims: Sequence[int]) -> ProcessGroup:
    """This rank's group of the ranks that differ only along ``dims`` of the rank grid ``ranks``.

    Every group of the grid is created, in the same order on every rank
    (``new_subgroups_by_enumeration`` is collective over the world).
    """
    others = [d for d in range(ranks.dim()) if d not in dims]
    grouped = ranks.permute(*others, *dims).reshape(-1, math.prod(ranks.shape[d] for d in dims))
    group, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in grouped])
    return group


def _group_over(ranks: Sequence[int]) -> Optional[ProcessGroup]:
    """The default group when ``ranks`` is the whole world, else a new group over them.

    ``dist.new_group`` is collective over the world: every rank must build its
    context at the same point, as it does when every rank constructs its metrics.
    """
    ranks = sorted(int(r) for r in ranks)
    if ranks == list(range(dist.get_world_size())):
        return None
    return dist.new_group(ranks=ranks)
