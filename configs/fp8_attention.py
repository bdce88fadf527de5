r"""FP8 attention logits under transients: geometry-aware (P14) vs delayed scaling.

A 2-layer pre-LN transformer (d=256, 4 heads of d_h=64) is trained from scratch on a copy task
with its attention logits cast to FP8 E4M3 under each scaling policy; W^Q is multiplied by 4, the
learning rate spikes, and another run's checkpoint is loaded during training. See
``experiments/fp8_attention.py`` (the pretrained MiniLM's scales: ``configs/fp8_minilm.py``).

Command::

    python -m experiments.train --config=configs/fp8_attention.py --workdir=runs/fp8_attention

Runtime: about 15 minutes on a 2-core CPU shared with other jobs (7 policies x 1200 steps, a
600-step donor run); ``:smoke`` about 1-3 minutes under load (every step goes through
``common.fit`` with a per-step metrics record). Measured results, with the commands that produced
them: ``docs/papers/p14_fp8.md``; each trend check's outcome: ``docs/papers/status.toml`` (P14),
rendered into that page's verdict. Why the bound is exceeded (the
tokens' directions align with ``W^Q W^{K⊤}``, not their norms or a bias): ``docs/notes/p14_fp8.md`` and
``python docs/notes/scripts/fp8_isotropy_probe.py``. The online correction (no hand-set
calibration): ``"--config.policies=('rank_aware:auto+online',)"`` (knobs ``policy.online_*``).

``arg``: ``"smoke"`` (tiny model, 120 steps).
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "fp8_attention"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.name = "copy"  # [a_1..a_k, a_1..a_k], loss on the second half
    c.data.vocab_size = 32
    c.data.seq_len = 33 if arg.smoke else 65  # n = seq_len - 1 positions
    c.data.batch_size = 8

    c.model = ml_collections.ConfigDict()
    c.model.num_layers = 2
    c.model.d_model = 64 if arg.smoke else 256
    c.model.num_heads = 2 if arg.smoke else 4
    c.model.mlp_dim = 128 if arg.smoke else 512
    c.model.fmt = "e4m3"

    # Scaling policies compared (see experiments/fp8_attention.parse_policy).
    c.policies = (
        ("delayed:16", "current", "rank_aware:auto")
        if arg.smoke
        else (
            "delayed:16",
            "delayed:1024",
            "current",
            "rank_aware:1",
            "rank_aware:2",
            "rank_aware:auto",
            "rank_agnostic",
        )
    )
    c.policy = ml_collections.ConfigDict()
    c.policy.delta = 1e-6  # failure probability of the bound
    c.policy.calibration = 1.0  # calibration factor c of the geometry-aware scale
    c.policy.margin = 0.0  # delayed scaling margin (scale / 2^margin)
    c.policy.burn_in_iters = 30  # power steps at init and after a checkpoint load (then 1/step)
    # "+online" policies: κ = clip(margin · max of the last `online_history` ratios max|S|/bound,
    # online_floor, 1/α) multiplies the bound (fp8.online_calibration(geometry_scaling_policy(rule)))
    c.policy.online_history = 16
    c.policy.online_margin = 1.25
    c.policy.online_floor = 1.0

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.learning_rate = 3e-3 if arg.smoke else 1e-3
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 120 if arg.smoke else 1200
    c.schedule.warmup_steps = 10 if arg.smoke else 50

    c.transients = ml_collections.ConfigDict()
    c.transients.q_spike_step = 40 if arg.smoke else 400
    c.transients.q_spike_factor = 4.0
    c.transients.lr_spike_step = 65 if arg.smoke else 700
    c.transients.lr_spike_steps = 10
    c.transients.lr_spike_factor = 10.0
    c.transients.load_step = 90 if arg.smoke else 900
    c.transients.donor_steps = 60 if arg.smoke else 600  # the other run, trained from seed + 1
    c.transients.reset_history_on_load = True

    c.eval = ml_collections.ConfigDict()
    c.eval.window = 20 if arg.smoke else 100  # steps after a transient / before the first one
    c.eval.final_loss_steps = 10 if arg.smoke else 50

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.every = (
        100  # fit checkpoints of each run in <workdir>/policies/<policy>, <workdir>/donor
    )

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    c.log.tensorboard = True
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
