r"""The LoRA continual-learning baselines as :class:`~lowrank_jax.continual.ContinualMethod` values.

Each task trains a fresh LoRA branch (rank ``r``, scale ``alpha / r``) on the kernels matching
``targets`` plus the classifier head; after the task the branch is consolidated:

* :func:`sequential_lora`: merged into the kernels (no protection: the lower bound);
  :func:`joint` is the same method trained once on the union of all tasks (the upper bound);
* :func:`o_lora`: merged; later ``A`` factors are pushed off earlier ones by
  ``λ Σ_i ‖A_iᵀ A_t‖²_F`` (:func:`~lowrank_jax.continual.baselines.o_lora_penalty`);
* :func:`inflora`: ``A_t`` fixed to the new task's input directions off the GPM memory
  (:func:`~lowrank_jax.continual.baselines.inflora_down_projection`), only ``B_t`` trained;
* :func:`gpm_lora`: ``A_t`` trained with
  :func:`lowrank_jax.optim.scale_by_orthogonal_projection` off the GPM memory;
* :func:`sd_lora`: stored as a unit direction ``ΔW_t/‖ΔW_t‖_F`` whose magnitude stays learnable.

The memory methods extend ``state.memory`` after each task from the layer inputs of the first
``memory_examples`` training inputs under the consolidated model (GPM energy ``memory_threshold``).

References:
  Wang et al. 2023 (O-LoRA); Liang & Li 2024 (InfLoRA); Saha et al. 2021 (GPM); Wu et al. 2025
  (SD-LoRA). The baselines of specs.md §1 (5) and §2 (5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.paths import get_path, set_path
from lowrank_jax.continual._src import (
    MethodBase,
    check_threshold,
    common_args,
    method_base,
    no_diagnostics,
    no_penalty,
    per_layer,
    replace_a,
)
from lowrank_jax.continual.baselines import (
    inflora_down_projection,
    o_lora_penalty,
    sd_lora_kernel,
    unit_direction,
)
from lowrank_jax.continual.protocol import (
    ContinualMethod,
    ContinualState,
    Task,
)
from lowrank_jax.optim.orthogonal_projection import (
    extend_memories,
    scale_by_orthogonal_projection,
)
from lowrank_jax.optim.subspace_memory import project_off

__all__ = [
    "OLoRAState",
    "SDLoRAState",
    "gpm_lora",
    "inflora",
    "joint",
    "o_lora",
    "sd_lora",
    "sequential_lora",
]


class OLoRAState(NamedTuple):
    """O-LoRA's record: ``old_a[path]: (T, *L, n, r)``, the ``A`` factors of the tasks so far."""

    old_a: dict[str, jax.Array]


class SDLoRAState(NamedTuple):
    """SD-LoRA's record per kernel: unit directions ``(T, *L, n, m)`` and magnitudes ``(T, *L)``
    (one per layer of a stack ``(*L, n, m)``, as for ``prod(L)`` separate kernels)."""

    directions: dict[str, jax.Array]
    magnitudes: dict[str, jax.Array]


def _merge(state: ContinualState, deltas: dict[str, Any], head: Any) -> ContinualState:
    params = state.params
    for k in state.kernels:
        params = set_path(params, k, get_path(params, k) + deltas[k])
    return state._replace(params=params, head=head, update=deltas)


def _extend_memory(
    base: MethodBase, state: ContinualState, task: Task, *, examples: int, threshold: float
) -> ContinualState:
    inputs = base.layer_inputs(state, task.x[:examples])
    return state._replace(memory=extend_memories(state.memory, inputs, threshold=threshold))


def _sd_kernel(w0: jax.Array, directions: jax.Array, magnitudes: jax.Array) -> jax.Array:
    """:func:`sd_lora_kernel` per layer: ``w0 (*L, n, m)``, ``(T, *L, n, m)``, ``(T, *L)``."""
    return per_layer(sd_lora_kernel, w0, in_axes=(0, 1, 1))(w0, directions, magnitudes)


def _shared_forward(base: MethodBase) -> Callable[..., jax.Array]:
    def apply(trainable: Any, frozen: Any, x: jax.Array) -> jax.Array:
        params = base.full(frozen["params"], trainable["head"])
        return base.adapted(params, {"shared": trainable["shared"]}, x)

    return apply


def _begin_frozen(base: MethodBase, state: ContinualState) -> dict[str, Any]:
    return {"params": base.full(state.params, state.head)}


def sequential_lora(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
) -> ContinualMethod:
    """Sequential LoRA: a fresh LoRA branch per task, merged into the kernels after it.

    Args:
      apply_fn: the model's ``apply(variables, x) -> logits (b, C)`` (a linen ``model.apply``, an
        nnx ``lambda state, x: nnx.merge(graphdef, state)(x)`` or any JAX function).
      targets: full-match regexes of the adapted kernel paths (e.g. ``r"params/dense_\\d+/kernel"``).
      rank: LoRA rank ``r``.
      alpha: LoRA ``alpha`` (scale ``alpha / r``).
      learning_rate: Adam learning rate.
      grad_clip: global-norm clipping before Adam (0: none).
      head_path: path of the classifier head's subtree in the variables.

    Returns:
      A :class:`~lowrank_jax.continual.ContinualMethod`.

    Raises:
      ValueError: a hyper-parameter out of range; (in ``init``) targets that match no kernel.
    """
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def begin_task(state, key, task):
        del task
        trainable = {"shared": base.lora(key, state), "head": state.head}
        return trainable, _begin_frozen(base, state), base.tx()

    def end_task(state, trainable, frozen, task):
        del frozen, task
        trained = jax.device_get(trainable)
        return _merge(state, base.deltas(state, trained["shared"]), trained["head"])

    return ContinualMethod(
        init=lambda variables: base.init(variables, memory=False, extra=lambda w0: ()),
        begin_task=begin_task,
        apply=_shared_forward(base),
        loss=no_penalty,
        end_task=end_task,
        predict=base.plain_predict,
        features=base.plain_features,
        diagnostics=no_diagnostics,
    )


def joint(apply_fn: Callable[..., Any], **kwargs: Any) -> ContinualMethod:
    """Joint training (the upper bound): :func:`sequential_lora`, to be given one task that holds
    every task's data (``Task(0, all classes, all x, all y, C)``). Same keyword arguments."""
    return sequential_lora(apply_fn, **kwargs)


def o_lora(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
    lambda_orth: float = 0.5,
) -> ContinualMethod:
    r"""O-LoRA: sequential LoRA plus ``λ Σ_{i<t} ‖A_iᵀ A_t‖²_F`` (penalty in :attr:`ContinualMethod.loss`).

    Args: as :func:`sequential_lora`, and ``lambda_orth`` ``λ ≥ 0``.

    References: Wang et al. 2023, "Orthogonal Subspace Learning for Language Model Continual
    Learning".
    """
    if not lambda_orth >= 0:
        raise ValueError(f"lambda_orth must be >= 0, got {lambda_orth!r}.")
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def init(variables):
        return base.init(
            variables,
            memory=False,
            extra=lambda w0: OLoRAState(
                {k: jnp.zeros((0, *w.shape[:-1], rank)) for k, w in w0.items()}
            ),
        )

    def begin_task(state, key, task):
        trainable, frozen, tx = sequential.begin_task(state, key, task)
        return trainable, {**frozen, "old_a": state.extra.old_a}, tx

    def loss(trainable, frozen, batch, key):
        del batch, key

        def penalty(a, old):  # summed over the layers of a stack
            return jnp.sum(per_layer(o_lora_penalty, a, in_axes=(0, 1))(a, old))

        return lambda_orth * sum(
            penalty(ad.factors["a"], frozen["old_a"][k]) for k, ad in trainable["shared"].items()
        )

    def end_task(state, trainable, frozen, task):
        new = sequential.end_task(state, trainable, frozen, task)
        trained = jax.device_get(trainable)
        old_a = dict(state.extra.old_a)
        for k, ad in trained["shared"].items():
            old_a[k] = jnp.concatenate([old_a[k], ad.factors["a"][None]])
        return new._replace(extra=OLoRAState(old_a))

    sequential = sequential_lora(apply_fn, head_path=head_path, **common_args(locals()))
    return sequential._replace(init=init, begin_task=begin_task, loss=loss, end_task=end_task)


def inflora(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
    memory_threshold: float = 0.97,
    memory_examples: int = 512,
) -> ContinualMethod:
    r"""InfLoRA: ``A_t`` fixed to new-task input directions off the memory ``M``; ``B_t`` trained.

    ``A_t`` = top-``r`` left singular vectors of ``(I − MMᵀ) Xᵀ`` for the layer inputs ``X`` of
    the first ``memory_examples`` training inputs; after the task ``M`` is extended from the
    same inputs under the merged model (GPM energy ``memory_threshold``).

    Args: as :func:`sequential_lora`, and ``memory_threshold`` ``τ ∈ (0, 1]``,
    ``memory_examples``.

    References: Liang & Li 2024, arXiv 2404.00228 (the paper's DualGPM memory is replaced by GPM).
    """
    check_threshold("memory_threshold", memory_threshold)
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def begin_task(state, key, task):
        template = base.lora(key, state)
        inputs = base.layer_inputs(state, task.x[:memory_examples])
        down = functools.partial(inflora_down_projection, rank=rank)
        mem = base.memories(state)
        a = {k: per_layer(down, w)(inputs[k], mem[k]) for k, w in state.kernels.items()}
        frozen = {**_begin_frozen(base, state), "a": a, "template": template}
        trainable = {"b": {k: ad.factors["b"] for k, ad in template.items()}, "head": state.head}
        return trainable, frozen, base.tx()

    def fixed_a(trainable, frozen):
        return {
            k: ad.replace(factors={"a": frozen["a"][k], "b": trainable["b"][k]})
            for k, ad in frozen["template"].items()
        }

    def apply(trainable, frozen, x):
        params = base.full(frozen["params"], trainable["head"])
        return base.adapted(params, {"shared": fixed_a(trainable, frozen)}, x)

    def end_task(state, trainable, frozen, task):
        trained = jax.device_get(trainable)
        state = _merge(state, base.deltas(state, fixed_a(trained, frozen)), trained["head"])
        return _extend_memory(
            base, state, task, examples=memory_examples, threshold=memory_threshold
        )

    return ContinualMethod(
        init=lambda variables: base.init(variables, memory=True, extra=lambda w0: ()),
        begin_task=begin_task,
        apply=apply,
        loss=no_penalty,
        end_task=end_task,
        predict=base.plain_predict,
        features=base.plain_features,
        diagnostics=no_diagnostics,
    )


def gpm_lora(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
    memory_threshold: float = 0.97,
    memory_examples: int = 512,
) -> ContinualMethod:
    r"""GPM on LoRA: ``A_t`` starts off the memory and its updates are projected off it.

    The projection is :func:`lowrank_jax.optim.scale_by_orthogonal_projection`, chained after
    Adam. Args: as :func:`inflora`.

    References: Saha et al. 2021 (GPM).
    """
    check_threshold("memory_threshold", memory_threshold)
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def begin_task(state, key, task):
        del task
        lora, mem = base.lora(key, state), base.memories(state)
        lora = replace_a(lora, {k: project_off(mem[k], ad.factors["a"]) for k, ad in lora.items()})
        trainable = {"shared": lora, "head": state.head}
        tx = base.tx([scale_by_orthogonal_projection(base.a_memories(state, trainable))])
        return trainable, _begin_frozen(base, state), tx

    def end_task(state, trainable, frozen, task):
        state = sequential.end_task(state, trainable, frozen, task)
        return _extend_memory(
            base, state, task, examples=memory_examples, threshold=memory_threshold
        )

    sequential = sequential_lora(apply_fn, head_path=head_path, **common_args(locals()))
    return sequential._replace(
        init=lambda variables: base.init(variables, memory=True, extra=lambda w0: ()),
        begin_task=begin_task,
        end_task=end_task,
    )


def sd_lora(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
) -> ContinualMethod:
    r"""SD-LoRA: ``W = W₀ + Σ_i α_i ΔW_i/‖ΔW_i‖_F``; old directions frozen, magnitudes learnable.

    A task trains a fresh LoRA branch, the head and the magnitudes ``α_i`` of the earlier tasks
    (``trainable["alpha"]``, present from the second task on); after it its update becomes a new
    unit direction with magnitude ``‖ΔW_t‖_F``. Args: as :func:`sequential_lora`.

    References: Wu et al. 2025, "SD-LoRA: Scalable Decoupled Low-Rank Adaptation for Class
    Incremental Learning".
    """
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def init(variables):
        def extra(w0):
            return SDLoRAState(
                {k: jnp.zeros((0, *w.shape)) for k, w in w0.items()},
                {k: jnp.zeros((0, *w.shape[:-2])) for k, w in w0.items()},
            )

        return base.init(variables, memory=False, extra=extra)

    def begin_task(state, key, task):
        del task
        trainable = {"shared": base.lora(key, state), "head": state.head}
        if any(m.shape[0] for m in state.extra.magnitudes.values()):
            trainable["alpha"] = dict(state.extra.magnitudes)  # (orbax cannot save empty ones)
        frozen = {
            **_begin_frozen(base, state),
            "w0": state.kernels,
            "dirs": state.extra.directions,
        }
        return trainable, frozen, base.tx()

    def apply(trainable, frozen, x):
        params = base.full(frozen["params"], trainable["head"])
        if "alpha" in trainable:
            for k, w0 in frozen["w0"].items():
                kernel = _sd_kernel(w0, frozen["dirs"][k], trainable["alpha"][k])
                params = set_path(params, k, kernel)
        return base.adapted(params, {"shared": trainable["shared"]}, x)

    def end_task(state, trainable, frozen, task):
        del frozen, task
        trained = jax.device_get(trainable)
        deltas = base.deltas(state, trained["shared"])
        dirs, mags = dict(state.extra.directions), dict(state.extra.magnitudes)
        params = state.params
        for k, w0 in state.kernels.items():
            direction, norm = per_layer(unit_direction, w0)(deltas[k])  # per layer of a stack
            dirs[k] = jnp.concatenate([dirs[k], direction[None]])
            old = trained["alpha"][k] if "alpha" in trained else mags[k]
            mags[k] = jnp.concatenate([jnp.asarray(old), norm[None]])
            params = set_path(params, k, _sd_kernel(w0, dirs[k], mags[k]))
        return state._replace(
            params=params, head=trained["head"], update=deltas, extra=SDLoRAState(dirs, mags)
        )

    return ContinualMethod(
        init=init,
        begin_task=begin_task,
        apply=apply,
        loss=no_penalty,
        end_task=end_task,
        predict=base.plain_predict,
        features=base.plain_features,
        diagnostics=no_diagnostics,
    )
