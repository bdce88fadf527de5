"""lowrank_jax.changepoint: online change points in low-rank Poisson count streams (P17).

* :mod:`~lowrank_jax.changepoint.lowrank`: the constant-cost multi-scale low-rank statistic
  ``D_{t,w}`` (``init_lowrank_scan``, ``update_lowrank_scan``, ``lowrank_statistics``) with
  window estimates by adaptive singular-value thresholding (``SVT``, ``svt_threshold``) or a
  fixed rank, and its threshold shape ``b_{t,w}``; window sums updated incrementally, so long
  windows cost no more than short ones. Its parameters and input checks (``SVT``,
  ``svt_threshold``, ``scales``, ``check_counts``, ``check_rank``, ``check_svt``) live in
  :mod:`~lowrank_jax.changepoint.params` and are re-exported.
* :mod:`~lowrank_jax.changepoint.detectors`: detectors as values (``Detector``): the low-rank
  scan, the Frobenius scan, Poisson Page-CUSUM on totals, entrywise CUSUM (Bonferroni);
  ``run_detector`` (``lax.scan``, ``vmap`` over streams), ``first_alarm``.
* :mod:`~lowrank_jax.changepoint.calibration`: block-bootstrap calibration of a detector's
  threshold (``calibrate_threshold``) and of the SVT level's constant (``calibrate_svt_scale``).
* :mod:`~lowrank_jax.changepoint.simulate`: calibration by simulation from a null model fitted
  to a training stretch (``fit_null_model``, ``calibrate_by_simulation``), for horizons the
  bootstrap's stretch cannot cover; detectors run on streams simulated inside their scan
  (``simulate_scores``).
* :mod:`~lowrank_jax.changepoint.peers`: FOCuS (changepoint-online) and a ruptures Poisson cost.
* :mod:`~lowrank_jax.changepoint.synthetic`: the synthetic low-rank streams of §17.
"""

from lowrank_jax.changepoint.calibration import calibrate_svt_scale, calibrate_threshold
from lowrank_jax.changepoint.detectors import (
    first_alarm,
    frobenius_scan,
    lowrank_scan,
    run_detector,
)
from lowrank_jax.changepoint.simulate import (
    NullModel,
    calibrate_by_simulation,
    fit_null_model,
    simulate_scores,
)

__all__ = [
    "NullModel",
    "calibrate_by_simulation",
    "calibrate_svt_scale",
    "calibrate_threshold",
    "first_alarm",
    "fit_null_model",
    "frobenius_scan",
    "lowrank_scan",
    "run_detector",
    "simulate_scores",
]
