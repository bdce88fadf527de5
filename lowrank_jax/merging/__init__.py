"""lowrank_jax.merging."""
