"""lowrank_jax.optim."""
