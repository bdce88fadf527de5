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

from lowrank_jax.changepoint import peers, synthetic
from lowrank_jax.changepoint.calibration import (
    Calibration,
    block_bootstrap_indices,
    calibrate_svt_scale,
    calibrate_threshold,
    quantile_threshold,
)
from lowrank_jax.changepoint.detectors import (
    Detector,
    bonferroni_cusum_threshold,
    entrywise_cusum,
    first_alarm,
    frobenius_scan,
    lowrank_detector,
    page_cusum_totals,
    run_detector,
)
from lowrank_jax.changepoint.lowrank import (
    SVT,
    LowRankScanState,
    check_counts,
    check_rank,
    check_svt,
    init_lowrank_scan,
    initial_basis,
    lowrank_statistics,
    lowrank_threshold,
    rank_truncate,
    scales,
    svt_threshold,
    update_lowrank_scan,
)

__all__ = [
    "Calibration",
    "Detector",
    "LowRankScanState",
    "SVT",
    "block_bootstrap_indices",
    "bonferroni_cusum_threshold",
    "calibrate_svt_scale",
    "calibrate_threshold",
    "check_counts",
    "check_rank",
    "check_svt",
    "entrywise_cusum",
    "first_alarm",
    "frobenius_scan",
    "init_lowrank_scan",
    "initial_basis",
    "lowrank_detector",
    "lowrank_statistics",
    "lowrank_threshold",
    "page_cusum_totals",
    "peers",
    "synthetic",
    "quantile_threshold",
    "rank_truncate",
    "run_detector",
    "scales",
    "svt_threshold",
    "update_lowrank_scan",
]
