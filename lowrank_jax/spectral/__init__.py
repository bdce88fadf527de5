"""lowrank_jax.spectral."""
