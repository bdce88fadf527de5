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
gpm_lora|sd_lora|joint`` (``all``: SABER, sequential LoRA, O-LoRA, InfLoRA, SD-LoRA and joint
training; ``every``: all eight); ``benchmark=shakespeare_plays|split_mnist|split_digits|
digits_cil|long_stream|mnist_cil``; ``seeds=<count>``; ``search=<trials>``: choose every method's
learning rate and knobs by that many random-search trials on a validation split carved from the
training tasks (``experiments/continual_search.py``; default 0: the configured values);
``head=masked|aligned|prototype`` (default: the benchmark's, ``aligned`` on digits_cil where it won
on validation, ``masked`` elsewhere); ``compare_heads``: the head becomes a dimension of that
validation search (with ``search=0``: the three heads at the configured values).

Default: ``shakespeare_plays``: class-incremental over ten Shakespeare plays (two per task, five
tasks, no task id at test time), 200 training / 60 test passages of 64 MiniLM word pieces per
play. The real pretrained all-MiniLM-L6-v2 is frozen; layers 0–3 run once (cached hidden
states), LoRA rank 4 on query, value and fc1 of layers 4–5, a linear head on the mean-pooled
output; 80 Adam steps of 16 passages per task (lr 1e-3).

Runtime: about 8 minutes on a 2-core CPU (8 min 22 s wall, 12 min CPU measured; ``:smoke`` about
1 min). Expected result (seed 0): final accuracy SABER 0.403, sequential LoRA 0.443, SD-LoRA
0.445, O-LoRA 0.437, InfLoRA 0.405, joint 0.650; forgetting SABER 0.077 vs sequential 0.200.
SABER forgets least of the six but learns each new play less well, and its final accuracy is
below sequential LoRA here (the specs' trend does not reproduce on this benchmark; it does on
``split_digits``). Three seeds of every benchmark: the README and ``.notes/continual.md``.
"""

from configs.continual_base import build

COMPARISON = ("saber", "seq_lora", "o_lora", "inflora", "sd_lora", "joint")


def get_config(arg=None):
    """``arg``: ``smoke``, ``method=...``, ``benchmark=...``, ``seeds=N``, comma-separated."""
    return build(arg, comparison=COMPARISON, benchmark="shakespeare_plays")
