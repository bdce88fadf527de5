r"""Continual-learning metrics from an accuracy matrix.

``R[t, j]`` is the accuracy on the test set of task ``j`` after training on tasks ``0..t``
(``T × T``; entries with ``j > t`` are ignored and may be NaN). With ``T`` tasks:

* final average accuracy ``A_T = (1/T) Σ_j R[T−1, j]``;
* average incremental accuracy ``Ā = (1/T) Σ_t (1/(t+1)) Σ_{j≤t} R[t, j]``;
* forgetting ``F = (1/(T−1)) Σ_{j<T−1} max_{t<T−1} R[t, j] − R[T−1, j]`` (Chaudhry et al. 2018);
* backward transfer ``BWT = (1/(T−1)) Σ_{j<T−1} R[T−1, j] − R[j, j]`` (Lopez-Paz & Ranzato 2017);
* plasticity: the diagonal ``R[t, t]`` (new-task accuracy right after learning it).

References:
  Lopez-Paz & Ranzato 2017 (GEM: ACC, BWT); Chaudhry et al. 2018 (RWalk: forgetting);
  Rebuffi et al. 2017 (iCaRL: average incremental accuracy).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "average_incremental_accuracy",
    "backward_transfer",
    "final_average_accuracy",
    "forgetting",
    "plasticity",
    "summarize",
]


def _check(r: np.ndarray) -> np.ndarray:
    r = np.asarray(r, np.float64)
    if r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] < 1:
        raise ValueError(
            f"the accuracy matrix must be square (T, T) with R[t, j] = accuracy on task j after "
            f"task t; got shape {r.shape}."
        )
    lower = np.tril(np.ones(r.shape, bool))
    if not np.all(np.isfinite(r[lower])):
        raise ValueError("the accuracy matrix has non-finite entries on or below the diagonal.")
    return r


def final_average_accuracy(r: np.ndarray) -> float:
    """``A_T``: mean accuracy over all tasks after the last one. ``r``: ``(T, T)``."""
    r = _check(r)
    return float(np.mean(r[-1]))


def average_incremental_accuracy(r: np.ndarray) -> float:
    """``Ā``: mean over steps ``t`` of the mean accuracy on the tasks seen so far."""
    r = _check(r)
    return float(np.mean([np.mean(r[t, : t + 1]) for t in range(r.shape[0])]))


def forgetting(r: np.ndarray) -> float:
    """``F``: mean drop from the best earlier accuracy to the final one (0 for ``T = 1``)."""
    r = _check(r)
    t = r.shape[0]
    if t == 1:
        return 0.0
    drops = [np.max(r[j : t - 1, j]) - r[t - 1, j] for j in range(t - 1)]
    return float(np.mean(drops))


def backward_transfer(r: np.ndarray) -> float:
    """``BWT``: mean change of each old task's accuracy from right after it to the end."""
    r = _check(r)
    t = r.shape[0]
    if t == 1:
        return 0.0
    return float(np.mean([r[t - 1, j] - r[j, j] for j in range(t - 1)]))


def plasticity(r: np.ndarray) -> np.ndarray:
    """The diagonal ``R[t, t]``: accuracy on each task right after learning it, ``(T,)``."""
    return np.diag(_check(r)).copy()


def summarize(r: np.ndarray) -> dict[str, float]:
    """All scalar metrics: ``{"final_acc", "avg_inc_acc", "forgetting", "bwt", "plasticity"}``.

    ``plasticity`` is the mean of the diagonal.
    """
    return {
        "final_acc": final_average_accuracy(r),
        "avg_inc_acc": average_incremental_accuracy(r),
        "forgetting": forgetting(r),
        "bwt": backward_transfer(r),
        "plasticity": float(np.mean(plasticity(r))),
    }
