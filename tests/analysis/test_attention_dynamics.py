"""P3 mean-field attention dynamics: invariants, RK4 accuracy, drift, W2 and input checks."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate

from lowrank_jax import analysis as an
from lowrank_jax.analysis.attention_dynamics import (
    attention_lipschitz,
    attention_velocity,
    drift_jump_ratio,
    drift_time_fit,
    gronwall_time_to_deviation,
    head_matrices,
    random_lowrank_perturbation,
    simulate_tokens,
    token_drift,
    wasserstein2,
)


def _setup(n=8, d=3, gap=0.2, seed=0):
    x0 = an.sample_sphere(jax.random.key(seed), n, d)
    return x0, jnp.eye(d), jnp.eye(d), an.gap_value_matrix(d, gap=gap)


def _velocity_np(x, q, k, v, beta, sphere):
    """float64 NumPy reference of the vector field."""
    logits = beta * (x @ q.T) @ (x @ k.T).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = p @ (x @ v.T)
    if sphere:
        y = y - np.sum(x * y, 1, keepdims=True) * x
    return y


def test_velocity_matches_numpy_and_is_tangent():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 4))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q, k = rng.normal(size=(2, 4)), rng.normal(size=(2, 4))  # a head narrower than the tokens
    v = rng.normal(size=(4, 4))
    for sphere in (True, False):
        got = attention_velocity(jnp.asarray(x, jnp.float32), q, k, v, beta=1.5, sphere=sphere)
        want = _velocity_np(x, q, k, v, 1.5, sphere)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    tangent = np.sum(x * _velocity_np(x, q, k, v, 1.5, True), 1)
    np.testing.assert_allclose(tangent, 0.0, atol=1e-12)


def test_rk4_conserves_the_sphere():
    x0, q, k, v = _setup(n=16, d=8)
    run = jax.jit(lambda x: simulate_tokens(x, q, k, v, dt=0.05, num_steps=400, record_every=40))
    traj = run(x0)
    norms = np.linalg.norm(np.asarray(traj, np.float64), axis=-1)
    assert traj.shape == (11, 16, 8)
    np.testing.assert_allclose(norms, 1.0, atol=2e-5)
    # The unnormalised variant does leave the sphere (V = diag(1, .8, ..) grows the norms).
    free = simulate_tokens(x0, q, k, v, dt=0.05, num_steps=40, sphere=False)
    assert np.min(np.linalg.norm(np.asarray(free[-1]), axis=-1)) > 1.5


def test_rk4_is_fourth_order_and_matches_solve_ivp():
    with jax.enable_x64(True):
        x0, q, k, v = (jnp.asarray(a, jnp.float64) for a in _setup(n=5, d=3))
        t_end = 2.0
        ref = scipy.integrate.solve_ivp(
            lambda t, y: _velocity_np(
                y.reshape(5, 3), *map(np.asarray, (q, k, v)), 1.0, True
            ).ravel(),
            (0.0, t_end),
            np.asarray(x0).ravel(),
            method="DOP853",
            rtol=1e-13,
            atol=1e-13,
        ).y[:, -1]
        errs = []
        for steps in (10, 20):
            x = simulate_tokens(x0, q, k, v, dt=t_end / steps, num_steps=steps)[-1]
            errs.append(np.max(np.abs(np.asarray(x).ravel() - ref)))
    assert 12.0 < errs[0] / errs[1] < 20.0, errs  # halving dt divides the error by 2^4 = 16
    assert errs[-1] < 1e-5


def test_zero_perturbation_gives_zero_drift():
    x0, q, k, v = _setup(n=8, d=3)
    zeros = jnp.zeros((2, 3, 3))
    for which in ("v",):
        drift = an.perturbed_drift(x0, q, k, v, zeros, which=which, num_steps=20, record_every=2)
        assert drift.shape == (2, 11)
        # float32: the perturbed and plain runs need not sum in the same order, so not bit-exact
        np.testing.assert_allclose(np.asarray(drift), 0.0, atol=1e-6)


def test_drift_and_time_to_deviation_follow_their_definitions():
    x0, q, k, v = _setup(n=8, d=3, gap=0.2)
    u = an.value_spectrum(v).second
    eps = jnp.asarray([0.01, 0.5])
    dvs = jax.vmap(lambda e: an.rank_one_perturbation(u, eps=e))(eps)
    kw = dict(dt=0.05, num_steps=200, record_every=4)
    drift, ref_t, x_t = jax.jit(
        lambda dvs: an.perturbed_drift(x0, q, k, v, dvs, return_final=True, **kw)
    )(dvs)
    # W2 of the final measures is at most the RMS (hence the max) token displacement.
    assert wasserstein2(x_t[1], ref_t) <= float(drift[1, -1]) + 1e-6
    sim = jax.jit(lambda vv: simulate_tokens(x0, q, k, vv, **kw))  # one compilation
    a, b = sim(v), sim(v + dvs[1])
    want = np.max(np.linalg.norm(np.asarray(a) - np.asarray(b), axis=-1), axis=-1)
    np.testing.assert_allclose(drift[1], want, atol=1e-5)
    t_dev = np.asarray(an.time_to_deviation(drift, dt_record=0.2, delta=0.1))
    first = int(np.argmax(want > 0.1))
    assert want[first] > 0.1 and np.all(want[:first] <= 0.1)
    np.testing.assert_allclose(t_dev[1], first * 0.2, rtol=1e-6)
    assert t_dev[0] == np.inf or t_dev[0] > t_dev[1]  # a smaller kick deviates later, if ever
    # Gronwall: no deviation before L^-1 log(1 + delta L / eps).
    lip = attention_lipschitz(q, k, v + dvs[1])
    assert t_dev[1] >= float(gronwall_time_to_deviation(0.5, delta=0.1, lipschitz=lip))


def test_gap_crossing_moves_the_top_eigenvalue():
    v = an.gap_value_matrix(4, gap=0.2)
    sp = an.value_spectrum(v)
    np.testing.assert_allclose(sp.gap, 0.2, rtol=1e-6)
    crossed = an.value_spectrum(v + an.rank_one_perturbation(sp.second, eps=0.3))
    aligned = an.value_spectrum(v + an.rank_one_perturbation(sp.top, eps=0.3))
    # lambda_2 + 0.3 overtakes lambda_1: the crossing direction is now on top.
    np.testing.assert_allclose(abs(crossed.top @ sp.second), 1.0, atol=1e-6)
    np.testing.assert_allclose(crossed.gap, 0.1, rtol=1e-4)
    np.testing.assert_allclose(abs(aligned.top[0]), 1.0, atol=1e-6)
    np.testing.assert_allclose(aligned.gap, 0.5, rtol=1e-5)
    dv = random_lowrank_perturbation(jax.random.key(1), 6, rank=2, eps=0.7)
    np.testing.assert_allclose(np.linalg.norm(dv), 0.7, rtol=1e-5)
    assert np.linalg.matrix_rank(np.asarray(dv, np.float64), tol=1e-5) == 2


def test_wasserstein2_equals_brute_force_assignment():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 2)), rng.normal(size=(5, 2))
    best = min(
        np.mean(np.sum((x - y[list(p)]) ** 2, axis=1)) for p in itertools.permutations(range(5))
    )
    np.testing.assert_allclose(wasserstein2(x, y), np.sqrt(best), rtol=1e-10)
    assert wasserstein2(x, x[::-1]) == pytest.approx(0.0, abs=1e-12)


def test_drift_time_fit_recovers_an_affine_law():
    eps = np.logspace(-3, 0, 7)
    fit = drift_time_fit(eps, 3.0 * np.log(1 / eps) + 2.0)
    assert fit["slope"] == pytest.approx(3.0) and fit["intercept"] == pytest.approx(2.0)
    assert fit["r2"] == pytest.approx(1.0)
    t = np.where(eps < 0.01, np.inf, 2.0 / eps**0.5)  # never-deviating points are left out
    fit = drift_time_fit(eps, t)
    assert fit["num_points"] == 5 and fit["r2"] < 0.99
    assert fit["power_exponent"] == pytest.approx(0.5) and fit["power_r2"] == pytest.approx(1.0)
    d_final = np.where(eps < 0.2, 0.01 * eps, 1.0)  # a jump between eps = 0.1 and 1
    assert drift_jump_ratio(d_final, eps, below=0.1, above=1.0) == pytest.approx(1.0 / 1e-3)
    assert np.isnan(drift_jump_ratio(d_final, eps, below=1e-4, above=1.0))


def test_bad_inputs_raise_clear_errors():
    x0, q, k, v = _setup(n=4, d=3)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        an.rank_one_perturbation(jnp.ones(3), eps=-0.1)
    with pytest.raises(ValueError, match="unit sphere"):
        simulate_tokens(2.0 * x0, q, k, v, num_steps=2)
    simulate_tokens(2.0 * x0, q, k, v, num_steps=2, sphere=False)  # fine in R^d
    with pytest.raises(ValueError, match=r"v must be \(d, d\)"):
        simulate_tokens(x0, q, k, jnp.eye(4), num_steps=2)
    with pytest.raises(ValueError, match="q and k must be"):
        simulate_tokens(x0, jnp.eye(4), k, v, num_steps=2)
    with pytest.raises(ValueError, match="beta"):
        simulate_tokens(x0, q, k, v, beta=-1.0, num_steps=2)
    with pytest.raises(ValueError, match="record_every"):
        simulate_tokens(x0, q, k, v, num_steps=5, record_every=2)
    with pytest.raises(ValueError, match="which must be"):
        an.perturbed_drift(x0, q, k, v, jnp.zeros((1, 3, 3)), which="o", num_steps=2)
    with pytest.raises(ValueError, match="deltas must be"):
        an.perturbed_drift(x0, q, k, v, jnp.zeros((3, 3)), num_steps=2)
    with pytest.raises(ValueError, match="same"):
        token_drift(x0, x0[:3])
    with pytest.raises(ValueError, match="point sets"):
        wasserstein2(np.zeros((3, 2)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="rank must lie"):
        random_lowrank_perturbation(jax.random.key(0), 3, rank=4, eps=1.0)
    with pytest.raises(ValueError, match="delta must be > 0"):
        an.time_to_deviation(jnp.zeros(3), dt_record=0.1, delta=0.0)


def test_head_matrices_reproduce_a_real_attention_head():
    from lowrank_jax.models.layers import SelfAttention

    d, heads = 8, 2
    x = jax.random.normal(jax.random.key(4), (1, 5, d))
    layer = SelfAttention(heads)
    variables = layer.init(jax.random.key(5), x)
    params = jax.tree.map(jnp.zeros_like, variables["params"])  # zero biases, kernels below
    kernels = {}
    for i, name in enumerate(("query", "key", "value", "out")):
        kernels[name] = jax.random.normal(jax.random.key(10 + i), (d, d)) / np.sqrt(d)
        params[name]["kernel"] = kernels[name]
    want = layer.apply({"params": params}, x)[0]
    got = sum(
        attention_velocity(
            x[0],
            *head_matrices(*kernels.values(), num_heads=heads, head=h),
            beta=1 / np.sqrt(d // heads),
            sphere=False,
        )
        for h in range(heads)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="head must lie"):
        head_matrices(*kernels.values(), num_heads=heads, head=2)
