"""lowrank_jax.spectral: linear algebra — truncated and randomised SVD, power iteration, tight fusion
frames.

The FP8 scales, delayed scaling and FP8 emulation are in :mod:`lowrank_jax.fp8`.
"""

from lowrank_jax.spectral.frames import (
    frame_analysis,
    frame_basis,
    frame_nnz,
    frame_synthesis,
    tight_fusion_frame,
)
from lowrank_jax.spectral.power_iteration import (
    PowerIterationState,
    attention_group_power_iteration,
    attention_power_iteration,
    init_attention_power_iteration,
)
from lowrank_jax.spectral.svd import (
    balanced_factors,
    lowrank_approximation,
    randomized_svd,
    truncated_svd,
)

__all__ = [
    "PowerIterationState",
    "attention_group_power_iteration",
    "attention_power_iteration",
    "balanced_factors",
    "frame_analysis",
    "frame_basis",
    "frame_nnz",
    "frame_synthesis",
    "init_attention_power_iteration",
    "lowrank_approximation",
    "randomized_svd",
    "tight_fusion_frame",
    "truncated_svd",
]
