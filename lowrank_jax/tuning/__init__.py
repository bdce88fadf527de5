"""lowrank_jax.tuning: data-driven hyperparameter tuning.

* :mod:`~lowrank_jax.tuning.lasso` (P12): FISTA for the weighted group lasso and the weighted
  fused lasso, vmapped over problem instances and candidate weight vectors.
* :mod:`~lowrank_jax.tuning.lasso_tuners` (P12): tuners of ``p`` tied weights on the mean validation
  loss of ``N`` instances: scalar grid, random search + coordinate refinement, Optuna TPE.
* :mod:`~lowrank_jax.tuning.synthetic` (P12): the synthetic instance distributions of specs §12.
"""

from lowrank_jax.tuning import lasso, lasso_tuners, synthetic
from lowrank_jax.tuning.lasso import (
    Penalty,
    Prepared,
    fista,
    fused_lasso,
    group_lasso,
    lasso_objective,
    prepare,
    prepare_instances,
    prox_group_lasso,
    prox_weighted_l1,
    solve,
    tie_weights,
    validation_loss,
    validation_losses,
)
from lowrank_jax.tuning.lasso_tuners import (
    TuneResult,
    coordinate_refine,
    empirical_risk,
    log_grid,
    sample_log_uniform,
    tune_grid,
    tune_random,
    tune_random_refine,
    tune_tpe,
)
from lowrank_jax.tuning.synthetic import Instances, sample_fused_instances, sample_group_instances

__all__ = [
    "Instances",
    "Penalty",
    "Prepared",
    "TuneResult",
    "coordinate_refine",
    "empirical_risk",
    "tune_grid",
    "log_grid",
    "tune_random",
    "tune_random_refine",
    "sample_log_uniform",
    "sample_fused_instances",
    "sample_group_instances",
    "lasso_tuners",
    "synthetic",
    "tune_tpe",
    "fista",
    "fused_lasso",
    "group_lasso",
    "lasso",
    "lasso_objective",
    "prepare",
    "prepare_instances",
    "prox_group_lasso",
    "prox_weighted_l1",
    "solve",
    "tie_weights",
    "validation_loss",
    "validation_losses",
]
