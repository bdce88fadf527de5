"""lowrank_jax.changepoint: online change points in low-rank Poisson count streams (P17).

* :mod:`~lowrank_jax.changepoint.lowrank`: the constant-cost multi-scale low-rank statistic
  ``D_{t,w}`` (``init_lowrank_scan``, ``update_lowrank_scan``, ``lowrank_statistics``) with
  window estimates by adaptive singular-value thresholding (``SVT``, ``svt_threshold``) or a
  fixed rank, and its threshold shape ``b_{t,w}``; input validation (``check_counts``,
  ``check_rank``, ``check_svt``).
* :mod:`~lowrank_jax.changepoint.detectors`: detectors as values (``Detector``): the low-rank
  scan, the Frobenius scan, Poisson Page-CUSUM on totals, entrywise CUSUM (Bonferroni);
  ``run_detector`` (``lax.scan``, ``vmap`` over streams), ``first_alarm``.
* :mod:`~lowrank_jax.changepoint.calibration`: block-bootstrap calibration of a detector's
  threshold (``calibrate_threshold``) and of the SVT level's constant (``calibrate_svt_scale``).
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

__all__ = [
    "calibrate_svt_scale",
    "calibrate_threshold",
    "first_alarm",
    "frobenius_scan",
    "lowrank_scan",
    "run_detector",
]
