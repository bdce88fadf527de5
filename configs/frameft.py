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

Runtime: 9 min wall for the first 189 cells (4-value lr grid) plus ~4 min for the fifth grid
value, on a 2-core CPU at load average ~10 (``:smoke`` < 1 min). Measured results, with the commands
that produced them: ``docs/papers/p10_frameft.md``; each trend check's outcome:
``docs/papers/status.toml`` (P10), rendered into that page's verdict. Longer tables:
``docs/notes/p06_p08_p10_peft_kinds.md``.
"""

import ml_collections

from configs import lora_finetune
from configs.common import hardware_section, parse_arg


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"minilm"`` (FrameFT on MiniLM), comma-separated.

    ``minilm`` is ``configs/lora_finetune.py:kind=frameft`` (``experiments/lora_finetune.py``
    with FrameFT adapters): 921 coefficients per kernel on the 36 attention/MLP kernels of the
    pretrained MiniLM (33,156 = 10% of LoRA r=8's 331,776) plus the head, coefficients at lr 5e-2,
    head at LoRA's 1e-3, 240 AdamW steps. Command:
    ``python -m experiments.train --config=configs/frameft.py:minilm``; 25 min wall on a 2-core
    CPU at load ~9 (4.6 s/step). Measured (before issue 11 moved the run into lora_finetune; the
    smoke run is reproduced exactly): test accuracy 0.623 (valid 0.661) vs LoRA r=8's 0.670 and
    the linear probe's 0.618.
    """
    arg = parse_arg(arg, smoke=False, minilm=False)
    if arg.minilm:
        return lora_finetune.get_config("kind=frameft" + (",smoke" if arg.smoke else ""))
    c = ml_collections.ConfigDict()
    c.experiment = "frameft"
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
    c.ckpt.resume = True  # finished cells in <workdir>/cells are read back, not recomputed
    c.log = ml_collections.ConfigDict()
    c.log.progress = False
    c.parallel = ml_collections.ConfigDict()
    c.parallel.distributed = False
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    return c
