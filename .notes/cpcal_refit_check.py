"""Refit vs in-sample bootstrap for the totals CUSUM on the unit test's i.i.d. Poisson streams.

PYTHONPATH=. nice -n 10 python .notes/cpcal_refit_check.py N CELL_MEAN  (e.g. 100 0.2; 40 2.0)
"""
import math, jax, numpy as np
from lowrank_jax import changepoint as cp
import sys; sys.path.insert(0, "tests/changepoint")
from test_changepoint import _intensity, P, L
alpha, delta, horizon, reps, n_fresh = 0.1, 0.1, 100, 20, 200
n, scale = int(sys.argv[1]), float(sys.argv[2])
lam = _intensity(scale=scale); rng = np.random.default_rng(4)
def refit(stretch): return cp.page_cusum_totals(stretch.sum((1, 2)).mean(), rel_change=delta)
def cusum_max(x, rate):
    up = down = top = np.zeros(x.shape[0])
    for t in range(x.shape[1]):
        up = np.maximum(0.0, up + x[:, t] * math.log1p(delta) - rate * delta)
        down = np.maximum(0.0, down + x[:, t] * math.log1p(-delta) + rate * delta)
        top = np.maximum(top, np.maximum(up, down))
    return top
out = []
for r in range(reps):
    train = rng.poisson(lam, (n, P, L)); det = refit(train)
    cal = cp.calibrate_threshold(det, train, key=jax.random.key(r), alpha=alpha, horizon=horizon, chunk=10, refit=refit)
    plain = cp.calibrate_threshold(det, train, key=jax.random.key(r), alpha=alpha, horizon=horizon, chunk=10)
    totals = rng.poisson(lam.sum(), (n_fresh, horizon)).astype(np.float64)
    m = cusum_max(totals, train.sum((1, 2)).mean())
    out.append([np.mean(m > cal.threshold), np.mean(m > plain.threshold)])
out = np.array(out); print(n, scale, out.mean(0), out.std(0) / math.sqrt(reps))
