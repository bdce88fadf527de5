r"""SABER (P1, reconstruction) against LoRA continual-learning baselines, in one command.

Runs ``experiments/continual.py``: a stream of tasks learned one after another with a LoRA branch
per task on a frozen backbone, consolidated by each method; prints and writes the table of final
accuracy, average incremental accuracy, forgetting, backward transfer and plasticity.

Commands::

    python -m experiments.train --config=configs/saber.py                # the default table
    python -m experiments.train --config=configs/saber.py:smoke          # ~1 min check
    python -m experiments.train --config=configs/saber.py:method=o_lora  # one method
    python -m experiments.train --config=configs/saber.py:benchmark=split_mnist,seeds=3
    experiments/continual_sweep.sh                                       # the full table

Options (``:a,b=c``): ``smoke``; ``method=all|every|saber|gr_lora|seq_lora|o_lora|inflora|
gpm_lora|sd_lora|joint`` (``all``: SABER, sequential LoRA, O-LoRA, InfLoRA, SD-LoRA and joint
training; ``every``: all eight); ``benchmark=shakespeare_plays|split_mnist|split_digits|
digits_cil|long_stream``; ``seeds=<count>``.

Default: ``shakespeare_plays``: class-incremental over ten Shakespeare plays (two per task, five
tasks, no task id at test time), 200 training / 60 test passages of 64 MiniLM word pieces per
play. The real pretrained all-MiniLM-L6-v2 is frozen; layers 0–3 run once (cached hidden
states), LoRA rank 4 on query, value and fc1 of layers 4–5, a linear head on the mean-pooled
output; 80 Adam steps of 16 passages per task (lr 1e-3).

Runtime: about 8 minutes on a 2-core CPU (7 min 54 s wall, 11 min CPU measured; ``:smoke`` about
1 min). Expected result (seed 0): final accuracy SABER 0.412, sequential LoRA 0.435, SD-LoRA
0.435, O-LoRA 0.405, InfLoRA 0.378, joint 0.665; forgetting SABER 0.079 vs sequential 0.196.
Three seeds of every benchmark and the trend checks: the README and ``.notes/continual.md``.
``split_digits`` is the specs §1 (4) experiment (SABER's trend reproduces there).
"""

from configs.continual_base import build

COMPARISON = ("saber", "seq_lora", "o_lora", "inflora", "sd_lora", "joint")


def get_config(arg=None):
    """``arg``: ``smoke``, ``method=...``, ``benchmark=...``, ``seeds=N``, comma-separated."""
    return build(arg, comparison=COMPARISON, benchmark="shakespeare_plays")
