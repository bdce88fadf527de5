"""P17 SVT level diagnostics (issue 31): the bootstrap-calibrated c_tau, and detection against c_tau.

PYTHONPATH=. nice -n 10 python .notes/cp_svt_diag.py calibrate      # c_tau per rho and n
PYTHONPATH=. nice -n 10 python .notes/cp_svt_diag.py detect 1.0 0.5 0.3 0.15
PYTHONPATH=. nice -n 10 python .notes/cp_svt_diag.py ranks 1.0 0.5

Setting of configs/changepoint.py (p = L = 30, rank 2, mean 2, sigma 0.2, J = 5, T = 500,
tau = 200, alpha = 0.05). `calibrate`: cp.calibrate_svt_scale's statistic by hand, per window
(moving blocks of 10, 400 stretches). `detect` (rho = 0, training stretch 3000): thresholds are
the 95% quantiles of 200 *fresh* null streams' maxima (no bootstrap), detection on 40 streams
per change kind (kappa = 12), for the fixed rank 2, the Frobenius scan and SVT at each c_tau.
`ranks`: on one null stream, the share of t in (32, 500] at which the window of 1 (and of 32) is
estimated with rank 0, 1, 2, ... by exact SVT at each c_tau (lambda-bar = max of Lambda).
"""

import sys

import jax
import numpy as np

from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import lowrank

LAM = cp.synthetic.lowrank_intensity(jax.random.key(0), p=30, num_cells=30, rank=2, mean=2.0)
J, T, TAU = 5, 500, 200


def calibrate():
    w = 2 ** np.arange(J + 1)
    for rho in (0.0, 0.5):
        for n in (600, 3000, 12000):
            train = cp.synthetic.sample_streams(
                jax.random.key(1), LAM, num_streams=1, length=n, sigma=0.2, rho=rho
            )[0]
            mean = train.mean(0)
            idx = np.asarray(
                cp.block_bootstrap_indices(
                    jax.random.key(2), n, horizon=32, block_len=10, num_streams=400
                )
            )
            st = train[idx].astype(np.float64)
            svt = lowrank.SVT(float(mean.max()), 0.05, 1.0)
            tau = np.asarray(
                lowrank.svt_threshold(T, w.astype(float), svt, p=30, num_cells=30, num_scales=J)
            )
            dev = np.stack(
                [np.linalg.svd(st[:, -x:].mean(1) - mean, compute_uv=False)[:, 0] for x in w], 1
            )
            r = dev / tau
            print(
                f"rho={rho} n={n} per-window 95% ratio {np.round(np.quantile(r, 0.95, axis=0), 3)}"
                f" c_tau={cp.quantile_threshold(r.max(1), 0.05):.3f}"
            )


def detect(scales):
    train = cp.synthetic.sample_streams(
        jax.random.key(1), LAM, num_streams=1, length=3000, sigma=0.2
    )[0]
    mean = train.mean(0)
    null = cp.synthetic.sample_streams(jax.random.key(2), LAM, num_streams=200, length=T, sigma=0.2)
    changed = {}
    for kind in ("global", "local"):
        after = cp.synthetic.change_intensity(
            LAM, key=jax.random.key(5), kind=kind, kappa=12.0, block=10
        )
        changed[kind] = cp.synthetic.sample_streams(
            jax.random.key(3), LAM, num_streams=40, length=T, tau=TAU, lam_after=after, sigma=0.2
        )

    def scores(det, s):
        b, t = s.shape[:2]
        flat = s.reshape(b * t, 30, 30)
        index = np.arange(b * t).reshape(b, t)
        return np.asarray(cp.run_detector(det, flat, index=index, chunk=16))

    dets = {
        "fixed rank 2": cp.lowrank_detector(mean, rank=2, estimator="rank"),
        "Frobenius": cp.frobenius_scan(mean),
    }
    dets.update({f"SVT c_tau={c}": cp.lowrank_detector(mean, rank=2, svt_scale=c) for c in scales})
    for name, det in dets.items():
        thr = np.quantile(scores(det, null).max(1), 0.95)
        out = []
        for kind, s in changed.items():
            a = cp.first_alarm(scores(det, s), thr)
            out.append(f"{kind}: detected {np.mean(a > TAU):.2f}")
        print(name, f"threshold {thr:.3f}", *out, flush=True)


def ranks(scales):
    ys = cp.synthetic.sample_streams(jax.random.key(1), LAM, num_streams=1, length=T, sigma=0.2)
    ys = ys[0].astype(np.float64)
    print("singular values of Lambda:", np.round(np.linalg.svd(LAM, compute_uv=False)[:3], 1))
    for c in scales:
        svt = lowrank.SVT(float(LAM.max()), 0.05, c)
        for w in (1, 32):
            chosen = []
            for t in range(33, T + 1):
                tau = float(lowrank.svt_threshold(t, w, svt, p=30, num_cells=30, num_scales=J))
                chosen.append(
                    int((np.linalg.svd(ys[t - w : t].mean(0), compute_uv=False) > tau).sum())
                )
            share = np.bincount(chosen) / len(chosen)
            print(f"c_tau={c} window {w}: share of t with rank 0, 1, ...: {np.round(share, 2)}")


if __name__ == "__main__":
    if sys.argv[1] == "calibrate":
        calibrate()
    elif sys.argv[1] == "ranks":
        ranks([float(x) for x in sys.argv[2:]])
    else:
        detect([float(x) for x in sys.argv[2:]])
