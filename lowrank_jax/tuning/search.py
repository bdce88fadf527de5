"""Search baselines over a discrete candidate set (random search, Optuna TPE) and what every
searcher shares: the trajectory record, the objective wrapper, the budget check, simple regret.

A candidate set is either a flat list of ``c`` candidates or a full grid of shape
``(s_1, ..., s_a)`` flattened in C order (``np.ravel_multi_index``), as built by
:func:`lowrank_jax.tuning.lora_grid_configurations`.

References:
  Bergstra & Bengio 2012 (random search); Bergstra et al. 2011 and Watanabe 2023 (TPE);
  Akiba et al. 2019 (Optuna, whose ``TPESampler`` is used as is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "BOResult",
    "check_budget",
    "random_search",
    "score_function",
    "simple_regret",
    "tpe_search",
]


class BOResult(NamedTuple):
    """The trajectory of one search run (``n`` evaluations).

    Attributes:
      indices: ``(n,)`` int candidate indices in evaluation order.
      values: ``(n,)`` observed objective values.
      best_so_far: ``(n,)`` running maximum of ``values``.
    """

    indices: np.ndarray
    values: np.ndarray
    best_so_far: np.ndarray


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


def _result(idx: Sequence[int], values: Sequence[float]) -> BOResult:
    y = np.asarray(values, np.float64)
    return BOResult(np.asarray(idx, np.int32), y, np.maximum.accumulate(y))


def random_search(
    objective: Any, num_candidates: int, *, key: jax.Array, budget: int = 30
) -> BOResult:
    """Random search: ``budget`` candidates drawn uniformly without replacement.

    Raises:
      ValueError: a bad table or budget.
    """
    f = score_function(objective, num_candidates)
    check_budget(1, budget, num_candidates)
    idx = np.asarray(jax.random.choice(key, num_candidates, (budget,), replace=False))
    return _result(idx, [f(i) for i in idx])


def tpe_search(
    objective: Any,
    grid_shape: Sequence[int],
    *,
    seed: int,
    budget: int = 30,
    n_init: int = 5,
) -> BOResult:
    """Optuna's TPE over a grid: each axis is an integer index ``suggest_int(0, s_i - 1)``.

    Integer (ordinal) axes give TPE the values' order. A configuration TPE proposes twice is
    evaluated (and counted) twice, as in ordinary Optuna use.

    Args:
      objective: ``(c,)`` table (``c = prod(grid_shape)``, C order) or ``f(flat index)``.
      grid_shape: the grid's axis sizes.
      seed: the sampler's seed.
      budget: evaluations.
      n_init: TPE's random start-up trials (``n_startup_trials``).

    Returns:
      :class:`BOResult` with flat indices.

    Raises:
      ImportError: optuna is not installed (``pip install optuna``, the ``peers`` extra).
      ValueError: a bad grid, table or budget.
    """
    try:
        import optuna
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("tpe_search needs optuna: pip install optuna (extra 'peers').") from e
    shape = tuple(int(s) for s in grid_shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"grid_shape must be positive axis sizes; got {tuple(grid_shape)}.")
    c = int(np.prod(shape))
    f = score_function(objective, c)
    check_budget(n_init, budget, c)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_init)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    idx, values = [], []
    for _ in range(budget):
        trial = study.ask()
        multi = tuple(trial.suggest_int(f"axis{j}", 0, s - 1) for j, s in enumerate(shape))
        i = int(np.ravel_multi_index(multi, shape))
        v = f(i)
        study.tell(trial, v)
        idx.append(i)
        values.append(v)
    return _result(idx, values)


def simple_regret(result: BOResult, optimum: float) -> np.ndarray:
    """``optimum − best_so_far``: ``(n,)`` simple regret after each evaluation."""
    return float(optimum) - np.asarray(result.best_so_far)
