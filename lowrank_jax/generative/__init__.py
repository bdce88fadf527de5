"""lowrank_jax.generative."""
