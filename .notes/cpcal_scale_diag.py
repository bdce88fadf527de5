"""Which window attains the low-rank scan's maximum on fresh null streams (P17 synthetic, ρ = 0).

PYTHONPATH=. nice -n 10 python .notes/cpcal_scale_diag.py
"""
import jax, numpy as np
from lowrank_jax import changepoint as cp

p = L = 30; J = 5; T = 500
lam = cp.synthetic.lowrank_intensity(jax.random.key(0), p=p, num_cells=L, rank=2, mean=2.0)
basis = cp.initial_basis(lam, rank=2)
b = np.asarray(cp.lowrank.lowrank_threshold(np.arange(1, T + 1), rate_bound=float(lam.max()), p=p,
                                            num_cells=L, num_scales=J, rank=2, alpha=0.05))
for sigma in (0.0, 0.2):
    ys = cp.synthetic.sample_streams(jax.random.key(7), lam, num_streams=30, length=T, sigma=sigma)
    wins = np.zeros(J + 1, int); tops = []
    for y in ys:
        r = np.asarray(cp.lowrank_statistics(y, basis, rank=2, num_scales=J, chunk=16)) / b
        t, w = np.unravel_index(r.argmax(), r.shape); wins[w] += 1; tops.append(r.max())
    print(f"sigma={sigma}: window attaining the max over 30 streams, w=1..32: {wins.tolist()}; "
          f"median max {np.median(tops):.3f}")
