"""lowrank_jax.analysis: methods that explain models rather than train them.

* :mod:`~lowrank_jax.analysis.multitask` (P9): the threshold-class simulator of the limits of
  adaptation in multitask learning — decoy tasks, target-only / pooled / oracle-prefix ERM and
  adaptive heuristics, vectorised over draws.
* :mod:`~lowrank_jax.analysis.tpv` (P19): test-time prediction variance from training data
  (quantisation and label-noise forms, Hutchinson and per-example Jacobians) and JBR pruning with
  its baseline criteria.
"""

from lowrank_jax.analysis import multitask
from lowrank_jax.analysis.multitask import (
    ESTIMATORS,
    decoy_width,
    empirical_excess_risk,
    sample_pool_tasks,
    sample_threshold_tasks,
    simulate_threshold_family,
    target_eta,
    threshold_estimates,
    threshold_excess_risk,
    weighted_threshold_erm,
)

__all__ = [
    "ESTIMATORS",
    "decoy_width",
    "empirical_excess_risk",
    "multitask",
    "sample_pool_tasks",
    "sample_threshold_tasks",
    "simulate_threshold_family",
    "target_eta",
    "threshold_estimates",
    "threshold_excess_risk",
    "weighted_threshold_erm",
]
