"""lowrank_jax.continual: SABER, GR-LoRA, LoRA continual-learning baselines and CL metrics.

SABER (P1) and GR-LoRA (P2) are reconstructions from their abstracts (``papers/specs.md`` §1, §2);
the optax halves live in :mod:`lowrank_jax.optim` (``scale_by_orthogonal_projection``,
``scale_by_gradient_recycling``); the training orchestration is ``experiments/continual.py``.
"""

from lowrank_jax.continual.baselines import (
    inflora_down_projection,
    o_lora_penalty,
    sd_lora_kernel,
    unit_direction,
)
from lowrank_jax.continual.capture import layer_inputs
from lowrank_jax.continual.gr_lora import (
    ClassStatistics,
    class_statistics,
    masked_entropy,
    mismatch_loss,
    select_module,
    synthesize_global,
    synthesize_local,
)
from lowrank_jax.continual.metrics import (
    average_incremental_accuracy,
    backward_transfer,
    final_average_accuracy,
    forgetting,
    plasticity,
    summarize,
)
from lowrank_jax.continual.saber import (
    alignment_penalty,
    balance_by_input_energy,
    balance_weights,
    decompose_update,
    recompose,
)
from lowrank_jax.continual.streams import long_stream

__all__ = [
    "ClassStatistics",
    "alignment_penalty",
    "average_incremental_accuracy",
    "balance_by_input_energy",
    "backward_transfer",
    "balance_weights",
    "class_statistics",
    "decompose_update",
    "final_average_accuracy",
    "forgetting",
    "inflora_down_projection",
    "layer_inputs",
    "long_stream",
    "masked_entropy",
    "mismatch_loss",
    "o_lora_penalty",
    "plasticity",
    "recompose",
    "sd_lora_kernel",
    "select_module",
    "summarize",
    "synthesize_global",
    "synthesize_local",
    "unit_direction",
]
