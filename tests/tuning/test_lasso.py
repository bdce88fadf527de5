"""P12 inner solvers: FISTA against established solvers, proxes against their definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import tuning
from lowrank_jax.tuning import lasso
from lowrank_jax.tuning.lasso import (
    fused_lasso,
    lasso_objective,
    prox_group_lasso,
    prox_weighted_l1,
    tie_weights,
)
from lowrank_jax.tuning.synthetic import Instances, sample_fused_instances


def _problem(d, seed=0, n=30):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    beta = np.zeros(d)
    beta[: d // 3] = rng.standard_normal(d // 3)
    y = (x @ beta + rng.standard_normal(n)).astype(np.float32)
    return x, y, rng


def _objective64(beta, x, y, w, pen):
    return float(lasso_objective(*(np.asarray(a, np.float64) for a in (beta, x, y, w)), pen))


def test_group_lasso_matches_cvxpy_objective():
    # skglm's GroupBCD is compared in experiments/bench/lasso_peers.py (its numba compile
    # takes over a minute, too slow for the suite); cvxpy (Clarabel) is the reference here.
    cp = pytest.importorskip("cvxpy")
    x, y, rng = _problem(20)
    w = rng.uniform(0.1, 0.6, 4).astype(np.float32)
    pen = tuning.group_lasso((5,) * 4)
    beta = lasso.solve(x, y, w, pen, num_iters=500)
    b = cp.Variable(20)
    x64, y64, w64 = (a.astype(np.float64) for a in (x, y, w))
    reg = sum(w64[g] * cp.norm(b[5 * g : 5 * g + 5]) for g in range(4))
    obj = cp.sum_squares(y64 - x64 @ b) / (2 * len(y)) + reg
    cp.Problem(cp.Minimize(obj)).solve(solver="CLARABEL")
    ours, theirs = _objective64(beta, x, y, w, pen), float(obj.value)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    zero = np.linalg.norm(np.asarray(beta).reshape(4, 5), axis=1) == 0
    assert zero.any() and not zero.all()  # some groups are exactly zero, as at the optimum
    np.testing.assert_array_equal(zero, np.linalg.norm(b.value.reshape(4, 5), axis=1) < 1e-6)


def test_fused_lasso_matches_cvxpy_objective():
    cp = pytest.importorskip("cvxpy")
    x, y, rng = _problem(16, seed=1)
    w = rng.uniform(0.01, 0.2, 15).astype(np.float32)
    pen = fused_lasso(16)
    beta = lasso.solve(x, y, w, pen, num_iters=3000)
    b = cp.Variable(16)
    x64, y64, w64 = (a.astype(np.float64) for a in (x, y, w))
    obj = cp.sum_squares(y64 - x64 @ b) / (2 * len(y)) + w64 @ cp.abs(cp.diff(b))
    cp.Problem(cp.Minimize(obj)).solve(solver="CLARABEL")
    ours, theirs = _objective64(beta, x, y, w, pen), float(obj.value)
    assert abs(ours - theirs) <= 1e-5, (ours, theirs)
    assert ours >= theirs - 1e-5


def test_proxes_equal_their_definition():
    cp = pytest.importorskip("cvxpy")
    rng = np.random.default_rng(2)
    v = rng.standard_normal(9)
    tau = np.array([0.5, 10.0, 0.1])  # the second group is zeroed
    got = np.asarray(prox_group_lasso(v, tau, group_sizes=(2, 3, 4)), np.float64)
    p = cp.Variable(9)
    pen = sum(t * cp.norm(p[a:b]) for t, (a, b) in zip(tau, [(0, 2), (2, 5), (5, 9)], strict=True))
    cp.Problem(cp.Minimize(0.5 * cp.sum_squares(p - v) + pen)).solve(solver="CLARABEL")
    np.testing.assert_allclose(got, p.value, atol=1e-5)
    assert np.all(got[2:5] == 0)
    t1 = np.abs(rng.standard_normal(9)) * 0.7
    t1[0] = 0.0  # unpenalised coordinate
    got = np.asarray(prox_weighted_l1(v, t1), np.float64)
    q = cp.Variable(9)
    cp.Problem(cp.Minimize(0.5 * cp.sum_squares(q - v) + t1 @ cp.abs(q))).solve(solver="CLARABEL")
    np.testing.assert_allclose(got, q.value, atol=1e-5)
    assert got[0] == pytest.approx(v[0], abs=1e-7)


def test_vmapped_losses_equal_single_solves_and_tie_weights():
    rng = np.random.default_rng(3)
    xt, xv = rng.standard_normal((3, 12, 12)), rng.standard_normal((3, 7, 12))
    beta = rng.standard_normal((3, 12)) * (rng.random((3, 12)) < 0.5)
    yt = np.einsum("knd,kd->kn", xt, beta) + rng.standard_normal((3, 12))
    yv = np.einsum("knd,kd->kn", xv, beta) + rng.standard_normal((3, 7))
    inst = Instances(*(a.astype(np.float32) for a in (xt, yt, xv, yv, beta)))
    pen = tuning.group_lasso((3,) * 4)
    alphas = np.array([[0.05, 0.5], [0.2, 0.01]], np.float32)
    w = tie_weights(alphas, num_weights=4)
    np.testing.assert_array_equal(w[0], np.float32([0.05, 0.05, 0.5, 0.5]))
    u = np.asarray(
        tuning.validation_losses(inst.train, inst.val, w, pen, num_iters=200, chunk_size=2)
    )
    for i in range(3):
        for c in range(2):
            beta = lasso.solve(inst.xt[i], inst.yt[i], w[c], pen, num_iters=200)
            ref = np.mean((np.asarray(inst.yv[i]) - np.asarray(inst.xv[i]) @ np.asarray(beta)) ** 2)
            np.testing.assert_allclose(u[i, c], ref, rtol=1e-4)
    f = tuning.empirical_risk(inst.train, inst.val, pen, num_iters=200)
    np.testing.assert_allclose(f(alphas), u.mean(0), rtol=1e-5)


def test_fista_is_jittable_and_zero_at_large_weights():
    x, y, _ = _problem(6, n=10)
    pen = tuning.group_lasso((3, 3))
    solve = jax.jit(lambda w: lasso.solve(x, y, w, pen, num_iters=100))
    lam_max = max(np.linalg.norm(x[:, g].T @ y / 10) for g in (slice(0, 3), slice(3, 6)))
    assert np.all(np.asarray(solve(jnp.full(2, 1.01 * lam_max))) == 0)
    assert np.any(np.asarray(solve(jnp.full(2, 0.5 * lam_max))) != 0)


def test_bad_input_raises():
    x, y, _ = _problem(6, n=10)
    pen = tuning.group_lasso((3, 3))
    with pytest.raises(ValueError, match="non-negative"):
        lasso.solve(x, y, np.array([0.1, -0.1]), pen)
    with pytest.raises(ValueError, match="takes 2 weights"):
        lasso.solve(x, y, np.array([0.1, 0.1, 0.1]), pen)
    with pytest.raises(ValueError, match="group_sizes"):
        prox_group_lasso(np.ones(6), np.ones(2), group_sizes=(2, 3))
    with pytest.raises(ValueError, match="group_sizes"):
        tuning.group_lasso((3, 0))
    with pytest.raises(ValueError, match=r"\(n, 7\)"):
        lasso.solve(x, y, np.ones(2), tuning.group_lasso((3, 4)))
    with pytest.raises(ValueError, match="do not divide"):
        tie_weights(np.ones(3), num_weights=8)
    with pytest.raises(ValueError, match="num_features >= 2"):
        fused_lasso(1)
    with pytest.raises(ValueError, match="divide"):
        sample_fused_instances(jax.random.key(0), 2, num_features=10, jump_probs=(0.1,) * 4)
