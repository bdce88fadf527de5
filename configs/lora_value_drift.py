r"""P3 part (c): a real LoRA on MiniLM's value projections, per head ‖ΔV_h‖/gap_h vs embedding drift.

Stage 1 (``config.finetune``, run by ``experiments/lora_finetune.py`` unchanged, through
``experiments.common.fit``): LoRA rank 8 (alpha 16) on the 6 value kernels of all-MiniLM-L6-v2
only, plus the genre head, on Shakespeare genre classification (comedy / history / tragedy)
of the 29 plays not held out; 120 AdamW steps, batch 16.

Stage 2: per layer and head ``h``, the OV-circuit update ``ΔV_h = (ΔW_v[:, s_h] W_o[s_h, :])ᵀ``
of the trained adapter, its spectral norm against the head's eigengap ``gap_h`` (symmetric part
of ``V_h``, as part (b)), and the embedding drift of 6 held-out plays (two per genre, never
trained on; 32 passages of 256 characters each, 64 tokens): mean ``‖p_adapted - p_base‖ /
‖p_base‖`` of the mean-pooled last hidden states and ``1 - cos``, for the whole adapter and for
each head's ``ΔV_h`` alone. Spearman / Pearson across the 72 heads of drift vs ``‖ΔV_h‖/gap_h``
and vs ``‖ΔV_h‖`` (the null); a scale sweep ``s·ΔV`` of the whole adapter and, for the
``sweep.heads_per_layer`` heads of each layer with the largest ratio, ``s·ΔV_h`` with
``s / s_c ∈ {1/8, ..., 8}`` around ``s_c = s*_h = gap_h / ‖ΔV_h‖₂`` (Weyl) and around
``s_c = s_flip``, where the top eigenvector of ``V_h + sΔV_h`` has turned by 45°: §3 predicts
a jump of the drift there (``D(2s_c)/D(s_c/2) ≫ 4``, the linear-response value).

Command::

    python -m experiments.train --config=configs/lora_value_drift.py --workdir=runs/lora_value_drift

Runtime on the 2-core CPU shared with other jobs (load average 8-15): about 40 min (LoRA 120
steps 5.4 min at 2.35 s/step, per-head drifts 12.6 min, joint sweep 1 min, 18 Weyl-centred and
18 s_flip-centred head sweeps 8 + 12 min; measured in two passes, see ``docs/notes/p03_value_drift.md``);
a rerun reads the LoRA checkpoint and the finished cells back. ``:smoke`` (2 steps, layer 5's
value kernel only, 8 held-out passages of 8 tokens, one swept head): 30-50 s of CPU under load.
Expected result (specs §3): drift grows with ``‖ΔV_h‖/gap_h`` more tightly than with
``‖ΔV_h‖``, and jumps where ``s‖ΔV_h‖`` crosses ``gap_h``. Measured results, with the
commands that produced them: ``docs/papers/p03_mean_field_attention.md``; each trend check's
outcome: ``docs/papers/status.toml`` (P3), rendered into that page's verdict.

``arg``: ``"smoke"``.
"""

import ml_collections

from configs import lora_finetune
from configs.common import parse_arg
from lowrank_jax.data.shakespeare import PLAYS

# Held out of the LoRA training: two plays per genre (Folio catalogue keys).
HELDOUT_PLAYS = (
    "tempest",
    "twelfth_night",
    "richard_ii",
    "henry_v",
    "hamlet",
    "macbeth",
)


def get_config(arg=None):
    """``arg``: ``"smoke"``."""
    arg = parse_arg(arg, smoke=False)
    c = ml_collections.ConfigDict()
    c.experiment = "lora_value_drift"
    c.seed = 0

    # Stage 1: the LoRA fine-tuning run (any config of experiments/lora_finetune.py).
    f = lora_finetune.get_config("smoke" if arg.smoke else None)
    # Value kernels only (smoke: the last layer's only).
    f.adapter.targets = (
        (r".*/layer_5/attention/value/kernel",) if arg.smoke else (r".*/attention/value/kernel",)
    )
    heldout = HELDOUT_PLAYS[::3] if arg.smoke else HELDOUT_PLAYS
    f.data.plays = tuple(p for p in PLAYS if p not in heldout)
    if arg.smoke:
        f.data.plays = f.data.plays[::6]
        f.data.max_passages_per_play = 6
        f.data.max_len = 8
        f.schedule.num_steps = 2
        f.schedule.warmup_steps = 1
        f.ckpt.every = 2
        f.log.every = 2
        f.log.progress = False
    else:
        f.data.max_passages_per_play = 40
        f.schedule.num_steps = 120
        f.schedule.warmup_steps = 12
        f.eval.every = 60
    c.finetune = f

    # Stage 2: held-out plays and the analysis.
    c.heldout = ml_collections.ConfigDict()
    c.heldout.plays = heldout
    c.heldout.passage_chars = 256
    c.heldout.passages_per_play = 4 if arg.smoke else 32
    c.heldout.max_len = 8 if arg.smoke else 64
    c.heldout.batch_size = 64

    c.sweep = ml_collections.ConfigDict()
    c.sweep.ratios = (0.25, 1.0, 4.0) if arg.smoke else (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    c.sweep.heads_per_layer = 1 if arg.smoke else 3
    # s_flip is searched on s* * 2^(k/4), k = 0 .. 4 * flip_octaves.
    c.sweep.flip_octaves = 6 if arg.smoke else 10
    c.sweep.layers = (5,) if arg.smoke else (0, 1, 2, 3, 4, 5)
    c.sweep.joint_scales = (
        (0.5, 1.0, 2.0) if arg.smoke else (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
    )

    c.log = ml_collections.ConfigDict()
    c.log.progress = not arg.smoke
    return c
