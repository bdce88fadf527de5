"""P19 TPV: closed forms on a linear model (where the linearisation is exact)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis.tpv import (
    hutchinson_trace_heff,
    per_example_jacobians,
    quantization_variance,
    tpv_label_noise,
    tpv_quantization_mc,
    trace_heff,
)

K, D = 3, 4


def _linear(params, x):
    return params["w"] @ x + params["b"]


def _setup(n=20):
    kw, kx = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(kw, (K, D)), "b": jnp.linspace(-1.0, 1.0, K)}
    x = jax.random.normal(kx, (n, D))
    return params, x


def test_trace_heff_linear_closed_form_and_hutchinson():
    params, x = _setup()
    xn = np.asarray(x, np.float64)
    want = K * (np.mean(np.sum(xn**2, 1)) + 1.0)  # ‖J(x)‖_F² = K (‖x‖² + 1)
    np.testing.assert_allclose(float(trace_heff(_linear, params, x, chunk=7)), want, rtol=1e-5)
    # Rademacher v has ‖v‖² = K: each Hutchinson term is K(‖x‖² + 1) for the sampled x.
    est = float(hutchinson_trace_heff(_linear, params, x, key=jax.random.key(1), num_samples=4000))
    np.testing.assert_allclose(est, want, rtol=0.05)
    jac = per_example_jacobians(_linear, params, x, chunk=8)
    np.testing.assert_allclose(
        np.asarray(jac["w"][2]), np.kron(np.eye(K), xn[2]).reshape(K, K, D), atol=1e-6
    )


def test_quantization_tpv_closed_form_matches_monte_carlo():
    params, x = _setup()
    flat = np.concatenate([np.ravel(params["w"]), np.ravel(params["b"])]).astype(np.float64)
    delta = (flat.max() - flat.min()) / (2**4 - 1)
    np.testing.assert_allclose(
        float(quantization_variance(params, bits=4)), delta**2 / 12, rtol=1e-5
    )
    exact = float(analysis.tpv_quantization(_linear, params, x, bits=4))
    xn = np.asarray(x, np.float64)
    np.testing.assert_allclose(
        exact, delta**2 / 12 * K * (np.mean(np.sum(xn**2, 1)) + 1), rtol=1e-5
    )
    mc = float(
        tpv_quantization_mc(_linear, params, x, key=jax.random.key(2), bits=4, num_runs=3000)
    )
    np.testing.assert_allclose(mc, exact, rtol=0.06)


def test_label_noise_tpv_linear_closed_form():
    params, x = _setup(n=20)
    sigma, prox = 0.5, 0.1
    got = float(
        tpv_label_noise(
            _linear,
            params,
            x,
            key=jax.random.key(3),
            sigma=sigma,
            num_runs=300,
            steps=400,
            learning_rate=0.1,
            prox=prox,
        )
    )
    xt = np.concatenate([np.asarray(x, np.float64), np.ones((20, 1))], 1)
    s = xt @ np.linalg.solve(xt.T @ xt / 20 + prox * np.eye(D + 1), xt.T) / 20
    want = sigma**2 * K * np.trace(s @ s) / 20
    np.testing.assert_allclose(got, want, rtol=0.12)


def test_bad_inputs_raise():
    params, x = _setup()
    with pytest.raises(ValueError, match="bits"):
        quantization_variance(params, bits=0)
    with pytest.raises(ValueError, match="chunk"):
        trace_heff(_linear, params, x, chunk=0)
    with pytest.raises(ValueError, match="sigma"):
        tpv_label_noise(_linear, params, x, key=jax.random.key(0), sigma=-1.0)
