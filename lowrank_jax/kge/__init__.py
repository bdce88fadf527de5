"""lowrank_jax.kge."""
