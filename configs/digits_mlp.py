r"""An MLP trained on sklearn's digits: the fast config that tests the training machinery.

Runs ``experiments/lora_finetune.py`` with ``adapter.method="full"`` (every parameter trained from
scratch); ``:method=head`` trains the output layer only and ``:method=lora`` puts LoRA on the
hidden layers (of a random network: a check of the plumbing, not a result).

Command::

    python -m experiments.train --config=configs/digits_mlp.py --workdir=runs/digits_mlp

Runtime: about 20 s on a 2-core CPU, mostly start-up and compilation (``:smoke``: 40 steps, the
same). Expected result: test accuracy 0.955 (``method=full``; ``:smoke`` 0.80).
"""

import ml_collections

from configs.common import hardware_section, parse_arg, profile_section, train_section


def get_config(arg=None):
    """``arg``: ``"smoke"``, ``"method=full|head|lora"``, comma-separated."""
    arg = parse_arg(arg, smoke=False, method="full")
    c = ml_collections.ConfigDict()
    c.experiment = "lora_finetune"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.name = "digits"
    c.data.batch_size = 64
    c.data.valid_fraction = 0.1
    c.data.test_fraction = 0.2

    c.model = ml_collections.ConfigDict()
    c.model.name = "mlp"
    c.model.features = (64, 64)

    c.adapter = ml_collections.ConfigDict()
    c.adapter.method = arg.method
    c.adapter.kind = "lora"
    c.adapter.rank = 4
    c.adapter.alpha = 8.0
    c.adapter.dropout = 0.0
    c.adapter.targets = (r"params/dense_\d+/kernel",)

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"
    c.optim.learning_rate = 3e-3
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0

    c.schedule = ml_collections.ConfigDict()
    c.schedule.num_steps = 40 if arg.smoke else 400
    c.schedule.warmup_steps = 5 if arg.smoke else 20

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 10 if arg.smoke else 100
    c.eval.batch_size = 128

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.every = 10 if arg.smoke else 100
    c.ckpt.max_to_keep = 2

    c.log = ml_collections.ConfigDict()
    c.log.every = 5 if arg.smoke else 25
    c.log.progress = True

    c.parallel = ml_collections.ConfigDict()
    c.parallel.fsdp = False
    c.parallel.distributed = False
    c.train = train_section()  # options of the shared loop: skip_nonfinite
    c.hardware = hardware_section()  # peak_tflops: what cost/utilisation is against
    c.profile = profile_section()  # start_step, num_steps: a trace by flag
    return c
