"""Test accuracy of a continual method on the tasks seen so far: one row of the accuracy matrix.

After task ``t`` a loop evaluates the method on the test sets of tasks ``0..t``; row ``t`` of the
accuracy matrix ``R`` (:func:`~lowrank_jax.continual.summarize`) is the result::

    for t, task in enumerate(tasks):
        ...                                               # begin_task, train, end_task
        r[t, : t + 1], selection = evaluate_tasks(
            method, state, tests[: t + 1], classes[: t + 1], num_classes=C)

or, on a :class:`~lowrank_jax.continual.TaskStream`, ``evaluate_stream(method, state, stream, t)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lowrank_jax.continual.protocol import ContinualMethod, ContinualState
from lowrank_jax.continual.streams import TaskStream

__all__ = ["evaluate_stream", "evaluate_tasks"]


def evaluate_tasks(
    method: ContinualMethod,
    state: ContinualState,
    tests: Sequence[Mapping[str, Any]],
    task_classes: Sequence[Any],
    *,
    num_classes: int,
    task_incremental: bool = False,
    batch_size: int = 256,
) -> tuple[list[float], float]:
    r"""Accuracy of ``method`` on the test set of each task seen so far.

    Task ``j``'s examples go through ``method.predict`` in consecutive batches of ``batch_size``;
    an example is correct when ``argmax_{c ∈ S_j} logits[c] = y``, with ``S_j`` the classes of
    task ``j`` and ``task_id = j`` given to ``predict`` (task-incremental), or ``S_j`` the classes
    of all tasks in ``tests`` and no task id (class-incremental).

    Args:
      method: the continual method.
      state: its state after the last task in ``tests``.
      tests: per task ``j``, ``{"x": (N_j, ...), "y": (N_j,) int}`` test examples (global labels);
        ``"x"`` an array or a row-sliceable sequence read a batch at a time
        (:class:`lowrank_jax.data.ImageRows`).
      task_classes: per task ``j``, the classes of task ``j`` (ints in ``[0, num_classes)``).
      num_classes: ``C``, the width of the logits.
      task_incremental: give ``predict`` the task id and restrict each task to its own classes.
      batch_size: examples per ``predict`` call.

    Returns:
      ``(accuracies, selection_accuracy)``: one accuracy per task of ``tests``, in order, and the
      fraction of examples for which the module the method selected (``predict``'s second output)
      is their task, NaN if the method selects none.

    Raises:
      ValueError: if ``tests`` is empty or not as long as ``task_classes``, a test set is empty,
        or ``batch_size`` or ``num_classes`` is not positive.
    """
    if not tests or len(tests) != len(task_classes):
        raise ValueError(
            f"tests ({len(tests)}) and task_classes ({len(task_classes)}) must be non-empty and "
            "have one entry per task."
        )
    for name, value in (("batch_size", batch_size), ("num_classes", num_classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    seen = np.zeros(num_classes, bool)
    for classes in task_classes:
        seen[np.asarray(classes)] = True
    accs, selected_ok, total = [], 0, 0
    for j, test in enumerate(tests):
        if not len(test["y"]):
            raise ValueError(f"the test set of task {j} is empty.")
        eval_mask = seen
        if task_incremental:
            eval_mask = np.zeros(num_classes, bool)
            eval_mask[np.asarray(task_classes[j])] = True
        correct = 0
        for i in range(0, len(test["y"]), batch_size):
            x, y = test["x"][i : i + batch_size], test["y"][i : i + batch_size]
            logits, selected = method.predict(state, x, task_id=j if task_incremental else None)
            if selected is not None:
                selected_ok += int(np.sum(selected == j))
                total += len(selected)
            pred = np.argmax(np.where(eval_mask, np.asarray(logits), -np.inf), -1)
            correct += int(np.sum(pred == y))
        accs.append(correct / len(test["y"]))
    return accs, (selected_ok / total if total else math.nan)


def evaluate_stream(
    method: ContinualMethod,
    state: ContinualState,
    stream: TaskStream,
    t: int,
    *,
    batch_size: int = 256,
) -> tuple[list[float], float]:
    """Accuracy of ``method`` on the test sets of tasks ``0..t`` of ``stream`` (row ``t`` of ``R``).

    :func:`~lowrank_jax.continual.evaluation.evaluate_tasks` on the stream's test splits and task
    classes, with the task id given to ``predict`` under the task-incremental protocol
    (``stream.protocol == "til"``).

    Args:
      method: the continual method.
      state: its state after task ``t``.
      stream: the task stream.
      t: the last task to evaluate, ``0 ≤ t < len(stream.tasks)``.
      batch_size: examples per ``predict`` call.

    Returns:
      ``(accuracies, selection_accuracy)``: ``t + 1`` accuracies and the module-selection
      accuracy (NaN if the method selects none), as
      :func:`~lowrank_jax.continual.evaluation.evaluate_tasks`.

    Raises:
      ValueError: ``t`` is not a task of the stream, or as
        :func:`~lowrank_jax.continual.evaluation.evaluate_tasks`.
    """
    if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < len(stream.tasks):
        raise ValueError(f"t={t!r} must be a task index in [0, {len(stream.tasks)}).")
    return evaluate_tasks(
        method,
        state,
        [task["test"] for task in stream.tasks[: t + 1]],
        stream.task_classes[: t + 1],
        num_classes=stream.num_classes,
        task_incremental=stream.protocol == "til",
        batch_size=batch_size,
    )
