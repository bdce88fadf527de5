"""Targeted data selection from factorised per-example LoRA gradients: GIST (P11) and LESS.

Pipeline: :func:`gradient_features` (chunked ``vmap(grad)`` over the adapter factors, reduced per
chunk by a projection) -> a scorer (:func:`~lowrank_jax.selection.scoring.gist_scores` on
:func:`~lowrank_jax.selection.scoring.gist_basis` projections,
:func:`~lowrank_jax.selection.scoring.less_scores` on Adam-normalised
(:func:`~lowrank_jax.selection.gradients.adam_update_direction`) JL-projected
(:func:`~lowrank_jax.selection.random_projection.jl_project`) features,
:func:`~lowrank_jax.selection.scoring.cosine_scores`, :func:`random_scores`) -> :func:`select_top`.
Diagnostic (specs §11 (4a)): :func:`offdiag_energy_ratio` of the gradient second moment, LoRA
factors vs full parameters (:func:`~lowrank_jax.selection.diagnostics.lora_vs_full_offdiag`).
LESS's warm-up: :func:`warmup_optimizer`, :func:`warmup_checkpoint`. Problems to select from:
:func:`make_synthetic_pool` (specs §11 (4)) and :func:`make_shakespeare_pool` (real text).
"""

from lowrank_jax.selection.diagnostics import offdiag_energy_ratio, permutation_null
from lowrank_jax.selection.gradients import gradient_features
from lowrank_jax.selection.pipeline import (
    cosine_pipeline,
    gist_pipeline,
    less_pipeline,
    warmup_checkpoint,
    warmup_optimizer,
)
from lowrank_jax.selection.scoring import feature_storage_bytes, random_scores, select_top
from lowrank_jax.selection.synthetic import POOL_KINDS, make_synthetic_pool
from lowrank_jax.selection.text_pool import make_shakespeare_pool

__all__ = [
    "POOL_KINDS",
    "cosine_pipeline",
    "feature_storage_bytes",
    "gist_pipeline",
    "gradient_features",
    "less_pipeline",
    "make_shakespeare_pool",
    "make_synthetic_pool",
    "offdiag_energy_ratio",
    "permutation_null",
    "random_scores",
    "select_top",
    "warmup_checkpoint",
    "warmup_optimizer",
]
