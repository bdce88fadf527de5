"""lowrank_jax.analysis: methods that explain models rather than train them.

* :mod:`~lowrank_jax.analysis.multitask` (P9): the threshold-class simulator of the limits of
  adaptation in multitask learning — decoy tasks, target-only / pooled / oracle-prefix ERM and
  adaptive heuristics, vectorised over draws.
* :mod:`~lowrank_jax.analysis.tpv` (P19): test-time prediction variance from training data
  (quantisation and label-noise forms, Hutchinson and per-example Jacobians).
* :mod:`~lowrank_jax.analysis.pruning` (P19): JBR label-free structured pruning and the criteria
  random, L1, Taylor, Jacobian-with-labels and exact TPV.
"""

from lowrank_jax.analysis import multitask, pruning, tpv
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
]
