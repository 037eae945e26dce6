"""megatron-core's MoE router on an install without Transformer Engine (tests and CPU demos only).

``RouterGatingLinearFunction.forward`` (megatron-core 0.16.1) tests ``te_general_gemm is
not None``, but ``moe_utils`` defines that name only when Transformer Engine imports:
without TE every router call raises ``NameError``. Defining it as ``None`` (what the check
means) selects megatron-core's own ``torch.mm`` / ``torch.addmm`` path; what the router
computes does not change. Releases that define the name themselves are left alone.
"""

from __future__ import annotations

__all__ = ["allow_router_without_te"]


def allow_router_without_te() -> None:
    """Define ``moe_utils.te_general_gemm = None`` when megatron-core left it undefined (no TE)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
