r"""Class-incremental heads as values, and the head-side fits: refit, alignment, prototypes.

:class:`~lowrank_jax.continual.ContinualState` keeps the head (``state.head``, a dense layer
``z = f W + b`` with ``W: (d, C)``, ``b: (C,)`` on the features ``f: (b, d)`` it reads,
:attr:`~lowrank_jax.continual.ContinualMethod.features`) apart from the backbone
(``state.params``), so head-side corrections act on every method alike: they read features of
the consolidated backbone and rewrite only ``state.head``.

* :func:`refit_head`: SABER's recalibration after recomposition (masked to the task's classes).
* :func:`align_head`: SLCA's classifier alignment: re-fit the head with *unmasked*
  cross-entropy over every seen class on Gaussian pseudo-features ``f̃ ~ N(μ_c, Σ_c)`` drawn
  from stored class statistics (:class:`~lowrank_jax.continual.statistics.ClassStatistics`; no
  exemplars).
* :func:`prototype_head`: a nearest-class-mean (Euclidean or cosine) or LDA head written as the
  same dense layer, computed in closed form from the statistics.
* :class:`~lowrank_jax.continual.AlignedHead`, :class:`~lowrank_jax.continual.PrototypeHead`:
  the two as values (their knobs, and ``fit(key, head, stats, classes)``), passed to
  :func:`~lowrank_jax.continual.with_head`.

Why: with cross-entropy masked to the current task's classes (the protocol's default), logits of
classes of different tasks are never contrasted, and a class-incremental stream (no task id at
test time) is decided by whichever task's logits happen to be largest.

References:
  Zhang et al. 2023, "SLCA: Slow Learner with Classifier Alignment for Continual Learning on a
  Pre-trained Model" (ICCV); McDonnell et al. 2023, "RanPAC: Random Projections and Pre-trained
  Models for Continual Learning" (NeurIPS; the class-mean/LDA readout — its random ReLU
  projection of the features is not implemented here, as it would make the head non-linear).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.continual._src import check_dense_head
from lowrank_jax.continual.protocol import masked_cross_entropy
from lowrank_jax.continual.statistics import (
    ClassStatistics,
    covariance_factors,
    sample_class_features,
)

__all__ = [
    "AlignedHead",
    "PrototypeHead",
    "align_head",
    "prototype_head",
    "refit_head",
]

PROTOTYPE_METRICS = ("euclidean", "cosine", "lda")


def _affine(f: Any, head: Any) -> Any:
    """``f W + b`` of a dense head ``{'kernel', 'bias'}``, or ``f W`` without a bias (an LM's
    ``lm_head``)."""
    out = f @ head["kernel"]
    return out + head["bias"] if "bias" in head else out


@functools.partial(jax.jit, static_argnames=("learning_rate",))
def _refit_step(head, opt_state, f, y, mask, *, learning_rate):
    def loss_fn(h):  # the model's logits: its frozen backbone's features through the head
        return masked_cross_entropy(_affine(f, h), y, mask)

    grads = jax.grad(loss_fn)(head)
    updates, opt_state = optax.adam(learning_rate).update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state


def refit_head(
    head: Any,
    features: np.ndarray,
    y: np.ndarray,
    classes: np.ndarray,
    *,
    num_classes: int,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int | Sequence[int],
) -> Any:
    r"""Refits ``head`` for ``steps`` Adam steps on the frozen backbone's ``features`` of ``y``.

    Minimises the cross-entropy over ``classes`` (the other logits masked out) of the head's
    logits ``f W + b`` (``f W`` without a bias, as an LM's ``lm_head``): the model's logits, its
    backbone frozen, read once (:attr:`~lowrank_jax.continual.ContinualMethod.features`); batches
    of ``min(batch_size, N)`` rows drawn without replacement by
    ``numpy.random.default_rng(seed)`` (deterministic).

    Args:
      head: the head to start from (``{'kernel': (d, C)[, 'bias': (C,)]}``).
      features: ``(N, d)`` the features the head reads; ``y``: ``(N,)`` labels in ``classes``.
      classes: ``(k,)`` the classes the loss ranges over.
      num_classes: ``C``.
      steps: number of Adam steps (0 returns ``head`` unchanged).
      learning_rate: Adam learning rate.
      batch_size: rows per step.
      seed: the sampling seed (an int or a sequence of ints, as numpy takes it).

    Returns:
      The refitted head (host arrays).

    Raises:
      ValueError: ``steps < 0`` or ``batch_size < 1``; no examples, or not one label per row of
        ``features``.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps}, {batch_size}.")
    if not steps:
        return head
    if not len(y) or len(features) != len(y):
        raise ValueError(
            f"refit_head needs examples with one label each: got {len(features)} feature rows, "
            f"{len(y)} labels."
        )
    f = np.asarray(features, np.float32)
    step = functools.partial(_refit_step, learning_rate=float(learning_rate))
    head = jax.tree.map(jnp.asarray, head)
    opt_state = optax.adam(learning_rate).init(head)
    mask = np.zeros((len(y), num_classes), bool)
    mask[:, np.asarray(classes)] = True
    rng = np.random.default_rng(seed)
    n, bs = len(y), min(batch_size, len(y))
    for _ in range(steps):
        idx = rng.choice(n, bs, replace=False)
        head, opt_state = step(head, opt_state, f[idx], y[idx], mask[idx])
    return jax.device_get(head)


# ----------------------------------------------------------------------------------------------
# Class-incremental heads.


def _seen(classes: Any, num_classes: int) -> np.ndarray:
    classes = np.unique(np.asarray(classes, np.int64))
    if not classes.size or classes.min() < 0 or classes.max() >= num_classes:
        raise ValueError(f"classes must be a non-empty set of ids in [0, {num_classes}).")
    return classes


@functools.partial(jax.jit, static_argnames=("steps", "num_per_class"))
def _align(key, head, mean, factors, mask, lr, *, steps, num_per_class):
    # every class is sampled (fixed shapes: one compilation for the whole stream); rows of
    # unseen classes get weight 0
    tx = optax.adam(lr)
    all_classes = jnp.arange(mean.shape[0])
    weight = jnp.repeat(mask, num_per_class).astype(jnp.float32)

    def step(carry, k):
        h, opt_state = carry
        f, y = sample_class_features(k, mean, factors, all_classes, num_per_class=num_per_class)

        def loss_fn(h):
            z = jnp.where(mask, f @ h["kernel"] + h["bias"], -1e9)
            ce = optax.softmax_cross_entropy_with_integer_labels(z, y)
            return jnp.sum(weight * ce) / jnp.sum(weight)

        loss, grads = jax.value_and_grad(loss_fn)(h)
        updates, opt_state = tx.update(grads, opt_state, h)
        return (optax.apply_updates(h, updates), opt_state), loss

    (head, _), losses = jax.lax.scan(step, (head, tx.init(head)), jax.random.split(key, steps))
    return head, losses


def align_head(
    key: jax.Array,
    head: Any,
    stats: ClassStatistics,
    classes: jax.typing.ArrayLike,
    *,
    steps: int,
    learning_rate: float,
    num_per_class: int,
) -> Any:
    r"""SLCA classifier alignment: re-fits a dense head on Gaussian pseudo-features of ``classes``.

    Each of ``steps`` Adam steps draws ``m = num_per_class`` features per class,
    ``f̃ ~ N(μ_c, Σ_c)`` (:func:`~lowrank_jax.continual.statistics.sample_class_features`), and
    minimises the cross-entropy over *all* of ``classes`` (the classes seen so far; others masked)

        ``L(W, b) = −(1/km) Σ_c Σ_i log softmax_{classes}(f̃_{c,i} W + b)_c``,

    so every seen class is contrasted with every other. Starts from ``head`` (the trained head);
    columns of classes outside ``classes`` are left as they are.

    Args:
      key: PRNG key of the sampling.
      head: ``{'kernel': (d, C), 'bias': (C,)}``.
      stats: statistics with covariances (``class_statistics(..., covariance=True)``).
      classes: ``(k,)`` the classes to align (each with ``stats.count > 0``).
      steps: Adam steps (0 returns ``head``).
      learning_rate: Adam learning rate.
      num_per_class: pseudo-features per class and step.

    Returns:
      The aligned head (host float32 arrays).

    Raises:
      TypeError or ValueError: a head that is not dense, statistics without covariances, classes
        out of range or never seen, non-positive sizes.

    References:
      Zhang et al. 2023 (SLCA), §3.3 "classifier alignment" (there: after each task, 256
      samples per class, a few epochs; logit normalisation is not used here).
    """
    d, c = check_dense_head(head)
    if stats.cov is None:
        raise ValueError("align_head needs covariances: class_statistics(..., covariance=True).")
    if stats.mean.shape != (c, d):
        raise ValueError(f"statistics of shape {stats.mean.shape} do not fit a head of {(d, c)}.")
    classes = _seen(classes, c)
    if np.any(np.asarray(stats.count)[classes] == 0):
        raise ValueError("align_head got classes without statistics (count 0).")
    if steps < 0 or num_per_class < 1 or not learning_rate > 0:
        raise ValueError(
            "steps must be >= 0, num_per_class >= 1 and learning_rate > 0; got "
            f"{steps}, {num_per_class}, {learning_rate}."
        )
    if not steps:
        return head
    mask = np.zeros(c, bool)
    mask[classes] = True
    head = {k: jnp.asarray(v, jnp.float32) for k, v in head.items()}
    factors = covariance_factors(stats.cov)
    steps, num_per_class = int(steps), int(num_per_class)
    aligned, _ = _align(
        key,
        head,
        stats.mean,
        factors,
        mask,
        learning_rate,
        steps=steps,
        num_per_class=num_per_class,
    )
    return jax.device_get(aligned)


def prototype_head(
    head: Any,
    stats: ClassStatistics,
    classes: jax.typing.ArrayLike,
    *,
    metric: str = "euclidean",
    ridge: float = 1e-2,
) -> Any:
    r"""A class-mean head in closed form, written into the dense head's columns of ``classes``.

    With class means ``μ_c`` and the count-weighted pooled within-class covariance ``Σ`` of
    ``classes``:

    * ``euclidean`` (nearest class mean): ``W_c = μ_c/σ²``, ``b_c = −‖μ_c‖²/(2σ²)`` with
      ``σ² = tr Σ/d``; then ``z_c = −‖f − μ_c‖²/(2σ²) + const(f)``, so ``argmax z`` is the
      nearest mean and ``softmax z`` the posterior of a shared isotropic Gaussian model;
    * ``cosine``: ``W_c = μ_c/‖μ_c‖``, ``b_c = 0``: ``z_c = ‖f‖ cos(f, μ_c)``, whose argmax is the
      nearest mean in angle;
    * ``lda``: ``W_c = Σ_λ⁻¹ μ_c``, ``b_c = −½ μ_cᵀ Σ_λ⁻¹ μ_c`` with
      ``Σ_λ = Σ + λ (tr Σ/d) I`` (``λ = ridge``): the linear discriminant of a shared
      Gaussian, RanPAC's class-prototype readout (with its Gram-matrix ridge).

    Columns of classes outside ``classes`` are left as they are (a later task trains them).

    Args:
      head: ``{'kernel': (d, C), 'bias': (C,)}``.
      stats: class statistics (``cov`` needed for ``lda``; ``var`` suffices otherwise).
      classes: ``(k,)`` seen classes (``stats.count > 0``).
      metric: ``"euclidean"``, ``"cosine"`` or ``"lda"``.
      ridge: ``λ ≥ 0`` of ``lda``.

    Returns:
      The head (host float32 arrays).

    Raises:
      TypeError or ValueError: a head that is not dense, unknown ``metric``, ``lda`` without
        covariances, classes out of range or never seen.

    References:
      McDonnell et al. 2023 (RanPAC), §3 (NCM and the LDA/ridge readout; the random projection
      is not implemented); Mensink et al. 2013 (nearest class mean).
    """
    d, c = check_dense_head(head)
    if metric not in PROTOTYPE_METRICS:
        raise ValueError(f"metric must be one of {PROTOTYPE_METRICS}, got {metric!r}.")
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge!r}.")
    if metric == "lda" and stats.cov is None:
        raise ValueError("metric='lda' needs covariances: class_statistics(..., covariance=True).")
    classes = _seen(classes, c)
    counts = np.asarray(stats.count, np.float64)[classes]
    if np.any(counts == 0):
        raise ValueError("prototype_head got classes without statistics (count 0).")
    mu = np.asarray(stats.mean, np.float64)[classes]  # (k, d)
    w = counts / counts.sum()
    kernel = np.array(head["kernel"], np.float32)
    bias = np.array(head["bias"], np.float32)
    if metric == "cosine":
        cols = mu / np.maximum(np.linalg.norm(mu, axis=1, keepdims=True), 1e-12)
        b = np.zeros(len(classes))
    elif metric == "euclidean":
        sigma2 = float(w @ np.asarray(stats.var, np.float64)[classes].mean(axis=1))
        cols = mu / sigma2
        b = -0.5 * np.sum(mu * mu, axis=1) / sigma2
    else:
        pooled = np.einsum("k,kij->ij", w, np.asarray(stats.cov, np.float64)[classes])
        pooled = pooled + ridge * np.trace(pooled) / d * np.eye(d)
        cols = np.linalg.solve(pooled, mu.T).T
        b = -0.5 * np.sum(mu * cols, axis=1)
    kernel[:, classes] = cols.T
    bias[classes] = b
    return {"kernel": kernel, "bias": bias}


@dataclasses.dataclass(frozen=True)
class AlignedHead:
    """SLCA classifier alignment as a head (:func:`align_head` with these knobs).

    Attributes:
      steps: Adam steps per fit (0: the trained head is kept).
      learning_rate: Adam learning rate.
      num_per_class: pseudo-features per class and step.

    Example:
      >>> method = continual.with_head(method, head=continual.AlignedHead(steps=200))
    """

    steps: int = 200
    learning_rate: float = 1e-2
    num_per_class: int = 64

    def __post_init__(self):
        if self.steps < 0 or self.num_per_class < 1 or not self.learning_rate > 0:
            raise ValueError(
                "steps must be >= 0, num_per_class >= 1 and learning_rate > 0; got "
                f"{self.steps!r}, {self.num_per_class!r}, {self.learning_rate!r}."
            )

    def fit(self, key: jax.Array, head: Any, stats: ClassStatistics, classes: Any) -> Any:
        """The head aligned on pseudo-features of ``classes`` drawn with ``key``."""
        return align_head(
            key,
            head,
            stats,
            classes,
            steps=self.steps,
            learning_rate=self.learning_rate,
            num_per_class=self.num_per_class,
        )


@dataclasses.dataclass(frozen=True)
class PrototypeHead:
    """A class-mean (or LDA) head in closed form (:func:`prototype_head` with these knobs).

    Attributes:
      metric: ``"euclidean"``, ``"cosine"`` or ``"lda"``.
      ridge: ``λ ≥ 0`` of ``lda``.

    Example:
      >>> method = continual.with_head(method, head=continual.PrototypeHead(metric="lda"))
    """

    metric: str = "euclidean"
    ridge: float = 1e-2

    def __post_init__(self):
        if self.metric not in PROTOTYPE_METRICS:
            raise ValueError(f"metric must be one of {PROTOTYPE_METRICS}, got {self.metric!r}.")
        if not self.ridge >= 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge!r}.")

    def fit(self, key: jax.Array, head: Any, stats: ClassStatistics, classes: Any) -> Any:
        """The prototype head of ``classes`` (``key`` unused: closed form)."""
        del key
        return prototype_head(head, stats, classes, metric=self.metric, ridge=self.ridge)
