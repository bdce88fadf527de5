r"""Synthetic task streams for continual learning (no download).

:func:`long_stream` is the 20-task class-incremental stream of specs.md §2 (4): every class mean
lies in one shared ``subspace_dim``-dimensional subspace of ``R^dim``, so the input subspaces of
old tasks fill up and orthogonal projection (GPM/InfLoRA) runs out of room for new tasks.
"""

from __future__ import annotations

import numpy as np

from lowrank_jax.data import Dataset

__all__ = ["long_stream"]


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
    for name, v in dict(
        num_tasks=num_tasks,
        classes_per_task=classes_per_task,
        dim=dim,
        subspace_dim=subspace_dim,
        train_per_class=train_per_class,
        test_per_class=test_per_class,
    ).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
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
