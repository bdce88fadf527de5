r"""GIST vs LESS targeted data selection (P11, specs §11): real text and the synthetic pool.

``data=shakespeare`` (default): a 2-layer char-GPT (d = 64) is pre-trained on a slice of all 35
First Folio plays (``experiments.common.fit``); the pool holds other 64-character passages of all
35 plays plus 10% distractors (copies of pool passages with 30% of their characters replaced at
random); the target is the Histories, with a few-shot validation set of 5 passages per history
play (10 subtasks) and a test set of 30 per play. LoRA (r = 8, q/k/v/o) is warmed up on a random
5% of the pool for 4 epochs (4 checkpoints with their Adam states); each method selects 5%;
LoRA is fine-tuned from the base on the selection (Adam 2e-3, batch 16, the number of steps
in {25, 50, 100, 150} picked per method on the target validation loss); target test loss (nats/char), the share of history passages selected, bytes stored per
example and selection time are reported.

``data=synthetic``: specs §11 (4)'s pool (12 teacher tasks, target = 3 rotated tasks in 9
subtasks, 15% relevant / 10% label-noised / rest irrelevant; ``lowrank_jax.selection.
make_synthetic_pool``), a 32-256-256-10 MLP pre-trained on 4 unrelated tasks, LoRA r = 8 on both
hidden layers; target test accuracy.

Methods: random, LESS (Adam-normalised, Gaussian JL d = 512, 4 checkpoints weighted by their
mean learning rate), GIST k ∈ {4, 9, 32} (1 checkpoint), GIST-diag (k = 9), raw gradient cosine
(no projection), an oracle (random target passages) and the full pool (references).

Commands::

    python -m experiments.train --config=configs/gist.py --workdir=runs/gist
    python -m experiments.train --config=configs/gist.py:data=synthetic --workdir=runs/gist_syn
    python -m experiments.train --config=configs/gist.py:smoke

Runtime, measured on a 2-core CPU shared with ~8 other jobs (load average 20-27, nice 10):
text, 3 seeds: ~25 min (base pre-training 8 min, selection ~5 min per seed, 27 fine-tunes
~5 min); synthetic, 3 seeds: ~10 min; ``:smoke`` ~1 min of CPU (4 min wall on that machine).

Measured results, with the commands that produced them: ``docs/papers/p11_gist.md``; each trend
check's outcome: ``docs/papers/status.toml`` (P11), rendered into that page's verdict.
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"data=shakespeare|synthetic"``, ``"seeds=N"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, data="shakespeare", seeds=0)
    text = arg.data == "shakespeare"
    c = ml_collections.ConfigDict()
    c.experiment = "gist"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.name = arg.data
    if text:
        c.data.seq_len = 32 if arg.smoke else 64
        c.data.pretrain_per_play = 8 if arg.smoke else 200
        c.data.pool_per_play = 12 if arg.smoke else 80
        c.data.val_per_play = 2 if arg.smoke else 5
        c.data.test_per_play = 3 if arg.smoke else 30
        c.data.corrupt_fraction = 0.3
    else:
        c.data.num_pool = 600 if arg.smoke else 6000
        c.data.num_test = 200 if arg.smoke else 2000
        c.data.num_pretrain = 800 if arg.smoke else 8000
    c.data.distractor_fraction = 0.1  # text: corrupted copies; synthetic: label-noised share
    c.data.batch_size = 16

    c.model = ml_collections.ConfigDict()
    if text:
        c.model.dim = 32 if arg.smoke else 64
        c.model.depth = 1 if arg.smoke else 2
        c.model.heads = 4
        c.model.pretrain_steps = 20 if arg.smoke else 800
        c.model.pretrain_lr = 3e-3
        c.model.pretrain_batch = 32
    else:
        c.model.features = (64, 64) if arg.smoke else (256, 256)
        c.model.pretrain_steps = 100 if arg.smoke else 1500
        c.model.pretrain_lr = 1e-3
        c.model.pretrain_batch = 64

    c.adapter = ml_collections.ConfigDict()
    c.adapter.rank = 4 if arg.smoke else 8
    c.adapter.alpha = 2.0 * c.adapter.rank
    c.adapter.targets = (
        (r".*attention/(query|key|value|out)/kernel",) if text else (r"params/dense_\d+/kernel",)
    )

    c.warmup = ml_collections.ConfigDict()
    c.warmup.fraction = 0.05
    c.warmup.epochs = 2 if arg.smoke else 4
    c.warmup.learning_rate = 2e-3
    c.warmup.batch_size = 8

    c.select = ml_collections.ConfigDict()
    c.select.fraction = 0.05
    c.select.methods = ("random", "less", "gist", "gist_diag", "cosine", "oracle", "full")
    c.select.gist_ks = (4, 9) if arg.smoke else (4, 9, 32)
    c.select.gist_diag_k = 4 if arg.smoke else 9
    c.select.less_dim = 64 if arg.smoke else 512
    c.select.less_paper_dim = 8192  # reported apart; the storage check is against LESS as run
    c.select.chunk_size = 64
    c.select.offdiag_pool = 64 if arg.smoke else 512  # pool examples of the §11 (4a) diagnostic

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 2e-3

    c.schedule = ml_collections.ConfigDict()
    # Fine-tuning steps (Adam, constant rate): evaluated after each; the count is picked per
    # method on the target validation loss (the same budget for every method).
    c.schedule.eval_steps = (5, 10) if arg.smoke else (25, 50, 100, 150)

    c.eval = ml_collections.ConfigDict()
    c.eval.num_seeds = arg.seeds or (1 if arg.smoke else 3)
    c.eval.batch_size = 256

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if arg.smoke else 100
    c.log.progress = not arg.smoke
    c.train = train_section()  # options of the shared loop (pre-training): skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
