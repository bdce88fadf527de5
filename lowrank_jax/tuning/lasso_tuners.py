r"""Data-driven tuning of ``p`` tied regularisation weights from ``N`` instances (P12).

The learner of specs §12 picks :math:`\hat α = \arg\min_α \frac1N \sum_i u(x_i, α)` over
``α ∈ [low, high]^p`` (log scale), where ``u`` is an instance's validation loss after the inner
solve (:func:`lowrank_jax.tuning.lasso.validation_losses`). The tuners here see that empirical
risk only through a *batched objective* ``f(alphas (C, p)) -> (C,)`` over the box
:class:`~lowrank_jax.tuning.search.LogBox` ``[low, high]^p`` and spend an explicit budget of
evaluations (one evaluation = one candidate ``α`` solved on all ``N`` instances), so every tuner
gets the same budget; each returns a :class:`~lowrank_jax.tuning.search.SearchResult` with
``goal="min"`` (``best_point`` is ``α̂``, ``best_value`` its empirical risk):

* :func:`log_grid_search`: ``p = 1``, a log-spaced grid of ``budget`` points;
* :func:`~lowrank_jax.tuning.search.random_search` + :func:`coordinate_refine`
  (= :func:`random_refine_search`): log-uniform candidates, then cyclic coordinate search on a
  shrinking log-grid around the incumbent;
* :func:`~lowrank_jax.tuning.search.tpe_search`: Optuna's TPE sampler (the peer tuner;
  ``optuna`` is imported lazily and is a ``peers`` dependency), one candidate per trial.

:func:`empirical_risk` builds ``f`` from ``N`` instances (the mean of :func:`instance_losses`). The quantities of the guarantee are then
the generalisation gap ``R(α̂) − R̂_N(α̂)`` (true risk ``R`` estimated on fresh instances) and the
excess risk ``R(α̂) − min_α R(α)``.

References:
  P12 (specs §12): arXiv 2602.02406. Optuna: Akiba et al. (2019); TPE: Bergstra et al. (2011).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from lowrank_jax.tuning import lasso
from lowrank_jax.tuning.search import (
    LogBox,
    SearchResult,
    check_range,
    evaluate_batch,
    log_grid,
    random_search,
    search_result,
)

__all__ = [
    "coordinate_refine",
    "empirical_risk",
    "instance_losses",
    "log_grid_search",
    "random_refine_search",
]

Objective = Callable[[np.ndarray], np.ndarray]


def _power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def instance_losses(
    train: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike] | lasso.Prepared,
    val: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    penalty: lasso.Penalty,
    *,
    num_iters: int = 300,
    ridge: float = 0.0,
    chunk_size: int | None = None,
    pad: bool = False,
) -> Callable[..., np.ndarray]:
    """The per-instance losses ``g(alphas, n) = [u(x_i, tie(α_c))]_{i < n, c}`` of ``N`` instances.

    The matrix behind every tuner's objective (:func:`empirical_risk` is its mean over
    instances) and behind the true risk of chosen weights on fresh instances. An instance's loss
    does not depend on the other instances or candidates, so ``g(alphas, n)`` equals the first
    ``n`` rows of ``g(alphas)``; with ``pad=True`` the number of candidates and of instances
    solved is rounded up to a power of two (copies of the last candidate, the next instances),
    which changes no returned loss but leaves few distinct shapes, hence few compilations, when
    ``C`` and ``n`` vary (coordinate refinement, growing ``N``).

    Args:
      train: ``(X (N, n, d), y (N, n))``, or their :func:`lasso.prepare_instances` (prepared
        once here otherwise; NumPy arrays avoid compiling a slice per ``n``).
      val: ``(X (N, m, d), y (N, m))``.
      penalty: :func:`lasso.group_lasso` or :func:`lasso.fused_lasso`.
      num_iters, ridge, chunk_size: as in :func:`lasso.validation_losses`.
      pad: solve power-of-two batches of candidates and instances (same results).

    Returns:
      ``g(alphas (C, p), n=None) -> (n, C)`` float64 (``n = N`` by default); ``p`` must divide
      the penalty's number of weights (:func:`lasso.tie_weights`).

    Raises:
      ValueError: (from ``g``) shapes that do not match, or a ``p`` that does not divide the
        weights.

    Example:
      >>> g = instance_losses((xt, yt), (xv, yv), lasso.group_lasso((5,) * 8), pad=True)
      >>> g(np.ones((3, 4)), 10).shape
      (10, 3)
    """
    prep = train if isinstance(train, lasso.Prepared) else lasso.prepare_instances(
        train, penalty, ridge=ridge
    )  # fmt: skip

    def g(alphas: np.ndarray, n: int | None = None) -> np.ndarray:
        alphas = np.asarray(alphas)
        c = len(alphas)
        if pad:
            alphas = np.concatenate([alphas, np.repeat(alphas[-1:], _power_of_two(c) - c, axis=0)])
        p_, v = prep, val
        if n is not None:
            k = _power_of_two(n) if pad else int(n)
            p_, v = jax.tree.map(lambda a: a[:k], (prep, tuple(val)))
        w = lasso.tie_weights(np.asarray(alphas, np.float32), num_weights=penalty.num_weights)
        u = lasso.validation_losses(p_, v, w, penalty, num_iters=num_iters, chunk_size=chunk_size)
        return np.asarray(u, np.float64)[:n, :c]

    return g


def empirical_risk(
    train: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    val: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    penalty: lasso.Penalty,
    *,
    num_iters: int = 300,
    ridge: float = 0.0,
    chunk_size: int | None = None,
) -> Objective:
    """The batched objective ``f(alphas) = (1/N) Σ_i u(x_i, tie(α))`` of ``N`` instances.

    Args:
      train: ``(X (N, n, d), y (N, n))``; ``val``: ``(X (N, m, d), y (N, m))``.
      penalty: :func:`lasso.group_lasso` or :func:`lasso.fused_lasso`.
      num_iters, ridge, chunk_size: as in :func:`lasso.validation_losses`.

    Returns:
      ``f((C, p)) -> (C,)`` float64 mean validation losses (the mean over instances of
      :func:`instance_losses`); ``p`` must divide the penalty's number of weights
      (:func:`lasso.tie_weights`).

    Example:
      >>> f = empirical_risk((xt, yt), (xv, yv), lasso.group_lasso((5,) * 8))
      >>> res = random_refine_search(f, LogBox(4, 1e-3, 10.0), key=jax.random.key(0), budget=200)
    """
    g = instance_losses(
        train, val, penalty, num_iters=num_iters, ridge=ridge, chunk_size=chunk_size
    )
    return lambda alphas: g(alphas).mean(0)


def log_grid_search(f: Objective, *, budget: int, low: float, high: float) -> SearchResult:
    """The scalar tuner (``p = 1``): ``f`` on a ``budget``-point log grid (``goal="min"``)."""
    grid = log_grid(budget, low=low, high=high)
    return search_result(grid, evaluate_batch(f, grid), "min")


def coordinate_refine(
    f: Objective,
    alpha: np.ndarray,
    loss: float,
    *,
    budget: int,
    low: float,
    high: float,
    num_points: int = 4,
    span: float = 1.0,
    shrink: float = 0.5,
) -> SearchResult:
    """Cyclic coordinate search around ``alpha`` on a shrinking log grid, ``budget`` evaluations.

    Coordinate ``j`` (cycling ``0..p-1``) tries ``num_points`` values
    ``alpha_j · 10^{s}``, ``s`` evenly spaced in ``[−span, span]`` without 0, clipped to
    ``[low, high]``, batched in one call of ``f``; the best improvement is kept. After each full
    cycle ``span *= shrink``. Stops when the next batch would exceed ``budget``.

    Args:
      f: batched objective ``(C, p) -> (C,)``.
      alpha: ``(p,)`` start (e.g. the best random candidate) and ``loss`` its objective.
      budget: evaluations allowed (0 evaluates nothing).
      num_points: trial values per coordinate step (even, so the incumbent is not re-tried).

    Returns:
      The evaluations (``goal="min"``; none when ``budget`` is below ``num_points``): their best is
      below ``loss`` exactly when the search improved on the start.
    """
    check_range(low, high)
    if int(budget) < 0 or num_points < 1:
        raise ValueError(f"need budget >= 0 and num_points >= 1, got {budget}, {num_points}")
    best = np.array(alpha, np.float64)
    best_loss, used, j = float(loss), 0, 0
    offsets = np.linspace(-1.0, 1.0, num_points + 1 if num_points % 2 == 0 else num_points)
    offsets = offsets[offsets != 0][:num_points]
    p = best.shape[0]
    points, values = [np.zeros((0, p))], [np.zeros(0)]
    while used + len(offsets) <= budget:
        cands = np.repeat(best[None], len(offsets), axis=0)
        cands[:, j] = np.clip(best[j] * 10.0 ** (span * offsets), low, high)
        losses = evaluate_batch(f, cands)
        points.append(cands)
        values.append(losses)
        used += len(offsets)
        i = int(np.argmin(losses))
        if losses[i] < best_loss:
            best, best_loss = cands[i], float(losses[i])
        j = (j + 1) % p
        if j == 0:
            span *= shrink
    return search_result(np.concatenate(points), np.concatenate(values), "min")


def random_refine_search(
    f: Objective,
    space: LogBox,
    *,
    key: jax.Array,
    budget: int,
    refine_fraction: float = 0.25,
    num_points: int = 4,
) -> SearchResult:
    """Random search on ``(1 − refine_fraction)·budget`` candidates, then :func:`coordinate_refine`
    with the rest (the spec's tuner for ``p ∈ {2, 4, 8}``); ``goal="min"``, both stages' evaluations
    in order."""
    if int(budget) < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget}")
    if not 0 <= refine_fraction < 1:
        raise ValueError(f"refine_fraction must lie in [0, 1), got {refine_fraction}")
    n_random = max(1, int(round(budget * (1 - refine_fraction))))
    r = random_search(f, space, key=key, budget=n_random, goal="min")
    c = coordinate_refine(
        f, r.best_point, r.best_value, budget=int(budget) - n_random, low=space.low,
        high=space.high, num_points=num_points,
    )  # fmt: skip
    return search_result(
        np.concatenate([r.points, c.points]), np.concatenate([r.values, c.values]), "min"
    )
