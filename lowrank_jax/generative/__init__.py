"""Generative models: the kernel-score diffusion sampler on a union of subspaces (P7) and its
baselines.

See :mod:`lowrank_jax.generative.kernel_score` (OU process, kernel score, exponential integrator),
:mod:`lowrank_jax.generative.subspaces` (data on unions of subspaces, local-PCA dimension, W₁) and
:mod:`lowrank_jax.generative.baselines` (empirical measure, Gaussian KDE, DSM-trained MLP score).
"""

from lowrank_jax.generative.baselines import (
    ScoreMLP,
    dsm_loss,
    mlp_denoiser,
    sample_empirical,
    sample_kde,
    select_kde_bandwidth,
    silverman_bandwidth,
)
from lowrank_jax.generative.kernel_score import (
    early_stopping_time,
    geometric_time_grid,
    kernel_denoiser,
    kernel_log_density,
    kernel_score,
    ou_forward,
    ou_mean_std,
    reverse_diffusion,
    sample_kernel_diffusion,
    score_to_denoiser,
    terminal_time,
)
from lowrank_jax.generative.subspaces import (
    LAWS,
    class_subspaces,
    estimate_intrinsic_dim,
    isometric_embedding,
    project_onto_class_subspaces,
    random_subspaces,
    sample_union_of_subspaces,
    wasserstein1,
)

__all__ = [
    "LAWS",
    "ScoreMLP",
    "class_subspaces",
    "dsm_loss",
    "early_stopping_time",
    "estimate_intrinsic_dim",
    "geometric_time_grid",
    "isometric_embedding",
    "kernel_denoiser",
    "kernel_log_density",
    "kernel_score",
    "mlp_denoiser",
    "ou_forward",
    "ou_mean_std",
    "project_onto_class_subspaces",
    "random_subspaces",
    "reverse_diffusion",
    "sample_empirical",
    "sample_kde",
    "sample_kernel_diffusion",
    "sample_union_of_subspaces",
    "score_to_denoiser",
    "select_kde_bandwidth",
    "silverman_bandwidth",
    "terminal_time",
    "wasserstein1",
]
