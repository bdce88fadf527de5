"""lowrank_jax.prompts."""
