r"""Rank bottleneck of linear output layers in KGEs, and the mixture-of-softmaxes fix (P4, KGE-MoS).

1-N DistMult and ComplEx with inverse relations on Nations, UMLS and Kinships, full-batch Adam:
a d x K sweep (K = 1 is the linear softmax, K > 1 the mixture of softmaxes) measuring the fit of
the *training* set (NLL, training-filtered MRR, fraction of queries ranked perfectly) and the
filtered test MRR; baselines at the small dimension ``model.baseline_dim`` (sigmoid 1-vs-all,
K = 1 with the non-linear projection, mixture of logits, a linear model with the mixture's
parameter count, an ensemble of K linear models); a synthetic control of random graphs of
controlled size and density; the Forster-type necessary dimension next to each graph's size and
density. See ``experiments/kge.py`` and specs.md section 4.

Command::

    python -m experiments.train --config=configs/kge.py --workdir=runs/kge

Runtime: about 60 minutes measured on a 2-core CPU heavily shared with other jobs (load ~10),
less on free cores (``:smoke``: about 40 s unloaded, 2 minutes loaded).
Rerunning the command resumes: finished sweep cells are read back from ``<workdir>/cells``.

``results.md`` prints each trend check of specs.md section 4 as reproduced or not. Measured results,
with the commands that produced them: ``docs/papers/p04_kge_rank_bottleneck.md``; each trend check's
outcome: ``docs/papers/status.toml`` (P4), rendered into that page's verdict.

``arg``: ``"smoke"`` (Nations, DistMult, d in {2, 8}, K in {1, 2}, 60 epochs, one small synthetic
graph).
"""

import ml_collections

from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"`` or nothing."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "kge"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.datasets = ("nations",) if arg.smoke else ("nations", "umls", "kinships")
    # Synthetic control: every triple present independently with probability `density`.
    c.data.synthetic_entities = (30,) if arg.smoke else (50, 200)
    c.data.synthetic_densities = (0.1, 0.3) if arg.smoke else (0.02, 0.1, 0.3)
    c.data.synthetic_relations = 2 if arg.smoke else 5

    c.model = ml_collections.ConfigDict()
    c.model.scorers = ("distmult",) if arg.smoke else ("distmult", "complex")
    c.model.dims = (2, 8) if arg.smoke else (2, 4, 8, 16, 32)
    c.model.components = (1, 2) if arg.smoke else (1, 2, 4, 8)  # K = 1: linear softmax
    c.model.baseline_dim = 2 if arg.smoke else 4  # the "fixed small d" of the baselines
    c.model.baseline_components = 2 if arg.smoke else 4  # K of mol / matched / ensemble
    c.model.baselines = (
        ("mos1", "matched") if arg.smoke else ("sigmoid", "mos1", "mol", "matched", "ensemble")
    )
    # Mixture projections W_k: "identity" (I + small noise, starts near the linear model; fitted
    # better in trial runs) or "random" (N(0, 1/d), Yang et al. 2018).
    c.model.proj_init = "identity"
    # ComplEx: DistMult cannot fit the asymmetric random graphs at any d.
    c.model.synthetic_scorer = "complex"
    c.model.synthetic_components = (1,) if arg.smoke else (1, 4)

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adam"
    c.optim.learning_rate = 0.05

    c.schedule = ml_collections.ConfigDict()
    c.schedule.epochs = 60 if arg.smoke else 300
    c.schedule.batch_size = 0  # queries per step; 0 = full batch

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 1024
    c.eval.fit_mrr = 0.95  # "near-perfect training fit": training MRR at least this
    c.eval.small_dims = (2,) if arg.smoke else (2, 4)  # where the mixture gain is measured
    c.eval.max_overhead = 0.05  # the spec's "< 5 % extra parameters"

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # reuse finished cells in <workdir>/cells

    c.log = ml_collections.ConfigDict()
    c.log.every = 20 if arg.smoke else 50  # epochs between logged losses
    c.log.tensorboard = False
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
