"""Generative models: the kernel-score diffusion sampler on a union of subspaces (P7) and its
baselines; flow matching and tail-aware (CVaR) fine-tuning (P16, TFFT).

See :mod:`lowrank_jax.generative.kernel_score` (OU process, kernel score, exponential integrator),
:mod:`lowrank_jax.generative.subspaces` (data on unions of subspaces, local-PCA dimension, W₁) and
:mod:`lowrank_jax.generative.baselines` (empirical measure, Gaussian KDE, DSM-trained MLP score),
:mod:`lowrank_jax.generative.flows` (flow matching, Euler sampler) and
:mod:`lowrank_jax.generative.tail` (CVaR, the TFFT threshold dual, KL tilts).
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
from lowrank_jax.generative.flows import VelocityMLP, flow_matching_loss, sample_flow, train_flow
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
    log_log_slope,
    project_onto_class_subspaces,
    random_subspaces,
    sample_union_of_subspaces,
    wasserstein1,
)
from lowrank_jax.generative.tail import (
    TAILS,
    alpha_for_kl,
    cvar,
    cvar_dual_objective,
    cvar_threshold,
    pseudo_reward,
    quantile_pseudo_reward,
    tilt_for_kl,
    tilt_kl,
    tilt_weights,
)

__all__ = [
    "LAWS",
    "ScoreMLP",
    "TAILS",
    "VelocityMLP",
    "alpha_for_kl",
    "class_subspaces",
    "cvar",
    "cvar_dual_objective",
    "cvar_threshold",
    "dsm_loss",
    "early_stopping_time",
    "estimate_intrinsic_dim",
    "flow_matching_loss",
    "geometric_time_grid",
    "isometric_embedding",
    "kernel_denoiser",
    "kernel_log_density",
    "kernel_score",
    "log_log_slope",
    "mlp_denoiser",
    "ou_forward",
    "ou_mean_std",
    "project_onto_class_subspaces",
    "pseudo_reward",
    "quantile_pseudo_reward",
    "random_subspaces",
    "reverse_diffusion",
    "sample_empirical",
    "sample_flow",
    "sample_kde",
    "sample_kernel_diffusion",
    "sample_union_of_subspaces",
    "score_to_denoiser",
    "select_kde_bandwidth",
    "silverman_bandwidth",
    "terminal_time",
    "tilt_for_kl",
    "tilt_kl",
    "tilt_weights",
    "train_flow",
    "wasserstein1",
]
