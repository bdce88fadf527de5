"""P17 calibration diagnostic (b): Poisson Page-CUSUM on totals with the rate estimated on the
training stretch. The totals of the synthetic streams are Poisson(M e^{ε_t − σ²/2}) scalars, so
this runs on scalar streams in NumPy (checked against the library detector on one stream).

PYTHONPATH=. nice -n 10 python .notes/cpcal_cusum_diag.py [--sigma 0.2] [--n 600] [--R 40]
"""
import argparse
import jax, numpy as np
from lowrank_jax import changepoint as cp

ap = argparse.ArgumentParser()
ap.add_argument("--sigma", type=float, default=0.2)
ap.add_argument("--n", type=int, default=600)
ap.add_argument("--R", type=int, default=40)  # training stretches
ap.add_argument("--B", type=int, default=200)  # bootstrap streams
ap.add_argument("--fresh", type=int, default=2000)
ap.add_argument("--mean_total", type=float, default=1800.0)  # p = L = 30, 2 events per cell
a = ap.parse_args()
T, alpha, delta, bl = 500, 0.05, 0.05, 10
rng = np.random.default_rng(0)

def totals(size):
    eps = a.sigma * rng.normal(size=size)
    return rng.poisson(a.mean_total * np.exp(eps - a.sigma**2 / 2)).astype(np.float64)

def cusum_max(x, rate):  # x (B, T), rate scalar or (B,)
    rate = np.broadcast_to(rate, x.shape[:1])
    up = dn = np.zeros(x.shape[0]); m = np.zeros(x.shape[0])
    for t in range(x.shape[1]):
        up = np.maximum(0, up + x[:, t] * np.log1p(delta) - rate * delta)
        dn = np.maximum(0, dn + x[:, t] * np.log1p(-delta) + rate * delta)
        m = np.maximum(m, np.maximum(up, dn))
    return m

x0 = totals((1, 64))
lib = np.asarray(cp.run_detector(cp.page_cusum_totals(1800.0, rel_change=delta), x0[0].astype(np.int32)[:, None, None]))
assert np.allclose(lib.max(), cusum_max(x0, 1800.0), rtol=1e-4), (lib.max(), cusum_max(x0, 1800.0))

def boot_idx(n, length, num):
    starts = rng.integers(0, n - bl + 1, (num, -(-length // bl)))
    return (starts[:, :, None] + np.arange(bl)).reshape(num, -1)[:, :length]

fresh_max_true = cusum_max(totals((a.fresh, T)), a.mean_total)
print(f"sigma={a.sigma} n={a.n} R={a.R} B={a.B} fresh={a.fresh}; known rate: fresh q95 = "
      f"{cp.quantile_threshold(fresh_max_true, alpha):.1f}")
rows = []
for r in range(a.R):
    train = totals(a.n)
    mu = train.mean()
    fresh = cusum_max(totals((a.fresh, T)), mu)  # the monitored streams, detector from the train mean
    plain = cusum_max(train[boot_idx(a.n, T, a.B)], mu)
    mu_star = train[boot_idx(a.n, a.n, a.B)].mean(1)  # re-estimated on resampled stretches
    reest = cusum_max(train[boot_idx(a.n, T, a.B)], mu_star)
    rows.append([(mu - a.mean_total) / a.mean_total,
                 np.mean(fresh > cp.quantile_threshold(plain, alpha)),
                 np.mean(fresh > cp.quantile_threshold(reest, alpha))])
rows = np.array(rows)
print("relative error of the rate: sd %.4f" % rows[:, 0].std())
for j, name in ((1, "in-sample bootstrap"), (2, "re-estimating bootstrap")):
    fa = rows[:, j]
    print(f"{name}: false-alarm rate over {a.R} training stretches: mean {fa.mean():.3f} "
          f"(sd {fa.std():.3f}, quartiles {np.quantile(fa, .25):.3f}/{np.median(fa):.3f}/{np.quantile(fa, .75):.3f}, "
          f"max {fa.max():.3f}); corr with rate error {np.corrcoef(rows[:, 0], fa)[0, 1]:+.2f}")
