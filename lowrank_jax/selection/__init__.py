"""lowrank_jax.selection."""
