"""lowrank_jax.spectral: linear algebra — power iteration, randomised SVD, tight fusion frames.

The FP8 scales, delayed scaling and FP8 emulation moved to :mod:`lowrank_jax.fp8`; their old
names here still resolve (with a ``DeprecationWarning``).
"""

import warnings as _warnings

from lowrank_jax.spectral.frames import (
    BASES,
    frame_analysis,
    frame_basis,
    frame_nnz,
    frame_synthesis,
    real_tight_fusion_frame,
    realify,
    spectral_tetris,
    tight_fusion_frame,
    tight_fusion_frame_exists,
)
from lowrank_jax.spectral.power_iteration import (
    PowerIterationState,
    attention_group_power_iteration,
    attention_power_iteration,
    init_attention_power_iteration,
    init_power_iteration,
    product_power_iteration,
)
from lowrank_jax.spectral.randomized_svd import randomized_svd

__all__ = [
    # tight fusion frames
    "BASES",
    "frame_analysis",
    "frame_basis",
    "frame_nnz",
    "frame_synthesis",
    "real_tight_fusion_frame",
    "realify",
    "spectral_tetris",
    "tight_fusion_frame",
    "tight_fusion_frame_exists",
    # power iteration
    "PowerIterationState",
    "attention_group_power_iteration",
    "attention_power_iteration",
    "init_attention_power_iteration",
    "init_power_iteration",
    "product_power_iteration",
    # randomised SVD
    "randomized_svd",
]


def __getattr__(name: str):
    """Old ``lowrank_jax.spectral.<fp8 name>`` spellings forward to :mod:`lowrank_jax.fp8`."""
    from lowrank_jax import fp8

    if name in fp8.__all__:
        _warnings.warn(
            f"lowrank_jax.spectral.{name} moved to lowrank_jax.fp8.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(fp8, name)
    raise AttributeError(f"module 'lowrank_jax.spectral' has no attribute {name!r}")
