"""P12 generalisation bound: hand-checked values of the pseudo-dimension count and the
uniform-convergence bound, its validity on a class whose supremum gap is known, bad inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lowrank_jax import tuning
from lowrank_jax.tuning.bounds import (
    lasso_loss_polynomials,
    pseudo_dimension_bound,
    uniform_convergence_bound,
    uniform_convergence_sample_size,
)
from lowrank_jax.tuning.lasso import fused_lasso


def _brute_force_pdim(p, m, deg):  # the largest N with 2^N <= (4e deg (N m + p) / p)^p
    n = 1
    while (n + 1) * math.log(2) <= p * math.log(4 * math.e * deg * ((n + 1) * m + p) / p):
        n += 1
    return n


def test_pseudo_dimension_bound_by_hand():
    # p = 1, one linear polynomial: 2^6 = 64 <= 4e * 7 = 76.1, 2^7 = 128 > 4e * 8 = 87.0.
    assert pseudo_dimension_bound(1, num_polys=1, degree=1) == 6
    # p = 2, one quadratic: 2^15 = 32768 <= (4e * 17)^2 = 34168, 2^16 = 65536 > (4e * 18)^2.
    assert pseudo_dimension_bound(2, num_polys=1, degree=2) == 15
    for p, m, deg in ((1, 3**5, 2), (4, 2**8, 2**20), (8, 7, 3)):
        assert pseudo_dimension_bound(p, num_polys=m, degree=deg) == _brute_force_pdim(p, m, deg)


def test_pseudo_dimension_grows_linearly_in_p_for_the_lasso_families():
    group = lasso_loss_polynomials(tuning.group_lasso((5,) * 8))
    fused = lasso_loss_polynomials(fused_lasso(41))
    assert group == (2**8, 2**49)
    assert fused == (3**40, 2)
    for m, deg in (group, fused):
        d = [pseudo_dimension_bound(p, num_polys=m, degree=deg) for p in (1, 2, 4, 8)]
        assert d == sorted(d) and 7 * d[0] < d[3] < 9 * d[0]  # ~ p * log(deg * m)


def test_uniform_convergence_bound_by_hand():
    # N = 100, d = 10, H = 1, δ = 0.05: sqrt(2*10*ln(10e)/100) + sqrt(ln(40)/200).
    want = math.sqrt(0.2 * (1 + math.log(10))) + math.sqrt(math.log(40) / 200)
    got = uniform_convergence_bound(100, pdim=10, loss_bound=1.0)
    assert float(got) == pytest.approx(want, rel=1e-12)
    assert float(got) == pytest.approx(0.9485, abs=1e-4)
    # Below N = d the growth function is 2^N: the bound exceeds H (vacuous).
    small = uniform_convergence_bound(np.array([2, 5]), pdim=10, loss_bound=3.0)
    np.testing.assert_allclose(
        small, 3.0 * (math.sqrt(2 * math.log(2)) + np.sqrt(math.log(40) / (2 * np.array([2, 5]))))
    )
    assert np.all(small > 3.0)
    # Linear in H, decreasing in N past d, smaller for a larger δ.
    ns = np.array([10, 50, 200, 1000])
    b = uniform_convergence_bound(ns, pdim=10, loss_bound=2.0)
    np.testing.assert_allclose(b, 2 * uniform_convergence_bound(ns, pdim=10, loss_bound=1))
    assert np.all(np.diff(b) < 0)
    assert np.all(uniform_convergence_bound(ns, pdim=10, loss_bound=2.0, delta=0.5) < b)


def test_sample_size_is_the_first_n_where_the_bound_reaches_epsilon():
    for eps, d, h in ((0.5, 10, 1.0), (0.2, 66, 6.0), (2.0, 3, 1.0)):
        n = uniform_convergence_sample_size(eps, pdim=d, loss_bound=h)
        assert float(uniform_convergence_bound(n, pdim=d, loss_bound=h)) <= eps
        assert n == 1 or float(uniform_convergence_bound(n - 1, pdim=d, loss_bound=h)) > eps
    assert uniform_convergence_sample_size(0.5, pdim=10, loss_bound=1.0) == 510
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        uniform_convergence_sample_size(0.0, pdim=3, loss_bound=1.0)


def test_bound_holds_for_thresholds_whose_supremum_gap_is_the_ks_statistic():
    # u(x, α) = 1[x > α], x ~ U[0, 1]: pseudo-dimension 1, sup_α |gap| = the KS statistic.
    rng = np.random.default_rng(0)
    n, reps = 40, 400
    x = np.sort(rng.uniform(size=(reps, n)), axis=1)
    i = np.arange(1, n + 1)
    ks = np.maximum(np.max(i / n - x, axis=1), np.max(x - (i - 1) / n, axis=1))
    bound = float(uniform_convergence_bound(n, pdim=1, loss_bound=1.0, delta=0.05))
    assert np.mean(ks <= bound) >= 0.95
    assert bound < 1.0  # not vacuous here, so the check means something


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="p must be an integer >= 1"):
        pseudo_dimension_bound(0, num_polys=1, degree=1)
    with pytest.raises(ValueError, match="degree must be an integer"):
        pseudo_dimension_bound(1, num_polys=1, degree=1.5)
    with pytest.raises(ValueError, match="num_instances must be integers >= 1"):
        uniform_convergence_bound(0, pdim=3, loss_bound=1.0)
    with pytest.raises(ValueError, match="delta must lie in"):
        uniform_convergence_bound(5, pdim=3, loss_bound=1.0, delta=1.0)
    with pytest.raises(ValueError, match="loss_bound must be > 0"):
        uniform_convergence_bound(5, pdim=3, loss_bound=0.0)
