"""Knowledge-graph embeddings and the rank bottleneck of linear output layers (P4, KGE-MoS).

- Scorers as query encoders ``(s, r) -> h``: DistMult, ComplEx (real-ified), TuckER.
- Output layers: linear softmax (1-N), sigmoid (1-vs-all), mixture of softmaxes (KGE-MoS), mixture
  of logits.
- 1-N training with inverse relations; filtered ranking metrics (MRR, Hits@k, PyKEEN's realistic
  ranks), NLL and training-set fit.
- Necessary-dimension bounds for linear output layers (Forster-type sign-rank bounds) next to
  graph size and density; synthetic graphs of controlled size and density.
"""

from lowrank_jax.kge.bounds import (
    WEIGHTINGS,
    forster_bound,
    linear_output_dim_bound,
    sign_rank_lower_bound,
)
from lowrank_jax.kge.graphs import (
    QueryTargets,
    SyntheticKG,
    add_inverse_triples,
    build_query_targets,
    graph_stats,
    lookup_queries,
    make_synthetic_kg,
    query_label_matrix,
)
from lowrank_jax.kge.metrics import (
    as_partial,
    filtered_ranks,
    multi_hot,
    perfect_ranking,
    rank_metrics,
    rank_triples,
)
from lowrank_jax.kge.outputs import (
    OUTPUTS,
    init_output,
    mixture_of_softmaxes,
    output_log_probs,
    output_loss,
    output_scores,
)
from lowrank_jax.kge.scorers import SCORERS, init_scorer, query_embedding
from lowrank_jax.kge.training import (
    count_params,
    fit_kge,
    init_kge,
    kge_scores,
    make_train_epoch,
    train_fit_metrics,
)

__all__ = [
    "OUTPUTS",
    "SCORERS",
    "WEIGHTINGS",
    "QueryTargets",
    "SyntheticKG",
    "add_inverse_triples",
    "as_partial",
    "build_query_targets",
    "count_params",
    "filtered_ranks",
    "fit_kge",
    "forster_bound",
    "graph_stats",
    "init_kge",
    "init_output",
    "init_scorer",
    "kge_scores",
    "linear_output_dim_bound",
    "lookup_queries",
    "make_synthetic_kg",
    "make_train_epoch",
    "mixture_of_softmaxes",
    "multi_hot",
    "output_log_probs",
    "output_loss",
    "output_scores",
    "perfect_ranking",
    "query_embedding",
    "query_label_matrix",
    "rank_metrics",
    "rank_triples",
    "sign_rank_lower_bound",
    "train_fit_metrics",
]
