r"""Peer check: the P12 FISTA solvers against skglm (group lasso) and cvxpy (both), in objective.

``--instances`` random problems of the P12 shapes (n = 50; group lasso d = 40 in 8 groups of 5,
fused lasso d = 41 with 40 edges), weights log-uniform in [1e-3, 0.2] (random per group / edge).
For each, :func:`lowrank_jax.tuning.lasso.solve` (float32) is compared with skglm's ``GroupBCD`` on
``QuadraticGroup + WeightedGroupL2`` (float64, tol 1e-12) and with cvxpy + Clarabel (float64), all
objectives evaluated in float64 by :func:`lowrank_jax.tuning.lasso.lasso_objective`. skglm's numba
compilation (a minute on a loaded machine) is why this is a script and not a unit test (the unit
tests compare against cvxpy).

Command::

    python -m experiments.bench.lasso_peers            # ~2 minutes on a loaded 2-core CPU

Prints one line per problem kind and, as the last line, JSON with ``group_vs_skglm``,
``group_vs_cvxpy`` and ``fused_vs_cvxpy``: the largest ``F(FISTA) − F(peer)`` over the instances
(target ≤ 1e-5; negative means FISTA found the lower objective).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from lowrank_jax import tuning
from lowrank_jax.tuning.lasso import fused_lasso, lasso_objective, solve


def _obj(beta, x, y, w, pen):
    return float(lasso_objective(*(np.asarray(a, np.float64) for a in (beta, x, y, w)), pen))


def _cvxpy_group(x, y, w, sizes):
    import cvxpy as cp

    b = cp.Variable(x.shape[1])
    starts = np.cumsum((0, *sizes))
    reg = sum(w[g] * cp.norm(b[starts[g] : starts[g + 1]]) for g in range(len(sizes)))
    cp.Problem(cp.Minimize(cp.sum_squares(y - x @ b) / (2 * len(y)) + reg)).solve("CLARABEL")
    return b.value


def _cvxpy_fused(x, y, w):
    import cvxpy as cp

    b = cp.Variable(x.shape[1])
    obj = cp.sum_squares(y - x @ b) / (2 * len(y)) + w @ cp.abs(cp.diff(b))
    cp.Problem(cp.Minimize(obj)).solve("CLARABEL")
    return b.value


def _skglm_group(x, y, w, size):
    from skglm.datafits import QuadraticGroup
    from skglm.penalties import WeightedGroupL2
    from skglm.solvers import GroupBCD
    from skglm.utils.data import grp_converter

    idx, ptr = grp_converter(size, x.shape[1])
    solver = GroupBCD(tol=1e-12, max_iter=10000)
    return solver.solve(x, y, QuadraticGroup(ptr, idx), WeightedGroupL2(1.0, w, ptr, idx))[0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    gaps = {"group_vs_skglm": [], "group_vs_cvxpy": [], "fused_vs_cvxpy": []}
    sizes = (5,) * 8
    gpen, fpen = tuning.group_lasso(sizes), fused_lasso(41)
    for _ in range(args.instances):
        x = rng.standard_normal((50, 40))
        beta = np.repeat(rng.standard_normal(8) * (rng.random(8) < 0.5), 5)
        y = x @ beta + rng.standard_normal(50)
        w = np.exp(rng.uniform(np.log(1e-3), np.log(0.2), 8))
        ours = solve(x.astype(np.float32), y.astype(np.float32), w, gpen, num_iters=500)
        f = _obj(ours, x, y, w, gpen)
        gaps["group_vs_skglm"].append(f - _obj(_skglm_group(x, y, w, 5), x, y, w, gpen))
        gaps["group_vs_cvxpy"].append(f - _obj(_cvxpy_group(x, y, w, sizes), x, y, w, gpen))
        x = rng.standard_normal((50, 41))
        beta = np.cumsum(rng.standard_normal(41) * (rng.random(41) < 0.15))
        y = x @ beta + rng.standard_normal(50)
        w = np.exp(rng.uniform(np.log(1e-3), np.log(0.2), 40))
        ours = solve(x.astype(np.float32), y.astype(np.float32), w, fpen, num_iters=3000)
        ref = _cvxpy_fused(x, y, w)
        gaps["fused_vs_cvxpy"].append(_obj(ours, x, y, w, fpen) - _obj(ref, x, y, w, fpen))
    out = {k: float(np.max(v)) for k, v in gaps.items()}
    for k, v in gaps.items():
        print(f"{k}: max {np.max(v):.2e}, median {np.median(v):.2e} over {len(v)} instances")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
