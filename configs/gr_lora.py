r"""GR-LoRA (P2, reconstruction) against pure projection and LoRA baselines, in one command.

Runs ``experiments/continual.py`` on a class-incremental stream (no task id at test time):
GR-LoRA (projected shared adapter + recycled task modules selected by entropy, with synthetic-OOD
mismatch suppression), GPM-projected LoRA (the same without recycling), InfLoRA, O-LoRA,
SD-LoRA, sequential LoRA and joint training.

Commands::

    python -m experiments.train --config=configs/gr_lora.py              # the default table
    python -m experiments.train --config=configs/gr_lora.py:smoke        # ~1.5 min check
    python -m experiments.train --config=configs/gr_lora.py:benchmark=digits_cil
    # ablation: entropy selection without mismatch suppression
    python -m experiments.train --config=configs/gr_lora.py:method=gr_lora \
        --config.method.gr_lora.lambda_local=0 --config.method.gr_lora.lambda_global=0

Options as in ``configs/saber.py`` (``method=all`` here: GR-LoRA, GPM-LoRA, InfLoRA, O-LoRA,
SD-LoRA, sequential LoRA, joint; benchmarks also ``shakespeare_plays`` and ``split_mnist``).

Default: ``long_stream`` (specs §2 (4)): 20 tasks × 5 Gaussian classes with means in a shared
32-d subspace of R^64; frozen random-feature MLP 64→256→256; LoRA rank 4; 200 Adam steps/task;
the aligned head (SLCA re-alignment after each task), which won on validation for every
continual method.

Runtime: about 20–25 minutes on a 2-core CPU (an estimate from the six continual methods at 3–4 min
each and joint at about 1 min, each measured at seed 0; the whole default was not timed). Measured
results, with the commands that produced them: ``docs/papers/p02_gr_lora.md``; each trend check's
outcome: ``docs/papers/status.toml`` (P2), rendered into that page's verdict. Details:
``docs/notes/p01_p02_continual.md``.
"""

from configs.continual_base import build

COMPARISON = ("gr_lora", "gpm_lora", "inflora", "o_lora", "sd_lora", "seq_lora", "joint")


def get_config(arg=None):
    """``arg``: ``smoke``, ``method=...``, ``benchmark=...``, ``seeds=N``, comma-separated."""
    return build(arg, comparison=COMPARISON, benchmark="long_stream")
