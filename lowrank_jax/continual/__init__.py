"""lowrank_jax.continual: SABER, GR-LoRA and LoRA continual-learning baselines as methods; metrics.

A method is a :class:`ContinualMethod` (a ``NamedTuple`` of pure functions: ``init``,
``begin_task``, ``apply``, ``loss``, ``end_task``, ``predict``, ``features``) over an explicit
:class:`ContinualState` pytree, returned by a factory with keyword hyper-parameters:
:func:`saber` (P1), :func:`gr_lora` (P2), :func:`sequential_lora`, :func:`joint`, :func:`o_lora`,
:func:`inflora`, :func:`gpm_lora`, :func:`sd_lora` (see :mod:`lowrank_jax.continual.protocol` for
a loop). SABER and GR-LoRA are reconstructions from their abstracts (``papers/specs.md`` §1, §2);
their optax halves live in :mod:`lowrank_jax.optim` (``scale_by_orthogonal_projection``,
``scale_by_gradient_recycling``), the per-matrix maths in the submodules below. Class-incremental
heads for every method alike (:func:`with_head` with a head value, :class:`AlignedHead` (SLCA
classifier alignment) or :class:`PrototypeHead` (class-mean/LDA), fitted to stored class
statistics of :attr:`ContinualMethod.features`) live in :mod:`lowrank_jax.continual.heads` and
:mod:`lowrank_jax.continual.class_incremental`; benchmark task streams
(:class:`TaskStream`) in :mod:`lowrank_jax.continual.streams` and
:mod:`lowrank_jax.continual.benchmarks`, the pre-trained-ViT image benchmarks read on demand
(:func:`image_cil`, :func:`train_batches`) in :mod:`lowrank_jax.continual.image_benchmarks`, a
method's training step (:func:`make_train_step`) in :mod:`lowrank_jax.continual.training`.
"""

from lowrank_jax.continual.benchmarks import digits_cil, mnist_cil, split_digits, split_mnist
from lowrank_jax.continual.capture import layer_inputs
from lowrank_jax.continual.class_incremental import with_head
from lowrank_jax.continual.evaluation import evaluate_stream
from lowrank_jax.continual.gr_lora import gr_lora, gr_lora_adapters
from lowrank_jax.continual.heads import AlignedHead, PrototypeHead
from lowrank_jax.continual.image_benchmarks import image_cil, train_batches
from lowrank_jax.continual.methods import gpm_lora, inflora, joint, o_lora, sd_lora, sequential_lora
from lowrank_jax.continual.metrics import forgetting, plasticity, summarize
from lowrank_jax.continual.protocol import (
    ContinualMethod,
    ContinualState,
    Task,
    masked_cross_entropy,
)
from lowrank_jax.continual.saber import saber
from lowrank_jax.continual.streams import TaskStream, long_stream
from lowrank_jax.continual.training import make_train_step

__all__ = [
    "AlignedHead",
    "ContinualMethod",
    "ContinualState",
    "PrototypeHead",
    "Task",
    "TaskStream",
    "digits_cil",
    "evaluate_stream",
    "forgetting",
    "gpm_lora",
    "gr_lora",
    "gr_lora_adapters",
    "image_cil",
    "inflora",
    "joint",
    "layer_inputs",
    "long_stream",
    "make_train_step",
    "masked_cross_entropy",
    "mnist_cil",
    "o_lora",
    "plasticity",
    "saber",
    "sd_lora",
    "sequential_lora",
    "split_digits",
    "split_mnist",
    "summarize",
    "train_batches",
    "with_head",
]
