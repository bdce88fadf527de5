r"""GR-LoRA (P2): entropy-based module selection and mismatch suppression with synthetic OOD.

**Reconstruction** of specs.md §2 from the abstract (no equations, code or numbers are public).
The gradient split itself is the optax transform
:func:`lowrank_jax.optim.scale_by_gradient_recycling`; this module holds the test-time and
stability parts:

* **Entropy selection** (:func:`select_module`): each task module ``R_t`` yields logits
  ``z_t(x)``; with ``H_t(x)`` the entropy of ``softmax`` of ``z_t`` restricted to task ``t``'s
  classes, predict with ``t* = argmin_t H_t(x)`` (hard) or weights ``w_t ∝ exp(−H_t/τ)`` (soft).
* **Class statistics, no exemplars** (:func:`~lowrank_jax.continual.statistics.class_statistics`,
  shared with the class-incremental heads): per-class mean and diagonal variance of the features the
  modules read (here: the model inputs).
* **Synthetic OOD** — local (:func:`synthesize_local`): inter/extrapolations
  ``μ_a + β(μ_b − μ_a)``, ``β ~ U(β_lo, β_hi)``, of the current task's class means plus Gaussian
  noise of the classes' scale (points between and beyond the task's own classes); global
  (:func:`synthesize_global`): ``x̃ ~ N(μ_c, diag σ²_c)`` for the classes of *other* tasks.
* **Mismatch suppression** (:func:`mismatch_loss`): ``KL(U ‖ p_t(x̃))`` over task ``t``'s classes,
  added with weights ``λ_loc``, ``λ_glob``, so a module is high-entropy off its own task and the
  entropy rule picks the right module.

References:
  P2 GR-LoRA (ICML 2026, abstract only); SLCA (Zhang et al. 2023) for Gaussian class statistics;
  GPM (Saha et al. 2021) and InfLoRA (Liang & Li 2024) for the projection being recycled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.paths import get_path, set_path
from lowrank_jax.continual._src import (
    check_threshold,
    common_args,
    method_base,
    replace_a,
)
from lowrank_jax.continual.protocol import (
    ContinualMethod,
)
from lowrank_jax.continual.statistics import ClassStatistics, class_statistics
from lowrank_jax.optim.orthogonal_projection import extend_memories
from lowrank_jax.optim.recycling import scale_by_gradient_recycling
from lowrank_jax.optim.subspace_memory import project_off, project_onto

__all__ = [
    "GRLoRAState",
    "gr_lora",
    "gr_lora_adapters",
    "masked_entropy",
    "mismatch_loss",
    "module_adapters",
    "select_module",
    "synthesize_global",
    "synthesize_local",
]

_NEG = -1e9


def masked_entropy(logits: jax.typing.ArrayLike, mask: jax.typing.ArrayLike) -> jax.Array:
    r"""``H = −Σ_{c∈mask} p_c log p_c`` of ``softmax`` over the masked classes only.

    Args:
      logits: ``(..., C)``.
      mask: ``(C,)`` or ``(..., C)`` booleans, the classes of one task.

    Returns:
      ``(...)`` entropies in ``[0, log |mask|]`` (nats).
    """
    logits = jnp.asarray(logits, jnp.float32)
    mask = jnp.asarray(mask, bool)
    z = jnp.where(mask, logits, _NEG)
    logp = jax.nn.log_softmax(z, axis=-1)
    return -jnp.sum(jnp.where(mask, jnp.exp(logp) * logp, 0.0), axis=-1)


def select_module(
    logits: jax.typing.ArrayLike,
    task_masks: jax.typing.ArrayLike,
    *,
    temperature: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""Entropy-based module selection without task id.

    Args:
      logits: ``(T, b, C)``, the logits of each module ``t`` on the batch.
      task_masks: ``(T, C)`` booleans, the classes of each task.
      temperature: ``None`` for the hard rule ``argmin_t H_t``; ``τ > 0`` for soft weights
        ``w_t ∝ exp(−H_t/τ)``.

    Returns:
      ``(weights (b, T), entropies (T, b))``; hard selection gives one-hot weights.

    Raises:
      ValueError: shapes disagree or ``temperature`` is not positive.
    """
    logits = jnp.asarray(logits)
    task_masks = jnp.asarray(task_masks, bool)
    if logits.ndim != 3 or task_masks.shape != (logits.shape[0], logits.shape[2]):
        raise ValueError(
            f"logits {logits.shape} and task_masks {task_masks.shape} must be (T, b, C) and (T, C)."
        )
    ent = masked_entropy(logits, task_masks[:, None, :])  # (T, b)
    if temperature is None:
        weights = jax.nn.one_hot(jnp.argmin(ent, axis=0), logits.shape[0])
    else:
        if not temperature > 0:
            raise ValueError(f"temperature must be positive or None, got {temperature!r}.")
        weights = jax.nn.softmax(-ent.T / temperature, axis=-1)
    return weights, ent


def mismatch_loss(logits: jax.typing.ArrayLike, mask: jax.typing.ArrayLike) -> jax.Array:
    r"""``mean_b KL(U ‖ p(x̃_b))`` over the masked classes (0 iff every prediction is uniform).

    ``KL(U‖p) = −log K − (1/K) Σ_{c∈mask} log p_c`` with ``K = |mask|``.

    Args:
      logits: ``(b, C)`` logits on synthetic out-of-distribution features.
      mask: ``(C,)`` booleans, the current task's classes.

    Returns:
      A scalar ``≥ 0``.
    """
    logits = jnp.asarray(logits, jnp.float32)
    mask = jnp.asarray(mask, bool)
    k = jnp.sum(mask)
    logp = jax.nn.log_softmax(jnp.where(mask, logits, _NEG), axis=-1)
    kl = -jnp.log(k) - jnp.sum(jnp.where(mask, logp, 0.0), axis=-1) / k
    return jnp.mean(kl)


def synthesize_global(
    key: jax.Array, stats: ClassStatistics, classes: jax.typing.ArrayLike, num: int
) -> jax.Array:
    r"""``num`` samples ``x̃ ~ N(μ_c, diag σ²_c)`` with ``c`` uniform over ``classes``.

    Args:
      key: PRNG key.
      stats: class statistics (``mean``/``var`` ``(C, d)``).
      classes: ``(k,)`` class ids to sample from (the other tasks' classes), ``k ≥ 1``.
      num: number of samples.

    Returns:
      ``(num, d)`` float32.
    """
    classes = jnp.asarray(classes, jnp.int32)
    kc, kn = jax.random.split(key)
    c = jax.random.choice(kc, classes, (num,))
    mean, std = jnp.asarray(stats.mean)[c], jnp.sqrt(jnp.asarray(stats.var))[c]
    return mean + std * jax.random.normal(kn, mean.shape)


def synthesize_local(
    key: jax.Array,
    stats: ClassStatistics,
    classes: jax.typing.ArrayLike,
    num: int,
    *,
    low: float = -0.5,
    high: float = 1.5,
    noise: float = 1.0,
) -> jax.Array:
    r"""Local OOD: ``μ_a + β(μ_b − μ_a) + noise·σ_a ε``, ``a ≠ b`` from the task's ``classes``.

    ``β ~ U(low, high)``: points between the task's class means (``0 < β < 1``) and beyond them
    (extrapolation); the module should not be confident there.

    Args:
      key: PRNG key.
      stats: class statistics.
      classes: ``(k,)`` the current task's classes, ``k ≥ 2``.
      num: number of samples.
      low, high: range of ``β``.
      noise: scale of the added Gaussian noise relative to the class standard deviation.

    Returns:
      ``(num, d)`` float32.
    """
    classes = jnp.asarray(classes, jnp.int32)
    k = classes.shape[0]
    ka, kb, kbeta, kn = jax.random.split(key, 4)
    ia = jax.random.randint(ka, (num,), 0, k)
    ib = (ia + jax.random.randint(kb, (num,), 1, max(k, 2))) % k  # b != a when k >= 2
    a, b = classes[ia], classes[ib]
    beta = jax.random.uniform(kbeta, (num, 1), minval=low, maxval=high)
    mean = jnp.asarray(stats.mean)
    std = jnp.sqrt(jnp.asarray(stats.var))[a]
    base = mean[a] + beta * (mean[b] - mean[a])
    return base + noise * std * jax.random.normal(kn, base.shape)


# ----------------------------------------------------------------------------------------------
# The forward wiring and GR-LoRA as a ContinualMethod.


def module_adapters(module: Mapping[str, Any], shared: Mapping[str, Any]) -> dict[str, Any]:
    r"""The task module as it acts in the forward pass: its own ``Ã``, reading the shared ``B``.

    GR-LoRA's module sits beside the shared adapter, ``x (A + Ã) B = x A B + x Ã B``: for every
    kernel path the module's factor ``a`` is combined with the *shared* factor ``b`` (the
    module's own ``b`` is never read; :func:`~lowrank_jax.optim.scale_by_gradient_recycling`
    needs it only as a buffer of ``A``'s layout for the recycled update).

    Args:
      module: ``{path: Adapter}`` the task module (LoRA adapters).
      shared: ``{path: Adapter}`` the shared adapters of the same paths.

    Returns:
      ``{path: Adapter}`` with ``factors = {"a": Ã, "b": B_shared}``.

    Raises:
      ValueError: a module path has no shared adapter.

    Example:
      >>> fwd = adapters.adapt(model.apply)
      >>> logits = fwd(variables, gr_lora_adapters(params["shared"], params["module"]), x)
    """
    missing = sorted(set(module) - set(shared))
    if missing:
        raise ValueError(f"module paths {missing} have no shared adapter; the shared paths are "
                         f"{sorted(shared)}.")  # fmt: skip
    return {
        k: ad.replace(factors={"a": ad.factors["a"], "b": shared[k].factors["b"]})
        for k, ad in module.items()
    }


def gr_lora_adapters(shared: Mapping[str, Any], module: Mapping[str, Any]) -> dict[str, Any]:
    """``{"shared": shared, "module": module_adapters(module, shared)}``: the adapters argument
    of :func:`lowrank_jax.adapters.adapt`'s function while a task trains (the updates of
    ``shared`` and ``module`` come from :func:`~lowrank_jax.optim.scale_by_gradient_recycling`)."""
    return {"shared": shared, "module": module_adapters(module, shared)}


class GRLoRAState(NamedTuple):
    """GR-LoRA's record (``state.memory`` holds the GPM memory ``M``).

    Attributes:
      modules: one ``{path: Adapter}`` per learned task (:func:`module_adapters` form).
      classes: the classes of each learned task, in order.
      stats: per-class input statistics of the tasks so far (None before the first).
    """

    modules: tuple[dict[str, Any], ...]
    classes: tuple[np.ndarray, ...]
    stats: ClassStatistics | None


def gr_lora(
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
    recycle_scale: float = 1.0,
    lambda_local: float = 0.5,
    lambda_global: float = 0.5,
    ood_batch: int = 64,
) -> ContinualMethod:
    r"""GR-LoRA (P2, reconstruction) as a :class:`~lowrank_jax.continual.ContinualMethod`.

    Per task: a shared LoRA branch with ``A`` started off the memory ``M`` and a task module
    ``Ã = MMᵀA`` beside it (:func:`gr_lora_adapters`), trained with
    :func:`~lowrank_jax.optim.scale_by_gradient_recycling` after Adam (the shared branch gets
    ``(I − MMᵀ)u``, the module ``recycle_scale · MMᵀu``); from the second task on,
    :attr:`~lowrank_jax.continual.ContinualMethod.loss` adds the mismatch suppression
    ``λ_loc KL(U‖p(x̃_loc)) + λ_glob KL(U‖p(x̃_glob))`` on ``ood_batch`` synthetic points each
    (:func:`synthesize_local`, :func:`synthesize_global` from :class:`ClassStatistics` of the
    model inputs). After the task the shared branch is merged, the module kept, ``M`` extended
    (GPM ``memory_threshold``) and the statistics updated. ``predict`` runs every module and,
    without a task id, keeps per example the one of lowest entropy over its task's classes
    (:func:`select_module`); ``selected`` is its index. ``features`` are those of the module
    ``predict`` reads: ``task_id``'s, or per example the selected one.

    Args:
      apply_fn, targets, rank, alpha, learning_rate, grad_clip, head_path: as
        :func:`~lowrank_jax.continual.sequential_lora`.
      memory_threshold, memory_examples: as :func:`~lowrank_jax.continual.inflora`.
      recycle_scale: ``≥ 0`` (0: pure projection).
      lambda_local, lambda_global: ``≥ 0`` weights of the mismatch terms (both 0 for a
        task-incremental stream, where the task id picks the module, and for a model of token
        ids such as ``models.DecoderLM``: the synthetic inputs are Gaussian, not tokens).
      ood_batch: synthetic points per term and step.

    Returns:
      A :class:`~lowrank_jax.continual.ContinualMethod` whose ``state.extra`` is a
      :class:`GRLoRAState`.

    Raises:
      ValueError: a hyper-parameter out of range.

    References:
      P2 GR-LoRA (reconstruction, specs.md §2); GPM (Saha et al. 2021); SLCA (Zhang et al. 2023).
    """
    check_threshold("memory_threshold", memory_threshold)
    if not recycle_scale >= 0 or not lambda_local >= 0 or not lambda_global >= 0:
        raise ValueError(
            "recycle_scale, lambda_local and lambda_global must be >= 0, got "
            f"{recycle_scale!r}, {lambda_local!r}, {lambda_global!r}."
        )
    if ood_batch < 1:
        raise ValueError(f"ood_batch must be >= 1, got {ood_batch!r}.")
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))
    adapted = base.adapted

    def init(variables):
        return base.init(variables, memory=True, extra=lambda w0: GRLoRAState((), (), None))

    def begin_task(state, key, task):
        lora, mem = base.lora(key, state), base.memories(state)
        shared = replace_a(
            lora, {k: project_off(mem[k], ad.factors["a"]) for k, ad in lora.items()}
        )
        module = {  # the module's own b is unused (it reads the shared b): a fresh buffer
            k: ad.replace(
                factors={
                    "a": project_onto(mem[k], ad.factors["a"]),
                    "b": jnp.zeros_like(ad.factors["b"]),
                }
            )
            for k, ad in lora.items()
        }
        trainable = {"shared": shared, "module": module, "head": state.head}
        memory = base.a_memories(state, trainable)
        tx = base.tx([scale_by_gradient_recycling(memory, recycle_scale=recycle_scale)])
        frozen = {"params": base.full(state.params, state.head)}
        stats = state.extra.stats
        if (lambda_local or lambda_global) and stats is not None:
            frozen["stats"] = jax.tree.map(jnp.asarray, stats)
            frozen["own"] = jnp.asarray(task.classes)
            mask = np.zeros(task.num_classes, bool)
            mask[task.classes] = True
            frozen["mask"] = jnp.asarray(mask)
            if state.extra.classes:
                frozen["others"] = jnp.asarray(np.concatenate(state.extra.classes))
        return trainable, frozen, tx

    def apply(trainable, frozen, x):
        params = base.full(frozen["params"], trainable["head"])
        return adapted(params, gr_lora_adapters(trainable["shared"], trainable["module"]), x)

    def loss(trainable, frozen, batch, key):
        if "stats" not in frozen:
            return jnp.zeros([], jnp.float32)
        shape = (ood_batch, *batch["x"].shape[1:])  # the statistics are of flattened inputs
        k1, k2 = jax.random.split(key)
        total = 0.0
        if lambda_local:
            x = synthesize_local(k1, frozen["stats"], frozen["own"], ood_batch).reshape(shape)
            total += lambda_local * mismatch_loss(apply(trainable, frozen, x), frozen["mask"])
        if lambda_global and "others" in frozen:
            x = synthesize_global(k2, frozen["stats"], frozen["others"], ood_batch)
            x = x.reshape(shape)
            total += lambda_global * mismatch_loss(apply(trainable, frozen, x), frozen["mask"])
        return total

    def end_task(state, trainable, frozen, task):
        del frozen
        trained = jax.device_get(trainable)
        deltas = base.deltas(state, trained["shared"])
        params = state.params
        for k in state.kernels:
            params = set_path(params, k, get_path(params, k) + deltas[k])
        ex = state.extra
        module = module_adapters(trained["module"], trained["shared"])
        state = state._replace(params=params, head=trained["head"], update=deltas)
        inputs = base.layer_inputs(state, task.x[:memory_examples])
        memory = extend_memories(state.memory, inputs, threshold=memory_threshold)
        stats = class_statistics(task.x, task.y, task.num_classes, previous=ex.stats)
        extra = GRLoRAState((*ex.modules, module), (*ex.classes, np.asarray(task.classes)), stats)
        return state._replace(memory=memory, extra=extra)

    @jax.jit
    def module_logits(params, module, x):
        return adapted(params, {"module": module}, x)

    @jax.jit
    def selected_logits(params, modules, x, masks):
        all_logits = jnp.stack([module_logits(params, md, x) for md in modules])
        weights, _ = select_module(all_logits, masks)
        pick = jnp.argmax(weights, -1)
        return jnp.take_along_axis(all_logits, pick[None, :, None], axis=0)[0], pick

    @jax.jit
    def module_features(params, module, x):
        return base.features(params, {"module": module}, x)

    @jax.jit
    def picked_features(params, modules, x, pick):
        features = jnp.stack([module_features(params, md, x) for md in modules])
        return jnp.take_along_axis(features, pick[None, :, None], axis=0)[0]

    def modules_of(state):
        ex = state.extra
        if not ex.modules:
            raise ValueError("GR-LoRA predicts with its task modules: call end_task first.")
        masks = np.zeros((len(ex.classes), len(ex.stats.count)), bool)  # (T, C)
        for j, classes in enumerate(ex.classes):
            masks[j, np.asarray(classes)] = True
        return base.full(state.params, state.head), ex.modules, masks

    def predict(state, x, task_id=None):
        params, modules, masks = modules_of(state)
        if task_id is not None:
            return module_logits(params, modules[task_id], jnp.asarray(x)), None
        return selected_logits(params, modules, jnp.asarray(x), masks)

    def features(state, x, task_id=None):
        params, modules, masks = modules_of(state)
        if task_id is not None:
            return module_features(params, modules[task_id], jnp.asarray(x))
        _, pick = selected_logits(params, modules, jnp.asarray(x), masks)  # predict's choice
        return picked_features(params, modules, jnp.asarray(x), pick)

    return ContinualMethod(
        init=init,
        begin_task=begin_task,
        apply=apply,
        loss=loss,
        end_task=end_task,
        predict=predict,
        features=features,
        diagnostics=lambda state: {},
    )
