"""lowrank_jax.models."""
