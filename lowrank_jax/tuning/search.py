"""Search baselines (random search, Optuna TPE) and what every searcher shares: the search spaces,
the trajectory record :class:`SearchResult`, the objective wrappers, the budget check, simple regret.

Two kinds of space, one searcher of each baseline for both:

* a **candidate set**: ``c`` candidates, a flat list or a full grid of shape ``(s_1, ..., s_a)``
  flattened in C order (``np.ravel_multi_index``), as built by
  :func:`lowrank_jax.tuning.lora_grid_configurations` (P15). The objective is a ``(c,)`` table or
  ``f(index) -> float``; the points of a result are flat indices.
* a **box** :class:`LogBox` ``[low, high]^dim`` searched on a log scale (P12's tied weights). The
  objective is batched, ``f(points (C, dim)) -> (C,)``, so one call evaluates many candidates;
  the points of a result are ``(n, dim)``.

``goal="max"`` maximises the objective (scores, accuracies), ``goal="min"`` minimises it (losses).

References:
  Bergstra & Bengio 2012 (random search); Bergstra et al. 2011 and Watanabe 2023 (TPE);
  Akiba et al. 2019 (Optuna, whose ``TPESampler`` is used as is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

__all__ = [
    "LogBox",
    "SearchResult",
    "check_budget",
    "evaluate_batch",
    "log_grid",
    "random_search",
    "sample_log_uniform",
    "score_function",
    "simple_regret",
    "tpe_search",
]


Goal = Literal["max", "min"]


class LogBox(NamedTuple):
    """The box ``[low, high]^dim``, searched on a log scale (``0 < low < high``)."""

    dim: int
    low: float
    high: float


class SearchResult(NamedTuple):
    """The trajectory of one search run (``n`` evaluations, in evaluation order).

    Attributes:
      points: ``(n,)`` int flat candidate indices (a candidate set) or ``(n, dim)`` points (a box).
      values: ``(n,)`` observed objective values.
      best_so_far: ``(n,)`` the running best of ``values`` (maximum, or minimum for ``goal="min"``).
      goal: ``"max"`` or ``"min"``.
    """

    points: np.ndarray
    values: np.ndarray
    best_so_far: np.ndarray
    goal: str = "max"

    @property
    def num_evals(self) -> int:
        """``n``."""
        return len(self.values)

    @property
    def best_index(self) -> int:
        """The first evaluation with the best value."""
        if not len(self.values):
            raise ValueError("an empty search has no best point.")
        return int(np.argmax(self.values) if self.goal == "max" else np.argmin(self.values))

    @property
    def best_point(self) -> Any:
        """The best point (a flat index, or a ``(dim,)`` point)."""
        return self.points[self.best_index]

    @property
    def best_value(self) -> float:
        """Its objective value."""
        return float(self.values[self.best_index])


def search_result(points: Any, values: Any, goal: Goal = "max") -> SearchResult:
    """A :class:`SearchResult` from the evaluated points and values, in order."""
    if goal not in ("max", "min"):
        raise ValueError(f"goal must be 'max' or 'min', got {goal!r}.")
    y = np.asarray(values, np.float64)
    best = np.maximum.accumulate(y) if goal == "max" else np.minimum.accumulate(y)
    pts = np.asarray(points)
    return SearchResult(pts.astype(np.int32) if pts.ndim == 1 else pts, y, best, goal)


def check_range(low: float, high: float) -> None:
    """Raises ValueError unless ``0 < low < high`` (a log-scale range)."""
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high for a log-scale search, got low={low}, high={high}")


def log_grid(num: int, *, low: float, high: float) -> np.ndarray:
    """``(num, 1)`` log-spaced scalar candidates in ``[low, high]``."""
    check_range(low, high)
    if int(num) < 1:
        raise ValueError(f"budget must be an int >= 1, got {num}")
    return np.geomspace(low, high, int(num))[:, None]


def sample_log_uniform(key: jax.Array, num: int, p: int, *, low: float, high: float) -> np.ndarray:
    """``(num, p)`` candidates with each coordinate log-uniform on ``[low, high]`` (float64)."""
    check_range(low, high)
    if int(num) < 1:
        raise ValueError(f"budget must be an int >= 1, got {num}")
    u = np.asarray(jax.random.uniform(key, (int(num), int(p))), np.float64)
    return np.exp(np.log(low) + u * (np.log(high) - np.log(low)))


def evaluate_batch(objective: Callable, points: np.ndarray, goal: Goal = "min") -> np.ndarray:
    """``objective(points (C, dim)) -> (C,)`` as float64, a NaN/inf value replaced by the worst."""
    values = np.asarray(objective(np.asarray(points, np.float64)), np.float64)
    if values.shape != (len(points),):
        raise ValueError(f"the objective returned shape {values.shape}, expected ({len(points)},)")
    return np.where(np.isfinite(values), values, np.inf if goal == "min" else -np.inf)


def score_function(objective: Any, num_candidates: int) -> Callable[[int], float]:
    """``index -> float`` from a ``(c,)`` score table or a callable (scores are maximised).

    Raises:
      ValueError: a table of the wrong shape or with NaN/inf.
    """
    if callable(objective):
        return lambda i: float(objective(int(i)))
    table = np.asarray(objective, np.float64)
    if table.shape != (num_candidates,):
        raise ValueError(
            f"objective must be a callable or a (c,) = ({num_candidates},) table of scores; "
            f"got shape {table.shape}."
        )
    if not np.all(np.isfinite(table)):
        raise ValueError("the score table holds NaN/inf: give failed runs a finite worst score.")
    return lambda i: float(table[int(i)])


def check_budget(n_init: int, budget: int, num_candidates: int) -> None:
    """Raises ValueError unless ``1 <= n_init <= budget <= num_candidates`` (all ints)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n_init, budget)):
        raise TypeError(f"n_init and budget must be ints; got {n_init!r}, {budget!r}.")
    if n_init < 1 or budget < n_init:
        raise ValueError(f"need 1 <= n_init <= budget; got n_init={n_init}, budget={budget}.")
    if budget > num_candidates:
        raise ValueError(f"budget={budget} exceeds the {num_candidates} candidates; lower it.")


def random_search(
    objective: Any,
    space: int | LogBox,
    *,
    key: jax.Array,
    budget: int = 30,
    goal: Goal = "max",
) -> SearchResult:
    """Random search: ``budget`` candidates drawn uniformly without replacement (a candidate set
    of ``space`` candidates), or log-uniformly in a :class:`LogBox` (one batched call).

    Raises:
      ValueError: a bad table, range or budget.
    """
    if isinstance(space, LogBox):
        points = sample_log_uniform(key, budget, space.dim, low=space.low, high=space.high)
        return search_result(points, evaluate_batch(objective, points, goal), goal)
    f = score_function(objective, space)
    check_budget(1, budget, space)
    idx = np.asarray(jax.random.choice(key, space, (budget,), replace=False))
    return search_result(idx, [f(i) for i in idx], goal)


def tpe_search(
    objective: Any,
    space: Sequence[int] | LogBox,
    *,
    seed: int,
    budget: int = 30,
    n_init: int = 5,
    goal: Goal = "max",
) -> SearchResult:
    """Optuna's TPE, one candidate per trial: over a grid of shape ``space`` (each axis an integer
    index ``suggest_int(0, s_i - 1)``, so TPE sees the values' order), or over a :class:`LogBox`
    (``suggest_float(..., log=True)`` per coordinate).

    A configuration TPE proposes twice is evaluated (and counted) twice, as in ordinary Optuna use.

    Args:
      objective: for a grid, a ``(c,)`` table (``c = prod(space)``, C order) or ``f(flat index)``;
        for a box, the batched ``f(points (C, dim)) -> (C,)``.
      space: the grid's axis sizes, or a :class:`LogBox`.
      seed: the sampler's seed.
      budget: evaluations.
      n_init: TPE's random start-up trials (``n_startup_trials``; Optuna's default is 10).
      goal: ``"max"`` or ``"min"``.

    Returns:
      :class:`SearchResult` with flat indices (a grid) or ``(budget, dim)`` points (a box).

    Raises:
      ImportError: optuna is not installed (``pip install optuna``, the ``peers`` extra).
      ValueError: a bad grid, range, table or budget.
    """
    try:
        import optuna
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tpe_search needs optuna: pip install optuna (extra 'peers').") from e
    if goal not in ("max", "min"):
        raise ValueError(f"goal must be 'max' or 'min', got {goal!r}.")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=int(seed), n_startup_trials=int(n_init))
    study = optuna.create_study(
        direction="maximize" if goal == "max" else "minimize", sampler=sampler
    )
    points, values = [], []
    if isinstance(space, LogBox):
        check_range(space.low, space.high)
        check_budget(1, budget, budget)
        worst = -1e30 if goal == "max" else 1e30
        for _ in range(budget):
            trial = study.ask()
            a = np.array(
                [
                    trial.suggest_float(f"a{j}", space.low, space.high, log=True)
                    for j in range(space.dim)
                ]
            )
            v = float(evaluate_batch(objective, a[None], goal)[0])
            study.tell(trial, v if np.isfinite(v) else worst)
            points.append(a)
            values.append(v)
        return search_result(np.stack(points), values, goal)
    shape = tuple(int(s) for s in space)
    if not shape or min(shape) < 1:
        raise ValueError(f"the grid shape must be positive axis sizes; got {tuple(space)}.")
    c = int(np.prod(shape))
    f = score_function(objective, c)
    check_budget(n_init, budget, c)
    for _ in range(budget):
        trial = study.ask()
        multi = tuple(trial.suggest_int(f"axis{j}", 0, s - 1) for j, s in enumerate(shape))
        i = int(np.ravel_multi_index(multi, shape))
        v = f(i)
        study.tell(trial, v)
        points.append(i)
        values.append(v)
    return search_result(points, values, goal)


def simple_regret(result: SearchResult, optimum: float) -> np.ndarray:
    """``|optimum − best_so_far|``: ``(n,)`` simple regret after each evaluation."""
    return np.abs(float(optimum) - np.asarray(result.best_so_far))
