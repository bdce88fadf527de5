"""lowrank_jax.tuning: data-driven hyperparameter tuning.

* :mod:`~lowrank_jax.tuning.lasso` (P12): FISTA for the weighted group lasso and the weighted
  fused lasso, vmapped over problem instances and candidate weight vectors.
* :mod:`~lowrank_jax.tuning.lasso_tuners` (P12): tuners of ``p`` tied weights on the mean validation
  loss of ``N`` instances: scalar grid, random search + coordinate refinement (the baselines
  random search and Optuna TPE of :mod:`~lowrank_jax.tuning.search` serve both P12 and P15).
* :mod:`~lowrank_jax.tuning.bounds` (P12): the pseudo-dimension generalisation bound (Warren's
  polynomial count for the lasso families, uniform convergence with explicit constants).
* :mod:`~lowrank_jax.tuning.synthetic` (P12): the synthetic instance distributions of specs §12,
  and instances around a bank of real signals (:mod:`~lowrank_jax.tuning.signal_banks`: calendar-
  aligned weekly windows of daily series, e.g. Chicago ridership).
* P15 LoRA-BO (``bo``, ``lora_space``, ``lora_grid``, ``search``, ``text_embedding``): GP-EI over
  a discrete LoRA grid embedded by a language model, and its baselines.
"""

from lowrank_jax.tuning.bo import CandidateEmbedding, bayes_opt
from lowrank_jax.tuning.lasso import group_lasso, validation_losses
from lowrank_jax.tuning.lasso_tuners import empirical_risk, log_grid_search, random_refine_search
from lowrank_jax.tuning.lora_grid import score_lora_group
from lowrank_jax.tuning.lora_space import (
    LoraSearchSpace,
    describe_configurations,
    knowledge_features,
    lora_grid_configurations,
    standardize_features,
    value_tokens,
)
from lowrank_jax.tuning.search import (
    LogBox,
    SearchResult,
    log_grid,
    random_search,
    simple_regret,
    tpe_search,
)
from lowrank_jax.tuning.synthetic import sample_group_instances
from lowrank_jax.tuning.text_embedding import minilm_embedding

__all__ = [
    "CandidateEmbedding",
    "LogBox",
    "LoraSearchSpace",
    "SearchResult",
    "bayes_opt",
    "describe_configurations",
    "empirical_risk",
    "group_lasso",
    "knowledge_features",
    "log_grid",
    "log_grid_search",
    "lora_grid_configurations",
    "minilm_embedding",
    "random_refine_search",
    "random_search",
    "sample_group_instances",
    "score_lora_group",
    "simple_regret",
    "standardize_features",
    "tpe_search",
    "validation_losses",
    "value_tokens",
]
