r"""Task streams for continual learning (no download).

:func:`long_stream` is the 20-task class-incremental stream of specs.md §2 (4): every class mean
lies in one shared ``subspace_dim``-dimensional subspace of ``R^dim``, so the input subspaces of
old tasks fill up and orthogonal projection (GPM/InfLoRA) runs out of room for new tasks.

A :class:`TaskStream` holds per-task train/test arrays and each task's classes; the benchmark
builders over labelled datasets live in :mod:`lowrank_jax.continual.benchmarks`, and
:func:`class_incremental_stream` builds one from a labelled pool with a fixed test holdout (e.g.
the Shakespeare plays). :func:`training_arrays` gives the rows a loop trains on for one task (or
several, jointly)::

    train, test = data.load_mnist("train"), data.load_mnist("test")
    stream = continual.split_mnist(train, test, num_tasks=3, train_per_class=100, seed=0)
    for t in range(len(stream.tasks)):
        arrays = training_arrays(stream, [t])      # {"x", "y", "mask"}
        ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lowrank_jax.continual._src import check_sizes
from lowrank_jax.data import Dataset
from lowrank_jax.data.incremental import split_by_classes

__all__ = ["TaskStream", "class_incremental_stream", "long_stream", "training_arrays"]

Split = dict[str, np.ndarray]


@dataclasses.dataclass
class TaskStream:
    """A task stream: per-task train/test arrays and the classes of each task (host arrays).

    Attributes:
      tasks: per task ``t``, ``{"train": {"x": (N, ...), "y": (N,) int32}, "test": {...}}`` with
        global labels.
      task_classes: per task ``t``, ``(k_t,)`` its classes.
      num_classes: ``C``, the classes of all tasks (the head's width).
      protocol: ``"til"`` (task-incremental: the task id is given at test time) or ``"cil"``.
      base: the pretraining session ``{"x", "y"}`` or None.
      base_classes: the classes of the base session (its head's width; 0 without one).
      keep_base_head: the base session's head rows ``0 .. base_classes-1`` are those of the
        stream's classes ``0 .. base_classes-1`` (kept in the full head) rather than a throwaway.
    """

    tasks: list[dict[str, Split]]
    task_classes: list[np.ndarray]
    num_classes: int
    protocol: str
    base: Split | None
    base_classes: int
    keep_base_head: bool = False


def class_incremental_stream(
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_classes: int,
    num_tasks: int,
    classes_per_task: int,
    test_per_class: int,
    seed: int | np.random.Generator,
    split_seed: int = 0,
) -> TaskStream:
    """Class-incremental stream from one labelled pool, with a fixed test holdout per class.

    ``test_per_class`` rows of each class are held out for testing, drawn from
    ``numpy.random.default_rng(split_seed)`` (the same split for every ``seed``); the classes in a
    random order are cut into ``num_tasks`` tasks of ``classes_per_task`` (classes beyond
    ``num_tasks · classes_per_task`` are left out). A task's train and test rows are shuffled, so
    a prefix of them sees all its classes.

    Args:
      x: ``(N, ...)`` examples.
      y: ``(N,)`` int labels in ``[0, num_classes)``.
      num_classes: ``C``, the classes of the pool (the head's width).
      num_tasks: ``T``.
      classes_per_task: ``k``, with ``T · k ≤ C``.
      test_per_class: held-out rows per class (every class needs more rows than that).
      seed: an int or a ``numpy.random.Generator`` (drawn from in place: the class order, then
        each task's train and test shuffles).
      split_seed: the seed of the test holdout.

    Returns:
      A ``"cil"`` :class:`~lowrank_jax.continual.TaskStream` over ``C`` classes, without a base
      session.

    Raises:
      ValueError: sizes that are not positive, ``T · k > C``, or a class with no more than
        ``test_per_class`` rows.
    """
    check_sizes(
        num_classes=num_classes,
        num_tasks=num_tasks,
        classes_per_task=classes_per_task,
        test_per_class=test_per_class,
    )
    if num_tasks * classes_per_task > num_classes:
        raise ValueError(
            f"num_tasks={num_tasks} x classes_per_task={classes_per_task} exceeds the "
            f"{num_classes} classes."
        )
    y = np.asarray(y)
    split_rng = np.random.default_rng(split_seed)
    is_test = np.zeros(len(y), bool)
    for c in range(num_classes):
        idx = np.flatnonzero(y == c)
        if len(idx) <= test_per_class:
            raise ValueError(
                f"class {c} has {len(idx)} rows: more than test_per_class={test_per_class} needed."
            )
        is_test[split_rng.choice(idx, test_per_class, replace=False)] = True
    rng = np.random.default_rng(seed)
    k = classes_per_task
    order = rng.permutation(num_classes)[: k * num_tasks]
    groups = [np.sort(order[t * k : (t + 1) * k]) for t in range(num_tasks)]
    names = tuple(str(c) for c in range(num_classes))
    parts = [
        split_by_classes(Dataset(x[rows], y[rows], names), class_order=order, classes_per_task=k)
        for rows in (~is_test, is_test)
    ]
    tasks = []
    for train, test in zip(*parts, strict=True):
        part = {}
        for name, ds in (("train", train), ("test", test)):
            keep = rng.permutation(len(ds.y))
            part[name] = {"x": ds.x[keep], "y": ds.y[keep].astype(np.int32)}
        tasks.append(part)
    return TaskStream(tasks, groups, num_classes, "cil", None, 0)


def training_arrays(stream: TaskStream, tasks: Sequence[int]) -> Split:
    """The training rows of ``tasks`` with per-row class masks, for masked cross-entropy.

    A row's mask is its task's classes; for several tasks trained at once (joint training) it is
    every class under the class-incremental protocol, its own task's classes under the
    task-incremental one.

    Args:
      stream: the stream.
      tasks: task indices, e.g. ``[t]``.

    Returns:
      ``{"x": (N, ...), "y": (N,) int32, "mask": (N, C) bool}``, the tasks' rows in order.

    Raises:
      ValueError: ``tasks`` is empty or names a task the stream does not have.
    """
    if not len(tasks) or any(not 0 <= t < len(stream.tasks) for t in tasks):
        raise ValueError(f"tasks={list(tasks)!r} must be indices of the {len(stream.tasks)} tasks.")
    xs, ys, masks = [], [], []
    for t in tasks:
        tr = stream.tasks[t]["train"]
        mask = np.zeros(stream.num_classes, bool)
        if stream.protocol == "til" or len(tasks) == 1:
            mask[stream.task_classes[t]] = True
        else:
            mask[:] = True
        xs.append(tr["x"])
        ys.append(tr["y"])
        masks.append(np.repeat(mask[None], len(tr["y"]), 0))
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "mask": np.concatenate(masks)}


def long_stream(
    *,
    seed: int = 0,
    num_tasks: int = 20,
    classes_per_task: int = 5,
    dim: int = 64,
    subspace_dim: int = 32,
    train_per_class: int = 100,
    test_per_class: int = 50,
    separation: float = 3.0,
    noise: float = 1.0,
) -> tuple[list[tuple[Dataset, Dataset]], np.ndarray]:
    r"""A class-incremental stream of Gaussian classes whose means share one subspace.

    Class ``c`` has mean ``μ_c = separation · P g_c`` with ``P: (dim, subspace_dim)`` a fixed
    orthonormal basis and ``g_c ~ N(0, I/subspace_dim)``; examples are
    ``x = μ_c + noise · (P h + 0.3 ε)`` with ``h ~ N(0, I_{subspace_dim})``, ``ε ~ N(0, I_dim)``
    (most of the variance inside the shared subspace, a little everywhere).

    Args:
      seed: the stream's seed (means, basis and samples).
      num_tasks: ``T``.
      classes_per_task: classes per task (class ids ``t·k .. t·k + k − 1`` for task ``t``).
      dim: input dimension.
      subspace_dim: dimension of the shared subspace of the class means, ``≤ dim``.
      train_per_class, test_per_class: examples per class.
      separation: scale of the class means relative to the noise.
      noise: within-class standard deviation in the subspace.

    Returns:
      ``([(train, test) per task], task_of_class: (C,))`` with ``Dataset.x`` float32 ``(N, dim)``
      and global labels over ``C = T · k`` classes.

    Raises:
      ValueError: sizes that are not positive or ``subspace_dim > dim``.
    """
    check_sizes(
        num_tasks=num_tasks,
        classes_per_task=classes_per_task,
        dim=dim,
        subspace_dim=subspace_dim,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
    )
    if subspace_dim > dim:
        raise ValueError(f"subspace_dim={subspace_dim} must be <= dim={dim}.")
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((dim, subspace_dim)))
    num_classes = num_tasks * classes_per_task
    g = rng.standard_normal((num_classes, subspace_dim)) / np.sqrt(subspace_dim)
    means = separation * (g @ basis.T)  # ||mu_c|| ~ separation
    names = tuple(f"class_{c}" for c in range(num_classes))

    def sample(c: int, n: int) -> np.ndarray:
        h = rng.standard_normal((n, subspace_dim)) @ basis.T
        e = rng.standard_normal((n, dim))
        return (means[c] + noise * (h + 0.3 * e)).astype(np.float32)

    tasks = []
    for t in range(num_tasks):
        classes = range(t * classes_per_task, (t + 1) * classes_per_task)
        parts = []
        for per_class in (train_per_class, test_per_class):
            x = np.concatenate([sample(c, per_class) for c in classes])
            y = np.repeat(np.asarray(classes, np.int32), per_class)
            parts.append(Dataset(x, y, names))
        tasks.append((parts[0], parts[1]))
    task_of_class = np.repeat(np.arange(num_tasks), classes_per_task)
    return tasks, task_of_class
