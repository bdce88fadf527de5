"""Why the bootstrap-calibrated thresholds of P17 miss α (issue 15 item 3): small diagnostics.

PYTHONPATH=. nice -n 10 python .notes/cpcal_diag.py [--sigma 0.2] [--ns 600,3000] [--reps 200]
    [--blocks 10] [--known_only] [--dets lowrank,frobenius] [--stretches 1]
Settings of configs/changepoint.py (p = L = 30, rank 2, mean 2, J = 5, chunk 16, T = 500, ρ = 0).
"""
import argparse, time
import jax, numpy as np
from lowrank_jax import changepoint as cp

ap = argparse.ArgumentParser()
ap.add_argument("--sigma", type=float, default=0.2)
ap.add_argument("--ns", default="600,3000")
ap.add_argument("--reps", type=int, default=200)
ap.add_argument("--blocks", default="10,1")
ap.add_argument("--known_only", action="store_true")
ap.add_argument("--stretches", type=int, default=1)  # training stretches per n
ap.add_argument("--T", type=int, default=500)
ap.add_argument("--dets", default="lowrank,frobenius,cusum_totals")
a = ap.parse_args()
p = L = 30; T = a.T; alpha = 0.05; chunk = 16
lam = cp.synthetic.lowrank_intensity(jax.random.key(0), p=p, num_cells=L, rank=2, mean=2.0)

def dets(mean):
    kw = dict(num_scales=5, alpha=0.05)
    out = {"lowrank": cp.lowrank_detector(mean, rank=2, **kw), "frobenius": cp.frobenius_scan(mean, **kw),
           "cusum_totals": cp.page_cusum_totals(mean.sum(), rel_change=0.05)}
    return {k: out[k] for k in a.dets.split(",")}

def maxima(det, ys):
    b, t = ys.shape[:2]
    flat = ys.reshape(b * t, p, L)
    out = [np.asarray(cp.run_detector(det, flat, index=np.arange(i * t, (i + 50) * t).reshape(50, t), chunk=chunk).max(1)) for i in range(0, b, 50)]
    return np.concatenate(out)

t0 = time.time()
fresh = cp.synthetic.sample_streams(jax.random.key(7), lam, num_streams=a.reps, length=T, sigma=a.sigma)
known = dets(lam)
fmax = {k: maxima(d, fresh) for k, d in known.items()}
print(f"sigma={a.sigma} T={T} reps={a.reps}; fresh null maxima, detectors from the true λ: "
      + ", ".join(f"{k} q95={cp.quantile_threshold(v, alpha):.3f}" for k, v in fmax.items()), flush=True)
print("| n | block | detectors from | detector | boot q95 | fresh q95 | max of train-stretch-based boot maxima | FA on fresh |")
for n, rep in [(int(x), r) for x in a.ns.split(",") for r in range(a.stretches)]:
    train = cp.synthetic.sample_streams(jax.random.key(100 + n + 100000 * rep), lam, num_streams=1, length=n, sigma=a.sigma)[0]
    srcs = (("true λ", known),) if a.known_only else (("true λ", known), ("train mean", dets(train.mean(0))))
    for src, ds in srcs:
        fm = fmax if src == "true λ" else {k: maxima(d, fresh) for k, d in ds.items()}
        for bl in [int(x) for x in a.blocks.split(",")]:
            if src == "train mean" and bl != 10:
                continue
            for k, d in ds.items():
                cal = cp.calibrate_threshold(d, train, key=jax.random.key(3), alpha=alpha, horizon=T,
                                             block_len=bl, num_streams=a.reps, chunk=chunk)
                print(f"| {n} | {bl} | {src} | {k} | {cal.threshold:.3f} | {cp.quantile_threshold(fm[k], alpha):.3f} "
                      f"| {cal.maxima.max():.3f} | {np.mean(fm[k] > cal.threshold):.3f} |", flush=True)
print(f"{time.time() - t0:.0f} s")
