"""The synthetic instruction-like selection pool of specs §11 (4) (a reconstruction).

Twelve source tasks, each a random teacher MLP ``32 → 64 → 10`` (tanh) labelling Gaussian inputs
into 10 classes. Every task has an "instruction" code ``c_t`` (a fixed random vector of norm
``code_norm``) added to its inputs, ``x = z + c_t`` with ``z ~ N(0, I)``, so that one model can
tell the tasks apart. The target task ``T`` mixes tasks 0, 1, 2, each under ``rotations_per_task``
small input rotations ``R = expm(θ·A)`` (``A`` skew-symmetric with unit Frobenius norm): subtask
``(t, j)`` labels ``x = z + c_t`` by ``teacher_t(R_{t,j} z)``. The pool holds a fraction
``relevant`` of target examples, ``noisy`` of target inputs with uniformly random labels
("label-noised copies of T-like tasks") and the rest from the nine other tasks (irrelevant). The
few-shot validation set has ``val_per_subtask`` examples per subtask (9 × 5); the base model is
pre-trained on four unrelated tasks (3-6).

specs §11 names the pieces (12 teachers, 3-task rotated mixture, 15% / 10% / rest, 9 × 5
validation, 4 pre-training tasks); the task codes, teacher widths and rotation form are this
module's choices.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import scipy.linalg

__all__ = ["POOL_KINDS", "SyntheticPool", "make_synthetic_pool"]

POOL_KINDS = ("relevant", "noisy", "irrelevant")


class SyntheticPool(NamedTuple):
    """Arrays of the synthetic selection problem (float32 inputs ``(·, dim)``, int32 labels).

    ``pool_kind`` indexes ``POOL_KINDS``; ``val_subtask`` is in ``[0, 3·rotations_per_task)``.
    """

    pool_x: np.ndarray
    pool_y: np.ndarray
    pool_kind: np.ndarray
    val_x: np.ndarray
    val_y: np.ndarray
    val_subtask: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    pretrain_x: np.ndarray
    pretrain_y: np.ndarray


def make_synthetic_pool(
    seed: int,
    *,
    num_pool: int = 20000,
    relevant: float = 0.15,
    noisy: float = 0.10,
    num_tasks: int = 12,
    dim: int = 32,
    num_classes: int = 10,
    rotations_per_task: int = 3,
    rotation: float = 0.3,
    code_norm: float = 3.0,
    val_per_subtask: int = 5,
    num_test: int = 2000,
    num_pretrain: int = 8000,
) -> SyntheticPool:
    """Draws the pool, validation, test and pre-training sets (numpy, from ``seed``).

    Raises:
      ValueError: for fractions outside ``[0, 1]`` that sum above 1, or fewer than 7 tasks.
    """
    if not (0 <= relevant <= 1 and 0 <= noisy <= 1 and relevant + noisy <= 1):
        raise ValueError(f"relevant={relevant}, noisy={noisy} must be fractions summing to <= 1.")
    if num_tasks < 7:
        raise ValueError(f"num_tasks must be >= 7 (3 target + 4 pre-training); got {num_tasks}.")
    rng = np.random.default_rng([seed, 2026])
    hidden = 64
    w1 = rng.normal(size=(num_tasks, dim, hidden)) / np.sqrt(dim)
    w2 = rng.normal(size=(num_tasks, hidden, num_classes)) / np.sqrt(hidden)
    codes = rng.normal(size=(num_tasks, dim))
    codes *= code_norm / np.linalg.norm(codes, axis=1, keepdims=True)
    rots = []
    for _ in range(3 * rotations_per_task):
        a = rng.normal(size=(dim, dim))
        a = a - a.T
        rots.append(scipy.linalg.expm(rotation * a / np.linalg.norm(a)))
    rots = np.stack(rots)

    def teacher(t, z):
        return np.argmax(np.tanh(z @ w1[t]) @ w2[t], -1)

    def task(t, n):
        z = rng.normal(size=(n, dim))
        return z + codes[t], teacher(t, z)

    def target(n, subtask=None):
        sub = rng.integers(0, 3 * rotations_per_task, n) if subtask is None else subtask
        z = rng.normal(size=(n, dim))
        y = np.empty(n, np.int64)
        for s in np.unique(sub):
            m = sub == s
            y[m] = teacher(s // rotations_per_task, z[m] @ rots[s].T)
        return z + codes[sub // rotations_per_task], y, sub

    n_rel, n_noisy = int(round(relevant * num_pool)), int(round(noisy * num_pool))
    n_irr = num_pool - n_rel - n_noisy
    rel_x, rel_y, _ = target(n_rel)
    noisy_x, _, _ = target(n_noisy)
    noisy_y = rng.integers(0, num_classes, n_noisy)
    others = np.arange(3, num_tasks)
    irr_t = rng.choice(others, n_irr)
    irr = [task(t, int((irr_t == t).sum())) for t in others]
    pool_x = np.concatenate([rel_x, noisy_x, *[x for x, _ in irr]])
    pool_y = np.concatenate([rel_y, noisy_y, *[y for _, y in irr]])
    kind = np.repeat(np.arange(3), [n_rel, n_noisy, n_irr])
    order = rng.permutation(num_pool)
    val_sub = np.repeat(np.arange(3 * rotations_per_task), val_per_subtask)
    val_x, val_y, _ = target(len(val_sub), val_sub)
    test_x, test_y, _ = target(num_test)
    pre = [task(t, num_pretrain // 4) for t in range(3, 7)]
    f32, i32 = (lambda a: a.astype(np.float32)), (lambda a: a.astype(np.int32))  # noqa: E731
    return SyntheticPool(
        pool_x=f32(pool_x[order]), pool_y=i32(pool_y[order]), pool_kind=i32(kind[order]),
        val_x=f32(val_x), val_y=i32(val_y), val_subtask=i32(val_sub),
        test_x=f32(test_x), test_y=i32(test_y),
        pretrain_x=f32(np.concatenate([x for x, _ in pre])),
        pretrain_y=i32(np.concatenate([y for _, y in pre])),
    )  # fmt: skip
