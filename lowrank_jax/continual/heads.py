r"""The classifier head as a component of its own: refits and class-incremental heads.

:class:`~lowrank_jax.continual.ContinualState` keeps the head (``state.head``, a dense layer
``z = f W + b`` with ``W: (d, C)``, ``b: (C,)`` on the features ``f: (b, d)`` it reads) apart
from the backbone (``state.params``), so head-side corrections act on every method alike: they
read the consolidated backbone and rewrite only ``state.head``.

* :func:`refit_head`: SABER's recalibration after recomposition (masked to the task's classes).
* :func:`align_head`: SLCA's classifier alignment: re-fit the head with *unmasked*
  cross-entropy over every seen class on Gaussian pseudo-features ``f̃ ~ N(μ_c, Σ_c)`` drawn
  from stored class statistics (:class:`~lowrank_jax.continual.statistics.ClassStatistics`; no
  exemplars).
* :func:`prototype_head`: a nearest-class-mean (Euclidean or cosine) or LDA head written as the
  same dense layer, computed in closed form from the statistics.
* :func:`with_head`: wraps any :class:`~lowrank_jax.continual.ContinualMethod` so that after each
  ``end_task`` the features of the task's training rows (:func:`head_inputs`) update the class
  statistics and the head is replaced by :func:`align_head` or :func:`prototype_head`.

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

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.continual.protocol import (
    ContinualMethod,
    ContinualState,
    get_path,
    masked_cross_entropy,
    set_path,
)
from lowrank_jax.continual.statistics import (
    ClassStatistics,
    class_statistics,
    covariance_factors,
    sample_class_features,
)

__all__ = [
    "HEADS",
    "HeadState",
    "align_head",
    "compensate_drift",
    "head_inputs",
    "prototype_head",
    "refit_head",
    "with_head",
]

HEADS = ("masked", "aligned", "prototype")
PROTOTYPE_METRICS = ("euclidean", "cosine", "lda")


def _affine(f: Any, head: Any) -> Any:
    """``f W + b`` of a dense head ``{'kernel', 'bias'}``, or ``f W`` without a bias (an LM's
    ``lm_head``)."""
    out = f @ head["kernel"]
    return out + head["bias"] if "bias" in head else out


def _transpose_features(logits_of_head: Callable[[Any], jax.Array], head: Any) -> jax.Array:
    """``f: (n, d)`` with ``logits_of_head(h) = f h['kernel'] (+ h['bias'])`` (a dense last layer).

    With ``b = 0`` and ``W = w e_0ᵀ`` the first logit is linear in ``w``, ``z_{:,0}(w) = f w``;
    its transpose maps the cotangent ``e_n`` to ``f_n``, so one ``jax.vjp`` (one forward pass)
    and the transpose vmapped over the rows give ``f`` exactly (one-hot cotangents)."""
    zero = jax.tree.map(jnp.zeros_like, dict(head))
    kernel = zero["kernel"]

    def first_logit(w):
        return logits_of_head({**zero, "kernel": kernel.at[:, 0].set(w)})[:, 0]

    first, transpose = jax.vjp(first_logit, kernel[:, 0])
    (f,) = jax.vmap(transpose)(jnp.eye(first.shape[0], dtype=kernel.dtype))  # row n: f_n
    return f


def _in_batches(
    fn: Callable[[np.ndarray], jax.Array], x: np.ndarray, batch_size: int
) -> np.ndarray:
    """``concatenate([fn(batch)])`` over equal batches of at most ``batch_size`` rows of ``x`` (one
    compiled shape; the last batch padded with the first rows, whose outputs are dropped)."""
    size = -(-len(x) // max(1, -(-len(x) // batch_size))) if len(x) else 1
    out = []
    for i in range(0, len(x), size):
        xb = x[i : i + size]
        pad = np.concatenate([xb, x[: size - len(xb)]]) if len(xb) < size else xb
        out.append(np.asarray(fn(pad), np.float32)[: len(xb)])
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnames=("apply_fn", "head_path"))
def _model_head_inputs(params, x, *, apply_fn, head_path):
    return _transpose_features(
        lambda h: apply_fn(set_path(params, head_path, h), x), get_path(params, head_path)
    )


@functools.partial(jax.jit, static_argnames=("learning_rate",))
def _refit_step(head, opt_state, f, y, mask, *, learning_rate):
    def loss_fn(h):  # the model's logits: its frozen backbone's features through the head
        return masked_cross_entropy(_affine(f, h), y, mask)

    grads = jax.grad(loss_fn)(head)
    updates, opt_state = optax.adam(learning_rate).update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state


def refit_head(
    apply_fn: Callable[..., Any],
    params: Any,
    head: Any,
    x: np.ndarray,
    y: np.ndarray,
    classes: np.ndarray,
    *,
    num_classes: int,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int | Sequence[int],
    head_path: str = "params/head",
) -> Any:
    r"""Refits ``head`` for ``steps`` Adam steps on ``(x, y)`` with the backbone ``params`` frozen.

    Minimises the cross-entropy over ``classes`` (the other logits masked out) of
    ``apply_fn(params with head at head_path, x)``; batches of ``min(batch_size, N)`` rows drawn
    without replacement by ``numpy.random.default_rng(seed)`` (deterministic). The head must be
    the model's last, dense layer (``logits = f W + b``, or ``f W`` without a bias as an LM's
    ``lm_head``): the frozen backbone's features ``f`` are computed once (one forward pass over
    ``x``) and every step reads them.

    Args:
      apply_fn: the plain model ``apply(variables, x) -> logits (b, C)`` (hashable: a linen
        ``model.apply`` or a module-level function; it is a static argument of the jitted step).
      params: the model's variables (their head is ignored).
      head: the head to start from.
      x: ``(N, ...)`` inputs; ``y``: ``(N,)`` labels in ``classes``.
      classes: ``(k,)`` the classes the loss ranges over.
      num_classes: ``C``.
      steps: number of Adam steps (0 returns ``head`` unchanged).
      learning_rate: Adam learning rate.
      batch_size: rows per step.
      seed: the sampling seed (an int or a sequence of ints, as numpy takes it).
      head_path: where the head sits in ``params``.

    Returns:
      The refitted head (host arrays).

    Raises:
      ValueError: ``steps < 0`` or ``batch_size < 1``; no examples, or as many labels as inputs
        not given; the logits are not ``f W + b`` of the recovered features.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps}, {batch_size}.")
    if not steps:
        return head
    if not len(y) or len(x) != len(y):
        raise ValueError(
            f"refit_head needs examples with one label each: got {len(x)} inputs, {len(y)} labels."
        )
    # the backbone is frozen: its features (the head's inputs) are computed once
    features = functools.partial(_model_head_inputs, apply_fn=apply_fn, head_path=head_path)
    f = _in_batches(lambda xb: features(params, xb), np.asarray(x), _FEATURE_BATCH)
    logits = apply_fn(set_path(params, head_path, head), np.asarray(x[:_CHECK_ROWS]))
    _check_affine(logits, f[:_CHECK_ROWS], head)
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


def _check_head(head: Any) -> tuple[int, int]:
    if not isinstance(head, dict) or set(head) != {"kernel", "bias"}:
        keys = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise TypeError(
            "the class-incremental heads need a dense head {'kernel': (d, C), 'bias': (C,)} at "
            f"the method's head_path; got {keys}."
        )
    kernel, bias = np.shape(head["kernel"]), np.shape(head["bias"])
    if len(kernel) != 2 or bias != kernel[1:]:
        raise ValueError(f"head kernel {kernel} and bias {bias} must be (d, C) and (C,).")
    return kernel


def _seen(classes: Any, num_classes: int) -> np.ndarray:
    classes = np.unique(np.asarray(classes, np.int64))
    if not classes.size or classes.min() < 0 or classes.max() >= num_classes:
        raise ValueError(f"classes must be a non-empty set of ids in [0, {num_classes}).")
    return classes


_CHECK_ROWS = 16  # as _reads_task_id: one compiled shape
_FEATURE_BATCH = 256  # rows per forward pass when features are read


@functools.lru_cache(maxsize=64)
def _feature_rows(predict: Callable[..., Any], task_id: int | None) -> Callable[..., jax.Array]:
    """``jit((state, xb) -> f)``: the head inputs of one batch by the transpose of ``predict``."""

    def rows(state, xb):
        def logits_of_head(head):
            return predict(state._replace(head=head), xb, task_id=task_id)[0]

        return _transpose_features(logits_of_head, state.head)

    return jax.jit(rows)


def head_inputs(
    method: ContinualMethod,
    state: ContinualState,
    x: np.ndarray,
    *,
    task_id: int | None = None,
    batch_size: int = 256,
    check: bool = True,
) -> np.ndarray:
    r"""The features ``f: (N, d)`` that ``state.head`` reads on ``x``, through ``method.predict``.

    The head is affine, ``z = f W + b``; with ``b = 0`` and ``W = w e_0ᵀ`` the first logit is
    linear in ``w``, ``z_{:,0}(w) = f w``, and its transpose maps the cotangent ``e_n`` to
    ``f_n``; one ``jax.vjp`` through ``predict`` (a single forward pass) and the transpose
    vmapped over the batch's rows therefore recover ``f`` for any method (GR-LoRA's modules
    included, via ``task_id``) without a method-specific feature hook. ``predict`` must be
    traceable under ``jax.jit`` with the whole ``state`` as a traced argument when ``task_id`` is
    given (every method here is); one compilation per ``(predict, task_id)``, state structure
    and batch shape (batches are equal, the last one padded). The transpose multiplies by one-hot
    vectors, so ``f`` is exactly the forward pass's features.

    Args:
      method: the method whose ``predict`` defines the features.
      state: its state (the head a dense ``{'kernel': (d, C), 'bias': (C,)}``).
      x: ``(N, ...)`` inputs.
      task_id: passed to ``predict`` (GR-LoRA: the module whose features to read).
      batch_size: rows per ``predict`` call.
      check: verify ``f W + b`` against ``predict`` with the real head on the first batch.

    Returns:
      ``(N, d)`` float32 host array.

    Raises:
      TypeError or ValueError: the head is not a dense layer; ``check`` fails (the head is not the
        model's last, affine layer).
    """
    d, _ = _check_head(state.head)
    if not len(x):
        return np.zeros((0, d), np.float32)
    rows = _feature_rows(method.predict, task_id)
    f = _in_batches(lambda xb: rows(state, xb), np.asarray(x), batch_size)
    if check:  # on a few rows: a forward pass costs as much as the features
        logits, _ = method.predict(state, x[:_CHECK_ROWS], task_id=task_id)
        _check_affine(logits, f[:_CHECK_ROWS], state.head)
    return f


def _check_affine(logits: Any, f: np.ndarray, head: Any) -> None:
    """Raises ValueError unless ``logits ≈ f W + b`` (the head is the model's last dense layer)."""
    want = _affine(f, jax.tree.map(np.asarray, dict(head)))
    if np.abs(np.asarray(logits) - want).max() > 1e-3 * (1.0 + np.abs(want).max()):
        raise ValueError(
            "the logits are not an affine function of the recovered head inputs: the head must "
            "be the model's last layer, a dense {'kernel', 'bias'}."
        )


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
    d, c = _check_head(head)
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
    aligned, _ = _align(key, head, stats.mean, factors, mask, learning_rate,
                        steps=int(steps), num_per_class=int(num_per_class))  # fmt: skip
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
    d, c = _check_head(head)
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


def compensate_drift(
    mean: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    classes: np.ndarray,
    *,
    bandwidth: float = 0.5,
) -> np.ndarray:
    r"""Semantic drift compensation: moves stored class means along the features' observed drift.

    The backbone changed while learning a task, so the stored means ``μ_c`` (features of an
    older model) are stale and no exemplar is left to recompute them. The current task's rows
    were seen by both models, ``f_i`` (before) and ``f'_i`` (after); each old mean moves by the
    kernel-weighted drift of the rows near it

        ``μ_c ← μ_c + Σ_i w_ic (f'_i − f_i)``,  ``w_ic = softmax_i(−‖f_i − μ_c‖² / (2 h² m_c))``

    with ``m_c`` the median of ``‖f_i − μ_c‖²`` over ``i`` and ``h = bandwidth`` (small ``h``: the
    nearest rows' drift; large: the mean drift). Covariances are kept.

    Args:
      mean: ``(C, d)`` stored class means.
      old: ``(N, d)`` the task's features before the update; ``new``: ``(N, d)`` after.
      classes: ``(k,)`` the classes whose means to move.
      bandwidth: ``h > 0``.

    Returns:
      ``(C, d)`` float32 means (rows outside ``classes`` unchanged).

    Raises:
      ValueError: shapes disagree or ``bandwidth <= 0``.

    References:
      Yu et al. 2020, "Semantic Drift Compensation for Class-Incremental Learning" (CVPR);
      here the kernel width is relative (``m_c``) rather than SDC's fixed ``σ``.
    """
    mean = np.array(mean, np.float64)
    old, new = np.asarray(old, np.float64), np.asarray(new, np.float64)
    if old.shape != new.shape or old.ndim != 2 or old.shape[1] != mean.shape[1]:
        raise ValueError(
            f"old {old.shape}, new {new.shape} must be (N, d) with d = {mean.shape[1]}."
        )
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth!r}.")
    classes = np.asarray(classes, np.int64)
    if not len(old) or not classes.size:
        return mean.astype(np.float32)
    d2 = np.sum((old[None] - mean[classes][:, None]) ** 2, axis=-1)  # (k, N)
    logits = -d2 / (2 * bandwidth**2 * np.maximum(np.median(d2, axis=1, keepdims=True), 1e-12))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    mean[classes] += w @ (new - old)
    return mean.astype(np.float32)


class HeadState(NamedTuple):
    """``state.extra`` of a method wrapped by :func:`with_head`.

    Attributes:
      inner: the wrapped method's own ``extra``.
      stats: :class:`~lowrank_jax.continual.statistics.ClassStatistics` (with covariances) of the
        head's input features, each class's recorded right after the task that taught it (means
        moved by :func:`compensate_drift` after later tasks; None before the first task).
      task_of: ``(C,)`` the task that taught each class (−1: unseen), None before the first.
    """

    inner: Any
    stats: ClassStatistics | None
    task_of: np.ndarray | None = None


def _reads_task_id(method, state, x, task_ids) -> bool:
    """Whether ``predict`` depends on ``task_id`` (GR-LoRA's modules) on a few rows."""
    if len(set(task_ids)) < 2:
        return False
    z = [np.asarray(method.predict(state, x[:_CHECK_ROWS], task_id=t)[0]) for t in task_ids[:2]]
    return not np.array_equal(*z)


def _drift(method, old_state, new_state, task, stats, task_of, bandwidth, new_features):
    """``stats`` with the old classes' means moved by :func:`compensate_drift` on ``task.x``
    (``new_features``: ``head_inputs`` of ``new_state`` on it with ``task_id=task.index``)."""
    x = np.asarray(task.x)
    old_tasks = sorted({int(t) for t in task_of[task_of >= 0]})
    if not old_tasks:
        return stats
    per_task = _reads_task_id(method, new_state, x, [old_tasks[0], task.index])
    mean = stats.mean
    for j in old_tasks if per_task else [None]:
        classes = np.flatnonzero(task_of == j) if per_task else np.flatnonzero(task_of >= 0)
        tid = j if per_task else task.index
        old = head_inputs(method, old_state, x, task_id=tid, check=False)
        new = (
            head_inputs(method, new_state, x, task_id=tid, check=False)
            if per_task
            else new_features
        )
        mean = compensate_drift(mean, old, new, classes, bandwidth=bandwidth)
    return stats._replace(mean=mean)


def with_head(
    method: ContinualMethod,
    *,
    head: str,
    seed: int = 0,
    shrinkage: float = 0.1,
    align_steps: int = 200,
    align_learning_rate: float = 1e-2,
    align_per_class: int = 64,
    metric: str = "euclidean",
    ridge: float = 1e-2,
    drift: bool = True,
    drift_bandwidth: float = 0.5,
) -> ContinualMethod:
    r"""``method`` with a class-incremental head: refitted from class statistics after each task.

    ``end_task`` runs ``method.end_task``, then reads the features of the task's training rows
    under the consolidated model (:func:`head_inputs`, ``task_id = task.index``: GR-LoRA's new
    module), records their per-class mean and covariance
    (:func:`~lowrank_jax.continual.statistics.class_statistics`, shrinkage ``ρ``) and replaces
    ``state.head`` over all classes seen so far by :func:`align_head` (``head="aligned"``, key
    ``fold_in(key(seed), task.index)``) or :func:`prototype_head` (``head="prototype"``). The
    next task starts its training from that head; ``predict`` is ``method.predict`` (the head
    is the model's head). Statistics of a class are never recomputed (no exemplars); with
    ``drift`` the old classes' means follow the backbone's drift on the new task's rows
    (:func:`compensate_drift`, per GR-LoRA module when ``predict`` reads the task id).
    ``head="masked"`` returns ``method`` unchanged (the head trained by masked cross-entropy).

    Args:
      method: any :class:`~lowrank_jax.continual.ContinualMethod` whose head is a dense layer.
      head: ``"masked"``, ``"aligned"`` or ``"prototype"``.
      seed: seed of the alignment's sampling.
      shrinkage: ``ρ`` of the covariances.
      align_steps, align_learning_rate, align_per_class: :func:`align_head`'s ``steps``,
        ``learning_rate``, ``num_per_class``.
      metric, ridge: :func:`prototype_head`'s.
      drift, drift_bandwidth: compensate the stored means for the backbone's drift (SDC) and
        its ``bandwidth``.

    Returns:
      A :class:`~lowrank_jax.continual.ContinualMethod` whose ``state.extra`` is a
      :class:`HeadState`.

    Raises:
      ValueError: unknown ``head`` or ``metric``, hyper-parameters out of range.

    Example:
      >>> method = continual.with_head(continual.sequential_lora(model.apply, targets=t),
      ...                              head="aligned")
    """
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}.")
    if metric not in PROTOTYPE_METRICS:
        raise ValueError(f"metric must be one of {PROTOTYPE_METRICS}, got {metric!r}.")
    if not 0 <= shrinkage <= 1 or align_steps < 0 or align_per_class < 1:
        raise ValueError(
            "shrinkage must lie in [0, 1], align_steps >= 0 and align_per_class >= 1; got "
            f"{shrinkage!r}, {align_steps!r}, {align_per_class!r}."
        )
    if not align_learning_rate > 0 or not ridge >= 0 or not drift_bandwidth > 0:
        raise ValueError(
            "align_learning_rate and drift_bandwidth must be > 0 and ridge >= 0, got "
            f"{align_learning_rate!r}, {drift_bandwidth!r}, {ridge!r}."
        )
    if head == "masked":
        return method

    def inner(state):
        return state._replace(extra=state.extra.inner)

    def init(variables):
        state = method.init(variables)
        _check_head(state.head)
        return state._replace(extra=HeadState(state.extra, None))

    def end_task(state, trainable, frozen, task):
        stats, task_of = state.extra.stats, state.extra.task_of
        new = method.end_task(inner(state), trainable, frozen, task)
        feats = head_inputs(method, new, np.asarray(task.x), task_id=task.index)
        if drift and stats is not None:
            stats = _drift(method, inner(state), new, task, stats, task_of, drift_bandwidth, feats)
        stats = class_statistics(
            feats, task.y, task.num_classes, shrinkage=shrinkage, covariance=True, previous=stats
        )
        task_of = np.full(task.num_classes, -1) if task_of is None else np.array(task_of)
        task_of[np.unique(task.y)] = task.index
        seen = np.flatnonzero(stats.count)
        if head == "aligned":
            key = jax.random.fold_in(jax.random.key(seed), task.index)
            fitted = align_head(key, new.head, stats, seen, steps=align_steps,
                                learning_rate=align_learning_rate,
                                num_per_class=align_per_class)  # fmt: skip
        else:
            fitted = prototype_head(new.head, stats, seen, metric=metric, ridge=ridge)
        return new._replace(head=fitted, extra=HeadState(new.extra, stats, task_of))

    return method._replace(
        init=init,
        begin_task=lambda state, key, task: method.begin_task(inner(state), key, task),
        end_task=end_task,
        predict=lambda state, x, task_id=None: method.predict(inner(state), x, task_id=task_id),
        diagnostics=lambda state: method.diagnostics(inner(state)),
    )
