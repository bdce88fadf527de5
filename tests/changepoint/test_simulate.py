"""P17 calibration by simulation: the fitted null model, the in-scan sampler, the thresholds."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import simulate, synthetic
from lowrank_jax.changepoint.detectors import totals_cusum

P = L = 6


def _lam():
    return synthetic.lowrank_intensity(jax.random.key(0), p=P, num_cells=L, rank=2, mean=3.0)


def _numpy_streams(seed, rho, num, length):
    return synthetic.sample_streams(
        jax.random.key(seed), _lam(), num_streams=num, length=length, rho=rho, sigma=0.3
    )


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_fit_recovers_the_factor_and_the_sampler_matches_numpy(rho):
    train = _numpy_streams(1, rho, 1, 20000)[0]
    fit = simulate.fit_null_model(train)
    assert fit.sigma == pytest.approx(0.3, abs=0.03) and fit.rho == pytest.approx(rho, abs=0.08)
    np.testing.assert_allclose(fit.rates, _lam(), rtol=0.05)
    model = simulate.NullModel(_lam(), rho, 0.3)
    ours = simulate.sample_counts(model, key=jax.random.key(2), num_streams=8, length=2500)
    ref = _numpy_streams(3, rho, 8, 2500)
    for y in (ours, ref):  # same cell means, over-dispersion of the totals and lag-1 covariance
        x = y.sum((2, 3)).astype(np.float64)
        m = x.mean()
        np.testing.assert_allclose(y.mean((0, 1)), _lam(), rtol=0.08)
        assert x.var() == pytest.approx(m + m**2 * math.expm1(0.09), rel=0.12)
        lag = np.mean((x[:, 1:] - m) * (x[:, :-1] - m))
        assert lag == pytest.approx(m**2 * math.expm1(rho * 0.09), abs=0.15 * m**2 * 0.09)


def test_simulated_threshold_gives_nominal_rate_on_numpy_null_streams():
    """Threshold simulated from the model fitted to a training stretch; false alarms counted on
    fresh streams of the independent NumPy sampler (the experiment's training-stretch sampler)."""
    alpha, horizon, n_cal, n_test = 0.1, 200, 400, 400
    train = _numpy_streams(4, 0.5, 1, 6000)[0]
    fit = simulate.fit_null_model(train)
    det = {"lowrank": cp.lowrank_scan(train.mean(0), rank=2, num_scales=3, alpha=alpha)}
    cal = simulate.calibrate_by_simulation(
        det, fit, key=jax.random.key(5), alpha=alpha, horizon=horizon, num_streams=n_cal, batch=200
    )["lowrank"]
    null = _numpy_streams(6, 0.5, n_test, horizon)
    flat = null.reshape(-1, P, L)
    scores = cp.run_detector(det["lowrank"], flat, index=np.arange(len(flat)).reshape(n_test, -1))
    rate = np.mean(cp.first_alarm(scores, cal.threshold) > 0)
    se = math.sqrt(alpha * (1 - alpha) / n_test) + math.sqrt(alpha * (1 - alpha) / n_cal)
    assert abs(rate - alpha) <= 3 * se, (rate, cal.threshold)


def test_change_and_refit():
    model = simulate.NullModel(_lam(), 0.0, 0.0)
    dets = {"tot": totals_cusum(float(_lam().sum()), rel_change=0.1)}
    kw = dict(key=jax.random.key(7), num_streams=40, horizon=120, chunk=8, batch=40)
    null = simulate.simulate_scores(dets, model, **kw)["tot"]
    change = simulate.simulate_scores(dets, model, tau=60, rates_after=2 * _lam(), **kw)["tot"]
    np.testing.assert_array_equal(change[:, :60], null[:, :60])  # same draws before the change
    assert change[:, -1].min() > 10 * null.max()
    # re-estimated rates (training stretches of 20): the maxima spread more than with the truth
    refit = {"tot": lambda mean: totals_cusum(mean.sum(), rel_change=0.1)}
    loose = simulate.simulate_scores(dets, model, refit=refit, num_train=20, **kw)["tot"]
    assert np.quantile(loose.max(1), 0.9) > np.quantile(null.max(1), 0.9)


def test_inversion_never_counts_through_all_terms():
    """float32 CDF sums fall short of 1 by up to ~2e-7: a uniform above that (a float32 uniform
    can be 1 - 2^-23) would count through all K terms. The sampler's uniforms stay below U_MAX."""
    model = simulate.NullModel(_lam(), 0.5, 0.3)
    k = simulate._num_terms(simulate.check_model(model), None)
    lam = jnp.linspace(0.01, float(_lam().max()) * math.exp(4 * 0.3), 20000)
    top = simulate._invert(jnp.full(lam.shape, simulate.U_MAX), lam, k)
    assert int(top.max()) < k
    assert int(simulate._invert(jnp.full(lam.shape, 1 - 2.0**-23), lam, k).max()) == k  # the bug


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="rho"):
        simulate.check_model(simulate.NullModel(_lam(), 1.0, 0.1))
    with pytest.raises(ValueError, match="rates"):
        simulate.check_model(simulate.NullModel(-_lam(), 0.0, 0.1))
    dets = {"tot": totals_cusum(1.0)}
    model = simulate.NullModel(_lam(), 0.0, 0.0)
    with pytest.raises(ValueError, match="num_train"):
        simulate.simulate_scores(
            dets, model, key=jax.random.key(0), num_streams=2, horizon=4, refit={"tot": None}
        )
    with pytest.raises(ValueError, match="rates_after"):
        simulate.simulate_scores(
            dets, model, key=jax.random.key(0), num_streams=2, horizon=4, rates_after=np.ones(3)
        )
    with pytest.raises(ValueError, match="events"):
        simulate.fit_null_model(np.zeros((5, 2, 2)))
