"""lowrank_jax.tuning."""
