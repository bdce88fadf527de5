"""lowrank_jax.continual: SABER, GR-LoRA and LoRA continual-learning baselines as methods; metrics.

A method is a :class:`ContinualMethod` (a ``NamedTuple`` of pure functions: ``init``,
``begin_task``, ``apply``, ``loss``, ``end_task``, ``predict``) over an explicit
:class:`ContinualState` pytree, returned by a factory with keyword hyper-parameters:
:func:`saber` (P1), :func:`gr_lora` (P2), :func:`sequential_lora`, :func:`joint`, :func:`o_lora`,
:func:`inflora`, :func:`gpm_lora`, :func:`sd_lora` (see :mod:`lowrank_jax.continual.protocol` for
a loop). SABER and GR-LoRA are reconstructions from their abstracts (``papers/specs.md`` §1, §2);
their optax halves live in :mod:`lowrank_jax.optim` (``scale_by_orthogonal_projection``,
``scale_by_gradient_recycling``), the per-matrix maths in the submodules below. Class-incremental
heads for every method alike (:func:`with_head`: SLCA classifier alignment, prototype/LDA heads
from stored class statistics) live in :mod:`lowrank_jax.continual.heads`; benchmark task streams
(:class:`TaskStream`) in :mod:`lowrank_jax.continual.streams` and
:mod:`lowrank_jax.continual.benchmarks`, a method's training step
(:func:`make_train_step`) in :mod:`lowrank_jax.continual.training`.
"""

from lowrank_jax.continual.baselines import (
    inflora_down_projection,
    o_lora_penalty,
    sd_lora_kernel,
    unit_direction,
)
from lowrank_jax.continual.benchmarks import digits_cil, mnist_cil, split_digits, split_mnist
from lowrank_jax.continual.capture import layer_inputs
from lowrank_jax.continual.evaluation import evaluate_stream, evaluate_tasks
from lowrank_jax.continual.gr_lora import (
    GRLoRAState,
    gr_lora,
    gr_lora_adapters,
    masked_entropy,
    mismatch_loss,
    module_adapters,
    select_module,
    synthesize_global,
    synthesize_local,
)
from lowrank_jax.continual.heads import (
    HEADS,
    HeadState,
    align_head,
    compensate_drift,
    head_inputs,
    prototype_head,
    refit_head,
    with_head,
)
from lowrank_jax.continual.methods import (
    OLoRAState,
    SDLoRAState,
    gpm_lora,
    inflora,
    joint,
    o_lora,
    sd_lora,
    sequential_lora,
)
from lowrank_jax.continual.metrics import (
    average_incremental_accuracy,
    backward_transfer,
    final_average_accuracy,
    forgetting,
    plasticity,
    summarize,
)
from lowrank_jax.continual.protocol import (
    ContinualMethod,
    ContinualState,
    Task,
    get_path,
    kernel_paths,
    masked_cross_entropy,
    set_path,
)
from lowrank_jax.continual.saber import (
    SaberState,
    alignment_penalty,
    balance_by_input_energy,
    balance_weights,
    decompose_update,
    recompose,
    saber,
)
from lowrank_jax.continual.statistics import (
    ClassStatistics,
    class_statistics,
    covariance_factors,
    sample_class_features,
)
from lowrank_jax.continual.streams import (
    TaskStream,
    class_incremental_stream,
    long_stream,
    training_arrays,
)
from lowrank_jax.continual.training import make_train_step

__all__ = [
    "HEADS",
    "ClassStatistics",
    "ContinualMethod",
    "ContinualState",
    "GRLoRAState",
    "OLoRAState",
    "SDLoRAState",
    "SaberState",
    "Task",
    "TaskStream",
    "alignment_penalty",
    "average_incremental_accuracy",
    "backward_transfer",
    "balance_by_input_energy",
    "balance_weights",
    "class_incremental_stream",
    "class_statistics",
    "decompose_update",
    "digits_cil",
    "evaluate_stream",
    "evaluate_tasks",
    "final_average_accuracy",
    "forgetting",
    "get_path",
    "gpm_lora",
    "gr_lora",
    "gr_lora_adapters",
    "inflora",
    "inflora_down_projection",
    "joint",
    "kernel_paths",
    "layer_inputs",
    "long_stream",
    "make_train_step",
    "masked_cross_entropy",
    "masked_entropy",
    "mismatch_loss",
    "mnist_cil",
    "module_adapters",
    "o_lora",
    "o_lora_penalty",
    "plasticity",
    "recompose",
    "refit_head",
    "saber",
    "sd_lora",
    "sd_lora_kernel",
    "select_module",
    "sequential_lora",
    "set_path",
    "split_digits",
    "split_mnist",
    "summarize",
    "synthesize_global",
    "synthesize_local",
    "training_arrays",
    "unit_direction",
    "compensate_drift",
    "sample_class_features",
    "covariance_factors",
    "with_head",
    "prototype_head",
    "head_inputs",
    "align_head",
    "HeadState",
]
