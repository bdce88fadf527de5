"""lowrank_jax.changepoint."""
