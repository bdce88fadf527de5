"""The real-data task pools of the multitask-limits experiment (``multitask_limits.py``): MNIST
digit pairs in a PCA space and the Dutch school classes of ``MASS::nlschools``, as the threshold
families of :mod:`lowrank_jax.analysis.multitask` read them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lowrank_jax import data
from lowrank_jax.analysis.multitask import group_pool, rank_scores

__all__ = ["mnist_pool", "nlschools_pool"]


def mnist_pool(config: Any) -> dict:
    """1-D LDA scores of two MNIST digits, rank-transformed to [0, 1] (fit half / pool / test)."""
    a, b = config.mnist.digits
    tr, te = data.load_mnist("train"), data.load_mnist("test")

    def pick(ds):
        keep = (ds.y == a) | (ds.y == b)
        return ds.x[keep].reshape(keep.sum(), -1).astype(np.float64), (ds.y[keep] == b) * 1.0

    x, y = pick(tr)
    xt, yt = pick(te)
    rng = np.random.default_rng(config.seed)
    perm = rng.permutation(len(x))
    fit, pool = perm[: len(x) // 2], perm[len(x) // 2 :]
    mu = x[fit].mean(0)
    _, _, vt = np.linalg.svd(x[fit] - mu, full_matrices=False)
    proj = vt[: config.mnist.pca_dim].T
    z = (x[fit] - mu) @ proj
    m0, m1 = z[y[fit] == 0].mean(0), z[y[fit] == 1].mean(0)
    cov = np.cov(z[y[fit] == 0].T) + np.cov(z[y[fit] == 1].T)
    w = np.linalg.solve(cov + 1e-3 * np.eye(len(cov)), m1 - m0)
    ref = np.sort(z @ w)

    def score(xx):
        return np.searchsorted(ref, ((xx - mu) @ proj) @ w) / len(ref)

    s_pool, s_test = score(x[pool]), score(xt)
    grid = np.linspace(0, 1, 1001)
    errs = [np.mean((s_pool >= t) != y[pool]) for t in grid]
    return {
        "scores": s_pool.astype(np.float32),
        "labels": y[pool].astype(np.float32),
        "test": (s_test, yt),
        "center": float(grid[int(np.argmin(errs))]),
        "pool_error": float(min(errs)),
    }


def nlschools_pool(config: Any) -> dict:
    """Pupils of ``MASS::nlschools`` as real tasks (one per class): score = rank of verbal IQ in
    [0, 1], label = language score above the median; ``nlschools.num_target_groups`` classes are
    the target population (see ``analysis.multitask.group_pool``)."""
    d = data.load_nlschools()
    return group_pool(
        rank_scores(d.iq),
        (d.lang > np.median(d.lang)).astype(np.float32),
        d.group,
        num_target_groups=config.nlschools.num_target_groups,
        seed=config.seed,
    )
