r"""FrameFT vs FourierFT, VeRA, LoRA and full fine-tuning at matched budgets (P10, specs §10).

An MLP 64-256-256-10 pre-trained on sklearn digits (source) is adapted to 90°-rotated digits from
300 examples (20 epochs, batch 32, Adam). The two hidden kernels (64x256, 256x256) are adapted,
the head stays frozen. Budgets of 64, 256 and 1024 trainable coefficients per layer for FrameFT
(frame bases ``L = 2`` and ``L = 8``, and the random-orthogonal and identity ablations) and
FourierFT; VeRA with ``r`` = budget (``r + m`` parameters); LoRA at ranks 1 and 4; full FT. Each
method's learning rate is chosen on a validation split (seed 0) from the ``optim.lr_grid_*``, then
5 seeds run on the test split.

Command::

    python -m experiments.train --config=configs/frameft.py --workdir=runs/frameft

Runtime: about 6 min on a 2-core CPU (``:smoke`` < 1 min). Expected result (specs §10 (4)):
FrameFT ``L = 2`` within ~1 point of FourierFT at each budget, frame ≥ identity basis, ``L = 8``
within ~2 points of ``L = 2`` at about a quarter of the ΔW-formation FLOPs, FrameFT at 64/layer
above LoRA r=1 (320-512/layer); measured numbers in ``.notes/peft_kinds.md``.
"""

import ml_collections

from experiments.common.config_args import parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "peft_kinds"
    c.study = "frameft"
    c.study_config = "frameft.py" + (":smoke" if arg.smoke else "")
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.num_train = 300
    c.data.num_valid = 200
    c.data.noise = 0.0
    c.data.batch_size = 32

    c.model = ml_collections.ConfigDict()
    c.model.features = (256, 256)
    c.model.pretrain_steps = 300 if arg.smoke else 1500

    c.adapter = ml_collections.ConfigDict()
    c.adapter.targets = r"params/dense_[01]/kernel"
    c.adapter.budgets = (64,) if arg.smoke else (64, 256, 1024)
    c.adapter.lora_ranks = (1,) if arg.smoke else (1, 4)
    c.adapter.frame_scale = 50.0
    c.adapter.fourier_scale = 150.0

    c.optim = ml_collections.ConfigDict()
    # Learning-rate grids, picked per method on the validation split (seed 0).
    c.optim.lr_grid_coeff = (1e-1,) if arg.smoke else (1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # FrameFT, ...
    c.optim.lr_grid_lora = (1e-2,) if arg.smoke else (1e-3, 3e-3, 1e-2, 3e-2)
    c.optim.lr_grid_full = (1e-3,) if arg.smoke else (1e-4, 3e-4, 1e-3, 3e-3)

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 40 if arg.smoke else 190  # 20 epochs of 300 examples, batch 32

    c.eval = ml_collections.ConfigDict()
    c.eval.num_seeds = 1 if arg.smoke else 5

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.note = "sweeps resume per cell from results.json"
    c.log = ml_collections.ConfigDict()
    c.log.progress = False
    c.parallel = ml_collections.ConfigDict()
    c.parallel.distributed = False
    return c
