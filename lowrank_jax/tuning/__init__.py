"""lowrank_jax.tuning: data-driven hyperparameter tuning.

* :mod:`~lowrank_jax.tuning.lasso` (P12): FISTA for the weighted group lasso and the weighted
  fused lasso, vmapped over problem instances and candidate weight vectors.
* :mod:`~lowrank_jax.tuning.search` (P12): tuners of ``p`` tied weights on the mean validation
  loss of ``N`` instances: scalar grid, random search + coordinate refinement, Optuna TPE.
* :mod:`~lowrank_jax.tuning.synthetic` (P12): the synthetic instance distributions of specs §12.
"""

from lowrank_jax.tuning import lasso, search, synthetic
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
from lowrank_jax.tuning.search import (
    TuneResult,
    coordinate_refine,
    empirical_risk,
    grid_search,
    log_grid,
    random_search,
    random_search_refine,
    sample_log_uniform,
    tpe_search,
)
from lowrank_jax.tuning.synthetic import Instances, sample_fused_instances, sample_group_instances

__all__ = [
    "Instances",
    "Penalty",
    "Prepared",
    "TuneResult",
    "coordinate_refine",
    "empirical_risk",
    "grid_search",
    "log_grid",
    "random_search",
    "random_search_refine",
    "sample_log_uniform",
    "sample_fused_instances",
    "sample_group_instances",
    "search",
    "synthetic",
    "tpe_search",
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
