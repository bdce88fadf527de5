r"""Extra-Merge (P5) on a character-level GPT trained on Shakespeare's plays, AdamW and Muon.

A 2-layer char-GPT (d = 64, 4 heads, 32-character context) is trained on the 35 First Folio plays
at a constant learning rate (after a short warm-up) with AdamW and with Muon
(``optax.contrib.muon``; Adam on the non-matrix parameters), 5 seeds each. The last 40% of
training leaves 40 checkpoints; they are merged by LAWA, EMA, ExPO and Extra-Merge
(``lowrank_jax.merging``), and a WSD run branches off at the window's start and decays the
learning rate linearly to 0 over the same window. Every merge's hyper-parameters are chosen on the
validation split; test loss is reported (nats per character), with ρ₁ of the raw (W = 1) and
window-merged (W = 5, 10) trajectories and the valid-loss-vs-α curve.

Commands::

    python -m experiments.train --config=configs/extra_merge.py --workdir=runs/extra_merge
    python -m experiments.train --config=configs/extra_merge.py:smoke

Runtime: the default command took 55 min wall on a 2-core CPU shared with other jobs (load
average 20-35, nice 10; not timed on an idle machine); ``:smoke`` 3 min on that loaded machine.
Measured results, with the commands that produced them: ``docs/papers/p05_extra_merge.md``; each
trend check's outcome: ``docs/papers/status.toml`` (P5), rendered into that page's verdict.
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"`` for the one-minute check."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "extra_merge"
    c.seed = 0
    c.num_seeds = 1 if arg.smoke else 5

    c.data = ml_collections.ConfigDict()
    c.data.seq_len = 32
    c.data.max_passages_per_play = 40 if arg.smoke else 3000
    c.data.batch_size = 16 if arg.smoke else 32
    c.data.valid_fraction = 0.05 if arg.smoke else 0.005
    c.data.test_fraction = 0.1 if arg.smoke else 0.02

    c.model = ml_collections.ConfigDict()
    c.model.dim = 32 if arg.smoke else 64
    c.model.depth = 1 if arg.smoke else 2
    c.model.heads = 4

    c.optim = ml_collections.ConfigDict()
    c.optim.names = ("adamw", "muon")
    c.optim.learning_rates = (3e-3, 0.02)  # (adamw, muon); Muon's Adam part uses adamw's
    c.optim.weight_decay = 0.1

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 60 if arg.smoke else 600
    c.schedule.warmup_steps = 5 if arg.smoke else 30
    c.schedule.window_fraction = 0.4
    c.schedule.num_checkpoints = 8 if arg.smoke else 40

    c.merge = ml_collections.ConfigDict()
    c.merge.extra_windows = (3,) if arg.smoke else (5, 10)
    c.merge.rho_windows = (1, 3) if arg.smoke else (1, 5, 10)
    c.merge.lawa_windows = (3, 7) if arg.smoke else (5, 10, 20, 39)
    c.merge.ema_decays = (0.5, 0.8) if arg.smoke else (0.8, 0.9, 0.95, 0.98)
    c.merge.expo_alphas = (0.0, 1.0) if arg.smoke else (0.0, 0.5, 1.0, 2.0, 4.0)
    c.merge.alpha_step = 1.0
    c.merge.sketch_dim = 1 << 16

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 256

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.keep_runs = False  # delete each run's checkpoints once its cell is written

    c.log = ml_collections.ConfigDict()
    c.log.every = 10 if arg.smoke else 100
    c.log.progress = True
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
