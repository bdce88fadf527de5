"""lowrank_jax.data."""
