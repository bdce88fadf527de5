"""lowrank_jax: low-rank and spectral methods for adapting, merging, analysing and training networks."""

__version__ = "0.1.0"
