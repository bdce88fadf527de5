"""Generative models: the kernel-score diffusion sampler on a union of subspaces (P7) and its
baselines; flow matching and tail-aware (CVaR) fine-tuning (P16, TFFT).

See :mod:`lowrank_jax.generative.kernel_score` (OU process, kernel score, exponential integrator),
:mod:`lowrank_jax.generative.subspaces` (data on unions of subspaces, local-PCA dimension, W₁) and
:mod:`lowrank_jax.generative.baselines` (empirical measure, Gaussian KDE, DSM-trained MLP score),
:mod:`lowrank_jax.generative.flows` (flow matching, Euler sampler),
:mod:`lowrank_jax.generative.adjoint` (adjoint matching, exact flow log-likelihood and KL) and
:mod:`lowrank_jax.generative.tail` (CVaR, the TFFT threshold dual, KL tilts).
"""

from lowrank_jax.generative.adjoint import flow_kl, train_adjoint_matching
from lowrank_jax.generative.baselines import sample_empirical, sample_kde, select_kde_bandwidth
from lowrank_jax.generative.flows import VelocityMLP, sample_flow, train_flow
from lowrank_jax.generative.kernel_score import sample_kernel_diffusion
from lowrank_jax.generative.subspaces import (
    estimate_intrinsic_dim,
    log_log_slope,
    random_subspaces,
    sample_union_of_subspaces,
    wasserstein1,
)
from lowrank_jax.generative.tail import (
    TAILS,
    cvar,
    cvar_threshold,
    pseudo_reward,
    reward_log_tilt,
    tilt_for_kl,
    tilt_kl,
    tilt_weights,
)

__all__ = [
    "TAILS",
    "VelocityMLP",
    "cvar",
    "cvar_threshold",
    "estimate_intrinsic_dim",
    "flow_kl",
    "log_log_slope",
    "pseudo_reward",
    "random_subspaces",
    "reward_log_tilt",
    "sample_empirical",
    "sample_flow",
    "sample_kde",
    "sample_kernel_diffusion",
    "sample_union_of_subspaces",
    "select_kde_bandwidth",
    "tilt_for_kl",
    "tilt_kl",
    "tilt_weights",
    "train_adjoint_matching",
    "train_flow",
    "wasserstein1",
]
