r"""LoRA-BO (P15, specs §15): Bayesian optimisation of LoRA hyper-parameters over a discrete grid.

Task: an MLP 64-128-128 pre-trained on sklearn digits 0-4 gets a new 5-way head and LoRA on its
two hidden kernels, fine-tuned on digits 5-9 (450 train / 225 valid / rest test examples). The
grid: rank {1,2,4,8,16} × alpha {1,4,8,16,32,64} × learning rate {1e-4,3e-4,...,1e-1} (7) ×
batch {8,16,32,64} × dropout {0,.1,.2} = 2,520 configurations, each trained once with Adam for
10 epochs on the full training set and once on a 10% proxy (45 examples, same epochs), all
precomputed with jit+vmap (one call per (rank, dropout) group). The searchers (30 evaluations, 5
random initial, 20 seeds) query the proxy table, as the paper's pipeline does: GP-EI on the
MiniLM embedding of prompt + configuration text with a learnable residual token, on hand-made
knowledge features (with and without a learnable residual), ordinal and one-hot encodings;
random search; Optuna TPE. Reported: Spearman(proxy, full), median simple regret at 30
evaluations (proxy objective, and full-data validation accuracy of the best proxy configuration
found), and the configuration LoRA-BO (MiniLM GP-EI) picks — best proxy-validation score among its
evaluations, trained in full — against the default (r=8, α=16, lr=1e-3, batch 32, dropout 0.05).

Commands::

    nice -n 10 python -m experiments.train --config=configs/lora_bo.py
    python -m experiments.train --config=configs/lora_bo.py:smoke

Runtime, measured on the 2-core CPU under heavy load (load average ~20): the score table 8 min,
MiniLM embeddings 5 min, searches 15 min; cached in the workdir (``cells/``, ``scores.npz``,
``minilm.npz``) so reruns are instant (``objective=full`` reuses them when the three are copied
into its workdir). ``:smoke`` (8 configurations, 2 seeds; MiniLM GP-EI, random, TPE): 70 s wall
under that load. Measured results, with the commands that produced them:
``docs/papers/p15_lora_bo.md``; each trend check's outcome: ``docs/papers/status.toml`` (P15),
rendered into that page's verdict.
"""

import ml_collections

from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"`` (an 8-configuration grid, 2 seeds, short searches);
    ``"objective=proxy|full"`` (the score table the searchers query)."""
    arg = parse_arg(arg, smoke=False, objective="proxy")
    c = ml_collections.ConfigDict()
    c.experiment = "lora_bo"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.source_classes = (0, 1, 2, 3, 4)
    c.data.num_train = 450
    c.data.num_valid = 225
    c.data.proxy_fraction = 0.1

    c.model = ml_collections.ConfigDict()
    c.model.features = (128, 128)
    c.model.pretrain_steps = 100 if arg.smoke else 1500

    c.adapter = ml_collections.ConfigDict()
    c.adapter.targets = (r"params/dense_\d+/kernel",)
    c.adapter.trainable = (r"params/head/.*",)
    c.adapter.ranks = (2,) if arg.smoke else (1, 2, 4, 8, 16)
    c.adapter.alphas = (4.0, 16.0) if arg.smoke else (1.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    c.adapter.dropouts = (0.0,) if arg.smoke else (0.0, 0.1, 0.2)
    # The default configuration the best found one is compared with.
    c.adapter.default = ml_collections.ConfigDict(
        {"rank": 8, "alpha": 16.0, "learning_rate": 1e-3, "batch_size": 32, "dropout": 0.05}
    )

    c.optim = ml_collections.ConfigDict()
    lrs = (1e-3, 1e-2) if arg.smoke else (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
    c.optim.learning_rates = lrs
    c.optim.batch_sizes = (8, 16) if arg.smoke else (8, 16, 32, 64)
    c.optim.micro_batch = 8

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_epochs = 1 if arg.smoke else 10

    c.search = ml_collections.ConfigDict()
    smoke_methods = ("bo_minilm", "random", "tpe")
    c.search.methods = (
        smoke_methods
        if arg.smoke
        else (
            "bo_minilm",
            "bo_knowledge",
            "bo_knowledge_residual",
            "bo_ordinal",
            "bo_onehot",
            "random",
            "tpe",
        )
    )
    c.search.objective = arg.objective
    c.search.num_seeds = 2 if arg.smoke else 20
    c.search.budget = 6 if arg.smoke else 30
    c.search.n_init = 3 if arg.smoke else 5
    c.search.fit_steps = 30 if arg.smoke else 150
    c.search.residual_dim = 2
    c.search.xi = 0.01
    c.search.pca_dim = 4 if arg.smoke else 16
    c.search.token_dim = 4 if arg.smoke else 16
    c.search.max_len = 80

    c.eval = ml_collections.ConfigDict()
    c.eval.min_spearman = 0.7
    c.eval.clear_margin = 0.02  # test accuracy above the default's that counts as "clear"

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True
    c.log = ml_collections.ConfigDict()
    c.log.progress = True
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
