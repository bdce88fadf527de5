"""lowrank_jax.analysis."""
