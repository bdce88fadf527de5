r"""SABER (P1, reconstruction) against LoRA continual-learning baselines, in one command.

Runs ``experiments/continual.py``: a stream of tasks learned one after another with a LoRA branch
per task on a frozen MLP backbone, consolidated by each method; prints and writes the table of
final accuracy, average incremental accuracy, forgetting, backward transfer and plasticity.

Commands::

    python -m experiments.train --config=configs/saber.py               # the default table
    python -m experiments.train --config=configs/saber.py:smoke         # < 1 min check
    python -m experiments.train --config=configs/saber.py:method=o_lora # one method
    python -m experiments.train --config=configs/saber.py:benchmark=long_stream,seeds=3

Options (``:a,b=c``): ``smoke``; ``method=all|saber|gr_lora|seq_lora|o_lora|inflora|gpm_lora|
sd_lora|joint`` (``all``: SABER, sequential LoRA, O-LoRA, InfLoRA, SD-LoRA and joint training);
``benchmark=split_digits|digits_cil|long_stream``; ``seeds=<count>``.

Default: ``split_digits`` (specs §1 (4)): an MLP 64→128→128 pretrained on digits 0–4, then five
conflicting 10-class digit tasks (plain, pixel-permuted, label-permuted), task-incremental,
LoRA rank 4 on both hidden kernels, 300 Adam steps per task, one seed.

Runtime: about 2 minutes on a 2-core CPU (73 s of CPU time; ``:smoke`` about 45 s). Expected
result (seed 0): final accuracy SABER 0.927, InfLoRA 0.924, O-LoRA 0.863, SD-LoRA 0.823,
sequential LoRA 0.799, joint 0.940; forgetting SABER 0.013 vs sequential 0.193. Three seeds and
all benchmarks: ``experiments/continual_sweep.sh`` and ``.notes/continual.md``. The
shakespeare_plays and split_mnist benchmarks of the issue are not implemented yet (see the notes).
"""

from configs.continual_base import build

COMPARISON = ("saber", "seq_lora", "o_lora", "inflora", "sd_lora", "joint")


def get_config(arg=None):
    """``arg``: ``smoke``, ``method=...``, ``benchmark=...``, ``seeds=N``, comma-separated."""
    return build(arg, comparison=COMPARISON, benchmark="shakespeare_plays")
