"""lowrank_jax.adapters."""
