"""lowrank_jax.tuning: data-driven hyperparameter tuning.

* :mod:`~lowrank_jax.tuning.lasso` (P12): FISTA for the weighted group lasso and the weighted
  fused lasso, vmapped over problem instances and candidate weight vectors.
* :mod:`~lowrank_jax.tuning.lasso_tuners` (P12): tuners of ``p`` tied weights on the mean validation
  loss of ``N`` instances: scalar grid, random search + coordinate refinement, Optuna TPE.
* :mod:`~lowrank_jax.tuning.bounds` (P12): the pseudo-dimension generalisation bound (Warren's
  polynomial count for the lasso families, uniform convergence with explicit constants).
* :mod:`~lowrank_jax.tuning.synthetic` (P12): the synthetic instance distributions of specs §12,
  and instances around a bank of real signals (:mod:`~lowrank_jax.tuning.signals`: calendar-
  aligned weekly windows of daily series, e.g. Chicago ridership).
* P15 LoRA-BO (``bo``, ``lora_space``, ``lora_grid``, ``search``, ``text_embedding``): GP-EI over
  a discrete LoRA grid embedded by a language model, and its baselines (exports at the end).
"""

from lowrank_jax.tuning import bounds, lasso, lasso_tuners, signals, synthetic
from lowrank_jax.tuning.bounds import (
    lasso_loss_polynomials,
    pseudo_dimension_bound,
    uniform_convergence_bound,
    uniform_convergence_sample_size,
)
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
    instance_losses,
    log_grid,
    sample_log_uniform,
    tune_grid,
    tune_random,
    tune_random_refine,
    tune_tpe,
)
from lowrank_jax.tuning.signals import WeeklyWindows, weekly_windows
from lowrank_jax.tuning.synthetic import (
    Instances,
    sample_fused_instances,
    sample_group_instances,
    sample_row_instances,
    sample_signal_instances,
)

__all__ = [
    "bounds",
    "lasso_loss_polynomials",
    "pseudo_dimension_bound",
    "uniform_convergence_bound",
    "uniform_convergence_sample_size",
    "Instances",
    "Penalty",
    "Prepared",
    "TuneResult",
    "coordinate_refine",
    "empirical_risk",
    "instance_losses",
    "tune_grid",
    "log_grid",
    "tune_random",
    "tune_random_refine",
    "sample_log_uniform",
    "sample_fused_instances",
    "sample_group_instances",
    "sample_row_instances",
    "sample_signal_instances",
    "signals",
    "WeeklyWindows",
    "weekly_windows",
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

# P15 LoRA-BO: GP-EI over a discrete grid with language-model embeddings, and its baselines.
from lowrank_jax.tuning.bo import CandidateEmbedding as CandidateEmbedding
from lowrank_jax.tuning.bo import bayes_opt as bayes_opt
from lowrank_jax.tuning.bo import embed as embed
from lowrank_jax.tuning.bo import expected_improvement as expected_improvement
from lowrank_jax.tuning.bo import fit_gp as fit_gp
from lowrank_jax.tuning.bo import gp_neg_log_posterior as gp_neg_log_posterior
from lowrank_jax.tuning.bo import gp_predict as gp_predict
from lowrank_jax.tuning.bo import init_gp_params as init_gp_params
from lowrank_jax.tuning.lora_grid import epoch_order as epoch_order
from lowrank_jax.tuning.lora_grid import score_lora_group as score_lora_group
from lowrank_jax.tuning.lora_space import LORA_PROMPT as LORA_PROMPT
from lowrank_jax.tuning.lora_space import LoraSearchSpace as LoraSearchSpace
from lowrank_jax.tuning.lora_space import describe_configurations as describe_configurations
from lowrank_jax.tuning.lora_space import knowledge_features as knowledge_features
from lowrank_jax.tuning.lora_space import lora_grid_configurations as lora_grid_configurations
from lowrank_jax.tuning.lora_space import onehot_features as onehot_features
from lowrank_jax.tuning.lora_space import ordinal_features as ordinal_features
from lowrank_jax.tuning.lora_space import standardize_features as standardize_features
from lowrank_jax.tuning.lora_space import value_tokens as value_tokens
from lowrank_jax.tuning.search import BOResult as BOResult
from lowrank_jax.tuning.search import check_budget as check_budget
from lowrank_jax.tuning.search import random_search as random_search
from lowrank_jax.tuning.search import score_function as score_function
from lowrank_jax.tuning.search import simple_regret as simple_regret
from lowrank_jax.tuning.search import tpe_search as tpe_search
from lowrank_jax.tuning.text_embedding import embedding_from_states as embedding_from_states
from lowrank_jax.tuning.text_embedding import encode_texts as encode_texts
from lowrank_jax.tuning.text_embedding import minilm_embedding as minilm_embedding
from lowrank_jax.tuning.text_embedding import principal_components as principal_components

__all__ += [
    "CandidateEmbedding",
    "bayes_opt",
    "embed",
    "expected_improvement",
    "fit_gp",
    "gp_neg_log_posterior",
    "gp_predict",
    "init_gp_params",
    "epoch_order",
    "score_lora_group",
    "LORA_PROMPT",
    "LoraSearchSpace",
    "describe_configurations",
    "knowledge_features",
    "lora_grid_configurations",
    "onehot_features",
    "ordinal_features",
    "standardize_features",
    "value_tokens",
    "BOResult",
    "check_budget",
    "random_search",
    "score_function",
    "simple_regret",
    "tpe_search",
    "embedding_from_states",
    "encode_texts",
    "minilm_embedding",
    "principal_components",
]
