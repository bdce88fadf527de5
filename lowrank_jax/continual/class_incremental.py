r"""A class-incremental head for any method (:func:`~lowrank_jax.continual.with_head`) and drift.

:func:`~lowrank_jax.continual.with_head` wraps any
:class:`~lowrank_jax.continual.ContinualMethod`: after each ``end_task`` the features of the
task's training rows (:attr:`~lowrank_jax.continual.ContinualMethod.features`) update stored
per-class statistics and the head is refitted from them by a head value
(:class:`~lowrank_jax.continual.AlignedHead`, :class:`~lowrank_jax.continual.PrototypeHead`, or
any :class:`Head`). The statistics of a class are never recomputed (no exemplars):
:func:`compensate_drift` moves the old classes' means along the backbone's drift on the new
task's rows.

References:
  Zhang et al. 2023 (SLCA); McDonnell et al. 2023 (RanPAC); Yu et al. 2020, "Semantic Drift
  Compensation for Class-Incremental Learning" (CVPR).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from lowrank_jax.continual._src import check_dense_head, in_batches
from lowrank_jax.continual.protocol import ContinualMethod, ContinualState, Task
from lowrank_jax.continual.statistics import ClassStatistics, class_statistics

__all__ = ["Head", "HeadState", "compensate_drift", "with_head"]


class Head(Protocol):
    """What :func:`~lowrank_jax.continual.with_head` takes: a value whose ``fit`` rewrites a
    dense head from class statistics (:class:`~lowrank_jax.continual.AlignedHead`,
    :class:`~lowrank_jax.continual.PrototypeHead`)."""

    def fit(self, key: jax.Array, head: Any, stats: ClassStatistics, classes: Any) -> Any:
        """``head`` with the columns of ``classes`` fitted to ``stats`` (``key``: sampling)."""


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
    """``state.extra`` of a method wrapped by :func:`~lowrank_jax.continual.with_head`.

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


def _features(method: ContinualMethod, state: ContinualState, x: Any, task_id: int):
    """``(N, d)`` float32 host features of ``x``, in equal batches."""
    return in_batches(lambda xb: method.features(state, xb, task_id=task_id), x)


def _drift(method, old_state, new_state, task: Task, stats, task_of, bandwidth):
    """``stats`` with each old task's classes' means moved by :func:`compensate_drift` along the
    drift of the features of that task (``task_id``) on ``task.x``."""
    x = task.x
    mean = stats.mean
    for j in sorted({int(t) for t in task_of[task_of >= 0]}):
        old = _features(method, old_state, x, j)
        new = _features(method, new_state, x, j)
        mean = compensate_drift(mean, old, new, np.flatnonzero(task_of == j), bandwidth=bandwidth)
    return stats._replace(mean=mean)


def with_head(
    method: ContinualMethod,
    *,
    head: Head,
    seed: int = 0,
    shrinkage: float = 0.1,
    drift: bool = True,
    drift_bandwidth: float = 0.5,
) -> ContinualMethod:
    r"""``method`` with a class-incremental head: refitted from class statistics after each task.

    ``end_task`` runs ``method.end_task``, then reads the features of the task's training rows
    under the consolidated model (``method.features`` with ``task_id = task.index``: GR-LoRA's
    new module), records their per-class mean and covariance
    (:func:`~lowrank_jax.continual.statistics.class_statistics`, shrinkage ``ρ``) and replaces
    ``state.head`` over all classes seen so far by ``head.fit`` (key
    ``fold_in(key(seed), task.index)``). The next task starts its training from that head;
    ``predict`` is ``method.predict`` (the head is the model's head). Statistics of a class are
    never recomputed (no exemplars); with ``drift`` the means of each earlier task's classes
    follow the drift of that task's features (``task_id``) on the new task's rows
    (:func:`compensate_drift`). The masked head (trained by masked cross-entropy) is ``method``
    itself, unwrapped.

    Args:
      method: any :class:`~lowrank_jax.continual.ContinualMethod` whose head is a dense layer.
      head: the head's value: :class:`~lowrank_jax.continual.AlignedHead` or
        :class:`~lowrank_jax.continual.PrototypeHead` (any :class:`Head`).
      seed: seed of the keys passed to ``head.fit`` (the alignment's sampling).
      shrinkage: ``ρ`` of the covariances.
      drift, drift_bandwidth: compensate the stored means for the backbone's drift (SDC) and
        its ``bandwidth``.

    Returns:
      A :class:`~lowrank_jax.continual.ContinualMethod` whose ``state.extra`` is a
      :class:`HeadState`.

    Raises:
      TypeError: ``head`` is not a head value.
      ValueError: hyper-parameters out of range.

    Example:
      >>> method = continual.with_head(continual.sequential_lora(model.apply, targets=t),
      ...                              head=continual.AlignedHead())
    """
    if not callable(getattr(head, "fit", None)):
        raise TypeError(
            f"head must be a head value such as continual.AlignedHead() or "
            f"continual.PrototypeHead(), got {head!r}; the masked head is the method unwrapped."
        )
    if not 0 <= shrinkage <= 1 or not drift_bandwidth > 0:
        raise ValueError(
            "shrinkage must lie in [0, 1] and drift_bandwidth be > 0, got "
            f"{shrinkage!r}, {drift_bandwidth!r}."
        )

    def inner(state):
        return state._replace(extra=state.extra.inner)

    def init(variables):
        state = method.init(variables)
        check_dense_head(state.head)
        return state._replace(extra=HeadState(state.extra, None))

    def end_task(state, trainable, frozen, task):
        stats, task_of = state.extra.stats, state.extra.task_of
        new = method.end_task(inner(state), trainable, frozen, task)
        feats = _features(method, new, task.x, task.index)
        if drift and stats is not None:
            stats = _drift(method, inner(state), new, task, stats, task_of, drift_bandwidth)
        stats = class_statistics(
            feats, task.y, task.num_classes, shrinkage=shrinkage, covariance=True, previous=stats
        )
        task_of = np.full(task.num_classes, -1) if task_of is None else np.array(task_of)
        task_of[np.unique(task.y)] = task.index
        key = jax.random.fold_in(jax.random.key(seed), task.index)
        fitted = head.fit(key, new.head, stats, np.flatnonzero(stats.count))
        return new._replace(head=fitted, extra=HeadState(new.extra, stats, task_of))

    return method._replace(
        init=init,
        begin_task=lambda state, key, task: method.begin_task(inner(state), key, task),
        end_task=end_task,
        predict=lambda state, x, task_id=None: method.predict(inner(state), x, task_id=task_id),
        features=lambda state, x, task_id=None: method.features(inner(state), x, task_id=task_id),
        diagnostics=lambda state: method.diagnostics(inner(state)),
    )
