"""Layout: the sizes of a Megatron parallel layout (TP × PP × CP × DP, virtual stages), validated.

What a launcher, a test or a training script asks for; where a running rank
sits in it is :class:`~.context.ParallelContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Layout:
    """Tensor-, pipeline-, context- and data-parallel sizes, and virtual pipeline stages per rank.

    ``ValueError`` at construction for a size below 1, or virtual stages without
    a pipeline (``vpp`` needs ``pp >= 2``).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    vpp: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.upper()} must be an int of at least 1, got {value!r}")
        if self.vpp is not None and (isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp < 1
                                     or self.pp < 2):
            raise ValueError(f"virtual pipeline stages (VPP={self.vpp}) need PP >= 2 and VPP >= 1, got PP={self.pp}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                  vpp: Optional[int] = None) -> Layout:
        """The layout whose data parallelism takes the ranks TP × PP × CP leaves: DP = world / (TP·PP·CP)."""
        model_parallel = cls(tp=tp, pp=pp, cp=cp, vpp=vpp).model_parallel
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by TP×PP×CP = {tp}×{pp}×{cp} = "
                             f"{model_parallel}")
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // model_parallel, vpp=vpp)

    @property
    def model_parallel(self) -> int:
        """Ranks of one model replica: TP × PP × CP."""
        return self.tp * self.pp * self.cp

    @property
    def world_size(self) -> int:
        return self.model_parallel * self.dp

    def __str__(self) -> str:
        vpp = f"_vpp{self.vpp}" if self.vpp else ""
        return f"tp{self.tp}_pp{self.pp}_cp{self.cp}_dp{self.dp}{vpp}"
