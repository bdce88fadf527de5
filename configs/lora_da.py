r"""LoRA-DA vs LoRA initialisers on a shifted digits domain (P6, specs §6).

An MLP 64-128-128-10 pre-trained on sklearn digits is adapted to 90°-rotated digits with 20% of
the pixels replaced by noise, from 300 training examples; LoRA (``alpha = 16``, rsLoRA, as the
authors' recipe) on the two hidden kernels at ranks 1, 2, 4, 8; Adam 1e-3, batch 32, 300 steps;
head frozen. Initialisations: vanilla (Kaiming ``A``, zero ``B``), PiSSA, LoRA-GA, LoRA-One, EVA,
LoRA-DA with β ∈ {0, 0.01, 0.03, 0.1} (statistics from 256 examples), LoRA-DA with β ∈ {0,
0.03} from only 32 examples, LoRA-DA / LoRA-One with γ = 16 instead of the recipe's 1024 (a
larger initial step), and LoRA-DA with γ = 16 and damping δ = 0.1 instead of 1e-6. 10 seeds (each draws its own 300 training examples); the measured table used
``--config.eval.num_seeds=5`` for time.

Command::

    python -m experiments.train --config=configs/lora_da.py --workdir=runs/lora_da

Runtime: ~25 min wall with ``--config.eval.num_seeds=5`` on a 2-core CPU at load average ~10
(twice that for the default 10 seeds; ``:smoke`` < 1 min). Measured results, with the commands that
produced them: ``docs/papers/p06_lora_da.md``; each trend check's outcome:
``docs/papers/status.toml`` (P6), rendered into that page's verdict.
"""

import ml_collections

from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "lora_da"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.num_train = 300
    c.data.noise = 0.2
    c.data.batch_size = 32

    c.model = ml_collections.ConfigDict()
    c.model.features = (128, 128)
    c.model.pretrain_steps = 300 if arg.smoke else 1500

    c.adapter = ml_collections.ConfigDict()
    c.adapter.targets = r"params/dense_[01]/kernel"
    c.adapter.ranks = (2,) if arg.smoke else (1, 2, 4, 8)
    c.adapter.alpha = 16.0
    c.adapter.rslora = True
    c.adapter.betas = (0.0, 0.03) if arg.smoke else (0.0, 0.01, 0.03, 0.1)
    c.adapter.default_beta = 0.03
    c.adapter.extra_gammas = () if arg.smoke else (16.0,)  # besides the recipe's γ = 1024
    c.adapter.extra_dampings = () if arg.smoke else (0.1,)  # with the first extra γ
    c.adapter.small_sample = 32
    c.adapter.small_sample_betas = () if arg.smoke else (0.0, 0.03)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-3

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 50 if arg.smoke else 300

    c.eval = ml_collections.ConfigDict()
    c.eval.num_seeds = 1 if arg.smoke else 10
    c.eval.loss_steps = (10, 50) if arg.smoke else (10, 50, 300)

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back, not recomputed
    c.log = ml_collections.ConfigDict()
    c.log.progress = False
    c.parallel = ml_collections.ConfigDict()
    c.parallel.distributed = False
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
