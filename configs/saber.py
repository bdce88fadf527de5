r"""SABER (P1, reconstruction) against LoRA continual-learning baselines, in one command.

Runs ``experiments/continual.py``: a stream of tasks learned one after another with a LoRA branch
per task on a frozen backbone, consolidated by each method; prints and writes the table of final
accuracy, average incremental accuracy, forgetting, backward transfer and plasticity.

Commands::

    python -m experiments.train --config=configs/saber.py                # the default table
    python -m experiments.train --config=configs/saber.py:smoke          # ~1 min check
    python -m experiments.train --config=configs/saber.py:method=o_lora  # one method
    python -m experiments.train --config=configs/saber.py:benchmark=split_mnist,seeds=3
    python -m experiments.train --config=configs/saber.py:benchmark=split_digits,method=every,search=6
    experiments/continual_sweep.sh                                       # the full table

Options (``:a,b=c``): ``smoke``; ``method=all|every|saber|gr_lora|seq_lora|o_lora|inflora|
gpm_lora|sd_lora|joint`` (``all``: SABER, sequential LoRA, InfLoRA and joint training; ``every``:
all eight); ``benchmark=shakespeare_plays|split_mnist|split_digits|digits_cil|long_stream|
mnist_cil``, or the pre-trained-ViT benchmarks ``cifar100_10|imagenet_r_5|imagenet_r_10|
imagenet_r_20|domainnet_5`` (with ``--config.model.checkpoint=DIR`` of a Hugging Face ViT and
``--config.data.data_dir=TFDS_DIR``; InfLoRA's hyper-parameters, ``configs/continual_base.py``;
their cost and how to run them: ``docs/papers/p01_saber.md``, "Paper scale"); ``seeds=<count>``; ``search=<trials>``: choose every method's learning rate and knobs
by that many random-search trials on a validation split carved from the training tasks
(``experiments/common/continual_search.py``; default 0: the configured values);
``head=masked|aligned|prototype`` (default: the benchmark's: ``aligned``, chosen on validation,
except ``masked`` on the task-incremental split_digits and, as InfLoRA's classifier, on the
pre-trained-ViT benchmarks); ``compare_heads``: the
head becomes a dimension of that validation search (masked and aligned; with ``search=0`` at the
configured values).

Default: ``shakespeare_plays``: class-incremental over ten Shakespeare plays (two per task, five
tasks, no task id at test time), 200 training / 60 test passages of 64 MiniLM word pieces per
play. The real pretrained all-MiniLM-L6-v2 is frozen; layers 0–3 run once (cached hidden
states), LoRA rank 4 on query, value and fc1 of layers 4–5, a linear head on the mean-pooled
output, re-aligned after each task on pseudo-features of every seen play (SLCA); 80 Adam steps of
16 passages per task (lr 1e-3).

Runtime: about 9.5 minutes on a 2-core CPU (9 min 24 s wall, 16 min CPU measured; ``:smoke``
about 1 min). Measured results, with the commands that produced them: ``docs/papers/p01_saber.md``;
each trend check's outcome: ``docs/papers/status.toml`` (P1), rendered into that page's verdict. All
methods × 3 seeds per benchmark: that page and ``docs/notes/p01_p02_continual.md``.
"""

from configs.continual_base import build

# The default run's methods: SABER, the strongest of its three named baselines on this benchmark
# (InfLoRA: O-LoRA and SD-LoRA are below it on validation and test, docs/papers/p01_saber.md), sequential LoRA
# (the |BWT| reference) and joint training; six methods with aligned heads took 17 min on 2
# cores, over the 10-minute budget. method=every runs all eight.
COMPARISON = ("saber", "seq_lora", "inflora", "joint")


def get_config(arg=None):
    """``arg``: ``smoke``, ``method=...``, ``benchmark=...``, ``seeds=N``, comma-separated."""
    return build(arg, comparison=COMPARISON, benchmark="shakespeare_plays")
