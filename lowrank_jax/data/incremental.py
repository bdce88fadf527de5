"""Class-incremental task streams: a base session followed by increments of new classes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lowrank_jax.data.records import Dataset

__all__ = ["split_by_classes", "task_classes"]


def _class_order(dataset: Dataset, class_order, seed) -> np.ndarray:
    present = np.unique(dataset.y)
    if class_order is not None and seed is not None:
        raise ValueError("Pass class_order or seed (to shuffle the classes), not both.")
    if class_order is None:
        if seed is None:
            return present
        return np.random.default_rng(seed).permutation(present)
    order = np.asarray(class_order)
    if order.ndim != 1 or order.size == 0 or not np.issubdtype(order.dtype, np.integer):
        raise ValueError(
            f"class_order must be a non-empty 1-D sequence of class ids; got {order!r}."
        )
    if np.unique(order).size != order.size:
        raise ValueError(f"class_order repeats classes: {order.tolist()}.")
    absent = sorted(set(order.tolist()) - set(present.tolist()))
    if absent:
        raise ValueError(
            f"class_order names classes {absent} that have no examples; the dataset has classes "
            f"{present.tolist()}."
        )
    return order


def task_classes(
    num_classes: int,
    *,
    classes_per_task: int | None = None,
    base_classes: int | None = None,
    increment: int | None = None,
) -> list[range]:
    """Positions (in the class order) of the classes of each task.

    Either ``classes_per_task=k`` (tasks of ``k`` classes) or ``base_classes=B`` and
    ``increment=I`` (a base session of ``B`` classes, then tasks of ``I`` new classes).

    Raises:
      ValueError: if the sizes do not tile ``num_classes`` exactly.
    """
    if classes_per_task is not None:
        if base_classes is not None or increment is not None:
            raise ValueError("Pass classes_per_task, or base_classes and increment, not both.")
        base_classes = increment = classes_per_task
    elif base_classes is None or increment is None:
        raise ValueError(
            "Say how to group classes: classes_per_task=k, or base_classes=B with increment=I."
        )
    for name, value in (("base_classes", base_classes), ("increment", increment)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    if base_classes > num_classes or (num_classes - base_classes) % increment:
        raise ValueError(
            f"{num_classes} classes cannot be split into a base session of {base_classes} and "
            f"increments of {increment}; choose sizes with base + k * increment = {num_classes} "
            "(or pass class_order to use a subset of the classes)."
        )
    bounds = [0, base_classes, *range(base_classes + increment, num_classes + 1, increment)]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def split_by_classes(
    dataset: Dataset,
    *,
    classes_per_task: int | None = None,
    base_classes: int | None = None,
    increment: int | None = None,
    class_order: Sequence[int] | None = None,
    seed: int | None = None,
) -> list[Dataset]:
    """Splits a labelled dataset into class-incremental tasks with disjoint classes.

    The classes are put in an order (``class_order``; a permutation drawn from ``seed``; or
    ascending ids) and cut into a base session of ``base_classes`` classes followed by tasks of
    ``increment`` new classes each, or into equal tasks of ``classes_per_task``. Task ``t`` holds
    every example whose class is in its group, in the dataset's order. Labels stay global (ids into
    the full ``class_names``), as class-incremental learning predicts over all classes seen so far.

    Args:
      dataset: a labelled ``Dataset``.
      classes_per_task: classes per task (equal tasks).
      base_classes: classes in the first (base) session; needs ``increment``.
      increment: new classes per later task.
      class_order: the classes to use, in order (a subset is allowed: others are left out);
        default all classes that have examples, ascending.
      seed: shuffle the classes with ``np.random.default_rng(seed)`` instead (the usual random
        class order of CIL benchmarks); excludes ``class_order``.

    Returns:
      One ``Dataset`` per task, base session first.

    Raises:
      ValueError: if the task sizes do not tile the classes exactly, or ``class_order`` repeats or
        names classes without examples.

    References:
      Rebuffi et al. (2017), iCaRL: incremental classifier and representation learning, CVPR
      (equal tasks in a seeded class order); Hou et al. (2019), Learning a unified classifier
      incrementally via rebalancing, CVPR (a base session of half the classes, then increments).

    Example:
      >>> tasks = split_by_classes(load_digits(), base_classes=4, increment=2)
      >>> [sorted(set(t.y.tolist())) for t in tasks]
      [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9]]
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"split_by_classes expects a Dataset; got {type(dataset).__name__}.")
    order = _class_order(dataset, class_order, seed)
    groups = task_classes(
        order.size,
        classes_per_task=classes_per_task,
        base_classes=base_classes,
        increment=increment,
    )
    return [dataset.take(np.isin(dataset.y, order[g.start : g.stop])) for g in groups]
