"""lowrank_jax.analysis: methods that explain models rather than train them.

* :mod:`~lowrank_jax.analysis.attention_dynamics` (P3): mean-field self-attention token flows on
  the sphere (and in R^d), RK4 under ``jit``, and the drift, time to deviation and W2 distance
  that a low-rank (LoRA) perturbation of V, Q or K causes.
* :mod:`~lowrank_jax.analysis.value_lora` (P3): a trained LoRA on a BERT encoder's value kernels
  head by head — each head's OV-circuit update against its eigengap, and the embedding drift it
  causes alone or scaled.
* :mod:`~lowrank_jax.analysis.multitask` (P9): the threshold-class simulator of the limits of
  adaptation in multitask learning — decoy tasks, target-only / pooled / oracle-prefix ERM and
  adaptive heuristics, vectorised over draws; :mod:`~lowrank_jax.analysis.multitask_lower_bound`:
  a Fano-type packing of threshold instances and its exact Bayes risk floor.
* :mod:`~lowrank_jax.analysis.tpv` (P19): test-time prediction variance from training data
  (quantisation and label-noise forms, Hutchinson and per-example Jacobians).
* :mod:`~lowrank_jax.analysis.pruning` (P19): JBR label-free structured pruning and the criteria
  random, L1, Taylor, Jacobian-with-labels and exact TPV.
"""

from lowrank_jax.analysis.attention_dynamics import (
    gap_value_matrix,
    perturbed_drift,
    rank_one_perturbation,
    sample_sphere,
    time_to_deviation,
    value_spectrum,
)
from lowrank_jax.analysis.multitask import ESTIMATORS, decoy_width, simulate_threshold_family
from lowrank_jax.analysis.pruning import (
    apply_masks,
    confident_pseudo_labels,
    mlp_groups,
    prune_iteratively,
    score_jacobian,
    score_l1,
    score_random,
)
from lowrank_jax.analysis.tpv import tpv_quantization

__all__ = [
    "ESTIMATORS",
    "apply_masks",
    "confident_pseudo_labels",
    "decoy_width",
    "gap_value_matrix",
    "mlp_groups",
    "perturbed_drift",
    "prune_iteratively",
    "rank_one_perturbation",
    "sample_sphere",
    "score_jacobian",
    "score_l1",
    "score_random",
    "simulate_threshold_family",
    "time_to_deviation",
    "tpv_quantization",
    "value_spectrum",
]
