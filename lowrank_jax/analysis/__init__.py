"""lowrank_jax.analysis: methods that explain models rather than train them.

* :mod:`~lowrank_jax.analysis.attention_dynamics` (P3): mean-field self-attention token flows on
  the sphere (and in R^d), RK4 under ``jit``, and the drift, time to deviation and W2 distance
  that a low-rank (LoRA) perturbation of V, Q or K causes.
* :mod:`~lowrank_jax.analysis.multitask` (P9): the threshold-class simulator of the limits of
  adaptation in multitask learning — decoy tasks, target-only / pooled / oracle-prefix ERM and
  adaptive heuristics, vectorised over draws.
* :mod:`~lowrank_jax.analysis.tpv` (P19): test-time prediction variance from training data
  (quantisation and label-noise forms, Hutchinson and per-example Jacobians).
* :mod:`~lowrank_jax.analysis.pruning` (P19): JBR label-free structured pruning and the criteria
  random, L1, Taylor, Jacobian-with-labels and exact TPV.
"""

from lowrank_jax.analysis import attention_dynamics, multitask, pruning, tpv
from lowrank_jax.analysis.attention_dynamics import (
    ValueSpectrum,
    attention_lipschitz,
    attention_velocity,
    drift_jump_ratio,
    drift_time_fit,
    gap_value_matrix,
    gronwall_time_to_deviation,
    head_matrices,
    perturbed_drift,
    random_lowrank_perturbation,
    rank_one_perturbation,
    rk4_step,
    sample_sphere,
    simulate_tokens,
    time_to_deviation,
    token_drift,
    value_spectrum,
    wasserstein2,
)
from lowrank_jax.analysis.multitask import (
    ESTIMATORS,
    decoy_width,
    empirical_excess_risk,
    group_pool,
    rank_scores,
    sample_pool_tasks,
    sample_threshold_tasks,
    simulate_threshold_family,
    target_eta,
    threshold_estimates,
    threshold_excess_risk,
    weighted_threshold_erm,
)
from lowrank_jax.analysis.pruning import (
    PruneGroup,
    apply_masks,
    confident_pseudo_labels,
    init_masks,
    mlp_groups,
    prune_iteratively,
    prune_step,
    score_exact_tpv,
    score_jacobian,
    score_l1,
    score_random,
    score_taylor,
    sequential_groups,
)
from lowrank_jax.analysis.tpv import (
    hutchinson_trace_heff,
    per_example_jacobians,
    quantization_variance,
    tpv_label_noise,
    tpv_quantization,
    tpv_quantization_mc,
    trace_heff,
)

__all__ = [
    "PruneGroup",
    "apply_masks",
    "confident_pseudo_labels",
    "init_masks",
    "mlp_groups",
    "prune_iteratively",
    "prune_step",
    "score_exact_tpv",
    "score_jacobian",
    "score_l1",
    "score_random",
    "score_taylor",
    "sequential_groups",
    "hutchinson_trace_heff",
    "per_example_jacobians",
    "quantization_variance",
    "tpv_label_noise",
    "tpv_quantization",
    "tpv_quantization_mc",
    "trace_heff",
    "pruning",
    "tpv",
    "ESTIMATORS",
    "decoy_width",
    "empirical_excess_risk",
    "group_pool",
    "multitask",
    "rank_scores",
    "sample_pool_tasks",
    "sample_threshold_tasks",
    "simulate_threshold_family",
    "target_eta",
    "threshold_estimates",
    "threshold_excess_risk",
    "weighted_threshold_erm",
    "ValueSpectrum",
    "attention_dynamics",
    "attention_lipschitz",
    "attention_velocity",
    "drift_jump_ratio",
    "drift_time_fit",
    "gap_value_matrix",
    "gronwall_time_to_deviation",
    "head_matrices",
    "perturbed_drift",
    "random_lowrank_perturbation",
    "rank_one_perturbation",
    "rk4_step",
    "sample_sphere",
    "simulate_tokens",
    "time_to_deviation",
    "token_drift",
    "value_spectrum",
    "wasserstein2",
]
