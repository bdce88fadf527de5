"""Knowledge-graph embeddings and the rank bottleneck of linear output layers (P4, KGE-MoS).

- Scorers as query encoders ``(s, r) -> h``: DistMult, ComplEx (real-ified), TuckER.
- Output layers: linear softmax (1-N), sigmoid (1-vs-all), mixture of softmaxes (KGE-MoS), mixture
  of logits.
- 1-N training with inverse relations; filtered ranking metrics (MRR, Hits@k, PyKEEN's realistic
  ranks), NLL and training-set fit.
- Necessary-dimension bounds for linear output layers (Forster-type sign-rank bounds) next to
  graph size and density; synthetic graphs of controlled size and density.
"""

from lowrank_jax.kge.bounds import linear_output_dim_bound
from lowrank_jax.kge.graphs import add_inverse_triples, build_query_targets, make_synthetic_kg
from lowrank_jax.kge.training import fit_kge, kge_scores, train_fit_metrics

__all__ = [
    "add_inverse_triples",
    "build_query_targets",
    "fit_kge",
    "kge_scores",
    "linear_output_dim_bound",
    "make_synthetic_kg",
    "train_fit_metrics",
]
