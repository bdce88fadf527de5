r"""Benchmark task streams of the continual experiment, built from labelled datasets.

:func:`split_digits` (task-incremental: conflicting pixel- and label-permuted tasks),
:func:`digits_cil` (classes in a random order, equal tasks), :func:`split_mnist` (a base session,
then increments) and :func:`mnist_cil` (every class incremental after a separate base session)
each return a :class:`~lowrank_jax.continual.TaskStream`; their random draws come from ``seed``,
an int or a ``numpy.random.Generator`` drawn from in place::

    train, test = data.load_mnist("train"), data.load_mnist("test")
    stream = continual.split_mnist(train, test, num_tasks=3, train_per_class=100, seed=0)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowrank_jax.continual._src import check_sizes
from lowrank_jax.continual.streams import Split, TaskStream
from lowrank_jax.data import Dataset
from lowrank_jax.data.incremental import split_by_classes

__all__ = ["digits_cil", "mnist_cil", "split_digits", "split_mnist"]


def _flat(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).reshape(len(x), -1)


def _rows(ds: Dataset, keep: np.ndarray, transform=lambda x: x) -> Split:
    return {"x": transform(ds.x[keep]), "y": ds.y[keep].astype(np.int32)}


def _by_classes(
    train: Dataset, test: Dataset, groups: Sequence[np.ndarray], transform=lambda x: x
) -> list[dict[str, Split]]:
    """Per group of classes, the train and test rows of those classes (in dataset order), as
    :func:`lowrank_jax.data.split_by_classes` selects them."""

    def rows(ds: Dataset, classes: np.ndarray) -> Split:
        (task,) = split_by_classes(ds, class_order=classes, classes_per_task=len(classes))
        return {"x": transform(task.x), "y": task.y.astype(np.int32)}

    return [{"train": rows(train, g), "test": rows(test, g)} for g in groups]


def split_digits(
    train: Dataset,
    test: Dataset,
    *,
    num_tasks: int,
    seed: int | np.random.Generator,
    base_classes: int = 5,
) -> TaskStream:
    """Task-incremental stream of conflicting tasks over one ``k``-class dataset (specs §1 (4)).

    Task 0 is the data as is; odd tasks permute the (flattened) pixels, even tasks ``≥ 2``
    permute the labels, each with a fresh permutation; task ``t`` owns the classes
    ``k·t .. k·t + k − 1`` (one head block per task). The base session is the training rows of
    classes ``0 .. base_classes − 1``.

    Args:
      train, test: ``Dataset`` with ``x`` ``(N, ...)`` (flattened to float32 ``(N, d)``) and
        labels in ``[0, k)``, ``k = len(class_names)``.
      num_tasks: ``T``.
      seed: an int or a ``numpy.random.Generator`` (drawn from in place, in task order: the pixel
        permutation of odd tasks, the label permutation of even tasks ``≥ 2``).
      base_classes: classes of the base session.

    Returns:
      A ``"til"`` :class:`~lowrank_jax.continual.TaskStream` over ``C = k·T`` classes.

    Raises:
      ValueError: sizes that are not positive, or ``base_classes > k``.
    """
    check_sizes(num_tasks=num_tasks, base_classes=base_classes)
    k = len(train.class_names)
    if base_classes > k:
        raise ValueError(f"base_classes={base_classes} must be <= the {k} classes of train.")
    rng = np.random.default_rng(seed)
    flat = {"train": _flat(train.x), "test": _flat(test.x)}
    tasks, classes = [], []
    for t in range(num_tasks):
        pixels = (
            np.arange(flat["train"].shape[1])
            if t % 2 == 0
            else rng.permutation(flat["train"].shape[1])
        )
        labels = rng.permutation(k) if (t % 2 == 0 and t > 0) else np.arange(k)
        tasks.append(
            {
                name: {"x": flat[name][:, pixels], "y": (k * t + labels[ds.y]).astype(np.int32)}
                for name, ds in (("train", train), ("test", test))
            }
        )
        classes.append(np.arange(k * t, k * t + k))
    base = _rows(train, train.y < base_classes, _flat)
    return TaskStream(tasks, classes, k * num_tasks, "til", base, base_classes)


def digits_cil(
    train: Dataset, test: Dataset, *, num_tasks: int, seed: int | np.random.Generator
) -> TaskStream:
    """Class-incremental stream: the ``k`` classes in a random order, cut into equal tasks.

    Args:
      train, test: ``Dataset`` with ``x`` ``(N, ...)`` (flattened to float32 ``(N, d)``) and
        labels in ``[0, k)``, ``k = len(class_names)``.
      num_tasks: ``T``, a divisor of ``k``.
      seed: an int or a ``numpy.random.Generator`` (one permutation of the classes is drawn).

    Returns:
      A ``"cil"`` :class:`~lowrank_jax.continual.TaskStream` over ``k`` classes; task ``t``
      holds the sorted classes ``order[t·k/T .. (t+1)·k/T − 1]``, its rows in dataset order;
      no base session.

    Raises:
      ValueError: ``num_tasks`` is not a positive divisor of ``k``.
    """
    check_sizes(num_tasks=num_tasks)
    k = len(train.class_names)
    per_task = k // num_tasks
    if per_task * num_tasks != k:
        raise ValueError(f"num_tasks={num_tasks} must divide the {k} classes.")
    order = np.random.default_rng(seed).permutation(k)
    groups = [np.sort(order[t * per_task : (t + 1) * per_task]) for t in range(num_tasks)]
    return TaskStream(_by_classes(train, test, groups, _flat), groups, k, "cil", None, 0)


def _increments(
    train: Dataset,
    test: Dataset,
    groups: list[np.ndarray],
    train_per_class: int,
    rng: np.random.Generator,
) -> list[dict[str, Split]]:
    """Per group, the first ``train_per_class`` training rows of each of its classes (stored
    order; shuffled with ``rng`` so that a prefix of a task's rows sees all its classes) and all
    its test rows."""
    keep = np.concatenate(
        [np.flatnonzero(train.y == c)[:train_per_class] for c in range(len(train.class_names))]
    )
    return _by_classes(train.take(rng.permutation(keep)), test, groups)


def split_mnist(
    train: Dataset,
    test: Dataset,
    *,
    num_tasks: int,
    train_per_class: int,
    seed: int | np.random.Generator,
    base_classes: int = 5,
) -> TaskStream:
    """Class-incremental stream of a base session plus increments over one ``k``-class dataset.

    The base session is every training row of classes ``0 .. base_classes − 1``; task 0 is those
    classes (a model keeps the base session's head rows: ``keep_base_head``) and tasks
    ``1 .. T − 1`` split the other classes, in a random order, into near-equal groups
    (``numpy.array_split``). A task trains on ``train_per_class`` rows per class and is tested on
    all test rows of its classes.

    Args:
      train, test: ``Dataset`` with labels in ``[0, k)`` (images keep their layout).
      num_tasks: ``T ≥ 2``.
      train_per_class: training rows per class in the tasks.
      seed: an int or a ``numpy.random.Generator`` (drawn from in place: the order of the
        incremental classes, then the shuffle of the training rows).
      base_classes: classes of the base session (and of task 0).

    Returns:
      A ``"cil"`` :class:`~lowrank_jax.continual.TaskStream` over ``k`` classes, with
      ``base_classes`` base classes.

    Raises:
      ValueError: sizes that are not positive, ``num_tasks < 2``, or an increment of no class.
    """
    check_sizes(num_tasks=num_tasks, train_per_class=train_per_class, base_classes=base_classes)
    k = len(train.class_names)
    if num_tasks < 2 or k - base_classes < num_tasks - 1:
        raise ValueError(
            f"num_tasks={num_tasks} needs 1 base task and {num_tasks - 1} increments of the "
            f"{k - base_classes} classes beyond base_classes={base_classes}."
        )
    rng = np.random.default_rng(seed)
    rest = rng.permutation(np.arange(base_classes, k))
    groups = [np.arange(base_classes)]
    groups += [np.sort(g) for g in np.array_split(rest, num_tasks - 1)]
    tasks = _increments(train, test, groups, train_per_class, rng)
    base = _rows(train, train.y < base_classes)
    return TaskStream(tasks, groups, k, "cil", base, base_classes, keep_base_head=True)


def mnist_cil(
    train: Dataset,
    test: Dataset,
    base: Dataset,
    *,
    num_tasks: int,
    train_per_class: int,
    seed: int | np.random.Generator,
) -> TaskStream:
    """Class-incremental stream in which every class is incremental, after a separate base session.

    The ``k`` classes of ``train`` in a random order are split into ``num_tasks`` near-equal
    groups (``numpy.array_split``); a task trains on ``train_per_class`` rows per class and is
    tested on all test rows of its classes. The base session (e.g. Fashion-MNIST before MNIST
    digits) is all of ``base``; its head is a throwaway (``keep_base_head=False``).

    Args:
      train, test: ``Dataset`` with labels in ``[0, k)`` (images keep their layout).
      base: the pretraining ``Dataset`` (its own classes, ``len(base.class_names)`` of them).
      num_tasks: ``T``, at most ``k``.
      train_per_class: training rows per class in the tasks.
      seed: an int or a ``numpy.random.Generator`` (drawn from in place: the class order, then
        the shuffle of the training rows).

    Returns:
      A ``"cil"`` :class:`~lowrank_jax.continual.TaskStream` over ``k`` classes.

    Raises:
      ValueError: sizes that are not positive or ``num_tasks > k``.
    """
    check_sizes(num_tasks=num_tasks, train_per_class=train_per_class)
    k = len(train.class_names)
    if num_tasks > k:
        raise ValueError(f"num_tasks={num_tasks} must be <= the {k} classes of train.")
    rng = np.random.default_rng(seed)
    groups = [np.sort(g) for g in np.array_split(rng.permutation(k), num_tasks)]
    tasks = _increments(train, test, groups, train_per_class, rng)
    base_rows = {"x": base.x, "y": base.y.astype(np.int32)}
    return TaskStream(tasks, groups, k, "cil", base_rows, len(base.class_names))
