"""lowrank_jax.continual."""
