r"""Bridges to peer libraries (optional, imported lazily): changepoint-online and ruptures.

* :func:`focus_scores`: FOCuS for Poisson rates (Romano et al. 2023; Ward et al. 2024) from
  ``changepoint-online`` on a 1-D count stream (e.g. the totals ``Σ Y_t``), its statistic after
  every observation (``O(log t)`` amortised per step, pure Python).
* :func:`ruptures_poisson_cost`: a ``ruptures`` cost class for independent Poisson coordinates,
  ``c(y_{a:b}) = −Σ_j [S_j log(S_j / (b−a)) − S_j]`` with ``S_j = Σ_{a≤t<b} y_tj`` (the negative
  maximised log-likelihood up to terms that do not depend on the segmentation), ``O(d)`` per
  segment from cumulative sums; ruptures ships no Poisson cost.
* :func:`ruptures_window_alarm`: ruptures' offline PELT with that cost on the last ``window``
  observations — "offline segmentation in sliding windows", used online by re-running it.

Install with ``pip install .[peers]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["focus_scores", "ruptures_poisson_cost", "ruptures_window_alarm"]


def focus_scores(x, *, rate: float | None = None, side: str = "both") -> np.ndarray:
    """FOCuS Poisson statistic after each of ``x: (T,)`` counts (``rate``: known pre-change mean,
    None for unknown; ``side``: "both", "right" (increases) or "left")."""
    from changepoint_online import Focus, Poisson

    detector = Focus(Poisson(lam=rate), side=side)
    out = np.empty(len(x))
    for i, v in enumerate(np.asarray(x, np.float64)):
        detector.update(float(v))
        out[i] = detector.statistic()
    return out


def ruptures_poisson_cost():
    """A ``ruptures.base.BaseCost`` subclass (the class, instantiate it) with the Poisson cost."""
    from ruptures.base import BaseCost

    class CostPoisson(BaseCost):
        """Independent-Poisson segment cost, ``-Σ_j S_j log(S_j/n) - S_j``."""

        model = "poisson"
        min_size = 1

        def fit(self, signal):
            s = np.asarray(signal, np.float64)
            s = s[:, None] if s.ndim == 1 else s
            self.signal = s
            self.cumsum = np.concatenate([np.zeros((1, s.shape[1])), np.cumsum(s, 0)])
            return self

        def error(self, start, end):
            tot = self.cumsum[end] - self.cumsum[start]
            n = end - start
            pos = tot > 0
            return float(-np.sum(tot[pos] * np.log(tot[pos] / n)) + tot.sum())

    return CostPoisson


def ruptures_window_alarm(window_obs, *, penalty: float, cost=None) -> int:
    """Number of change points PELT (Poisson cost) finds in ``window_obs: (w, d)``."""
    import ruptures

    cost = cost if cost is not None else ruptures_poisson_cost()()
    algo = ruptures.Pelt(custom_cost=cost, min_size=2, jump=1).fit(np.asarray(window_obs))
    return len(algo.predict(pen=penalty)) - 1
