r"""GR-LoRA (P2): entropy-based module selection and mismatch suppression with synthetic OOD.

**Reconstruction** of specs.md §2 from the abstract (no equations, code or numbers are public).
The gradient split itself is the optax transform
:func:`lowrank_jax.optim.scale_by_gradient_recycling`; this module holds the test-time and
stability parts:

* **Entropy selection** (:func:`select_module`): each task module ``R_t`` yields logits
  ``z_t(x)``; with ``H_t(x)`` the entropy of ``softmax`` of ``z_t`` restricted to task ``t``'s
  classes, predict with ``t* = argmin_t H_t(x)`` (hard) or weights ``w_t ∝ exp(−H_t/τ)`` (soft).
* **Class statistics, no exemplars** (:func:`class_statistics`): per-class mean and diagonal
  variance of the features the modules read (here: the model inputs).
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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ClassStatistics",
    "class_statistics",
    "masked_entropy",
    "mismatch_loss",
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


class ClassStatistics(NamedTuple):
    """Per-class Gaussian statistics (no exemplars are kept).

    Attributes:
      mean: ``(C, d)`` class means.
      var: ``(C, d)`` diagonal variances (shrunk towards the pooled variance).
      count: ``(C,)`` number of examples seen per class (0: unseen).
    """

    mean: np.ndarray
    var: np.ndarray
    count: np.ndarray


def class_statistics(
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    *,
    shrinkage: float = 0.1,
    previous: ClassStatistics | None = None,
) -> ClassStatistics:
    """Means and shrunk diagonal variances of ``x`` per class, merged into ``previous``.

    Args:
      x: ``(N, ...)`` features (flattened to ``(N, d)``).
      y: ``(N,)`` integer classes in ``[0, num_classes)``.
      num_classes: ``C``.
      shrinkage: weight of the pooled (all-class) variance in each class's variance.
      previous: statistics of earlier tasks; classes present in ``y`` are overwritten.

    Returns:
      :class:`ClassStatistics`.

    Raises:
      ValueError: labels out of range or ``shrinkage`` outside ``[0, 1]``.
    """
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}); got {y.min()}..{y.max()}.")
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"shrinkage must lie in [0, 1], got {shrinkage!r}.")
    d = x.shape[1]
    if previous is None:
        mean = np.zeros((num_classes, d))
        var = np.ones((num_classes, d))
        count = np.zeros(num_classes, np.int64)
    else:
        mean, var, count = (np.array(a) for a in previous)
    pooled = x.var(axis=0) if len(x) > 1 else np.ones(d)
    for c in np.unique(y):
        xc = x[y == c]
        mean[c] = xc.mean(axis=0)
        vc = xc.var(axis=0) if len(xc) > 1 else pooled
        var[c] = (1.0 - shrinkage) * vc + shrinkage * pooled
        count[c] = len(xc)
    return ClassStatistics(mean.astype(np.float32), var.astype(np.float32), count)


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
