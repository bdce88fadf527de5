"""lowrank_jax.tuning."""

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
