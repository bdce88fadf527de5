"""Targeted data selection from factorised per-example LoRA gradients: GIST (P11) and LESS.

Pipeline: :func:`gradient_features` (chunked ``vmap(grad)`` over the adapter factors, reduced per
chunk by a projection) -> a scorer (:func:`gist_scores` on :func:`gist_basis` projections,
:func:`less_scores` on Adam-normalised (:func:`adam_update_direction`) JL-projected
(:func:`jl_project`) features, :func:`cosine_scores`, :func:`random_scores`) -> :func:`select_top`.
Diagnostic (specs §11 (4a)): :func:`offdiag_energy_ratio` of the gradient second moment, LoRA
factors vs full parameters (:func:`lora_vs_full_offdiag`). LESS's warm-up:
:func:`warmup_optimizer`, :func:`warmup_checkpoint`. Problems to select from:
:func:`make_synthetic_pool` (specs §11 (4)) and :func:`make_shakespeare_pool` (real text).
"""

from lowrank_jax.selection.diagnostics import (
    coordinate_subset,
    lora_vs_full_offdiag,
    offdiag_energy_ratio,
    permutation_null,
    take_columns,
)
from lowrank_jax.selection.gradients import (
    adam_moments,
    adam_precondition,
    adam_update_direction,
    flatten_per_example,
    gradient_features,
    per_example_grads,
)
from lowrank_jax.selection.pipeline import (
    WarmupCheckpoint,
    cosine_pipeline,
    gist_pipeline,
    less_pipeline,
    warmup_checkpoint,
    warmup_optimizer,
)
from lowrank_jax.selection.projection import jl_matrix, jl_project
from lowrank_jax.selection.scoring import (
    GistBasis,
    cosine_scores,
    feature_storage_bytes,
    gist_basis,
    gist_scores,
    less_scores,
    random_scores,
    select_top,
    subtask_means,
)
from lowrank_jax.selection.synthetic import POOL_KINDS, SyntheticPool, make_synthetic_pool
from lowrank_jax.selection.text_pool import TextPool, make_shakespeare_pool

__all__ = [
    "POOL_KINDS",
    "GistBasis",
    "SyntheticPool",
    "TextPool",
    "WarmupCheckpoint",
    "adam_moments",
    "adam_precondition",
    "adam_update_direction",
    "coordinate_subset",
    "cosine_pipeline",
    "cosine_scores",
    "feature_storage_bytes",
    "flatten_per_example",
    "gist_basis",
    "gist_pipeline",
    "gist_scores",
    "gradient_features",
    "jl_matrix",
    "jl_project",
    "less_pipeline",
    "less_scores",
    "lora_vs_full_offdiag",
    "make_shakespeare_pool",
    "make_synthetic_pool",
    "offdiag_energy_ratio",
    "per_example_grads",
    "permutation_null",
    "random_scores",
    "select_top",
    "subtask_means",
    "take_columns",
    "warmup_checkpoint",
    "warmup_optimizer",
]
