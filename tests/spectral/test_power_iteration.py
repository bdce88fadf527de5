"""Implicit power iteration and randomised SVD against float64 NumPy SVD."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.spectral import (
    attention_group_power_iteration,
    attention_power_iteration,
    init_attention_power_iteration,
    randomized_svd,
)
from lowrank_jax.spectral.power_iteration import init_power_iteration, product_power_iteration


def _top_sv(a, b):
    return np.linalg.svd(np.asarray(a, np.float64) @ np.asarray(b, np.float64).T, compute_uv=False)[
        0
    ]


def _orthonormal(rng, n, k):
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return q


def test_random_factors_match_numpy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 8)).astype(np.float32)
    b = rng.standard_normal((48, 8)).astype(np.float32)
    v0 = init_power_iteration(jax.random.key(0), (), 48).v
    sigma, v = jax.jit(lambda a, b, v: product_power_iteration(a, b, v, num_iters=300))(a, b, v0)
    m = a.astype(np.float64) @ b.astype(np.float64).T
    _, s, vt = np.linalg.svd(m)
    np.testing.assert_allclose(float(sigma), s[0], rtol=1e-4)
    assert abs(float(np.dot(np.asarray(v, np.float64), vt[0]))) > 1 - 1e-4
    np.testing.assert_allclose(float(jnp.linalg.norm(v)), 1.0, rtol=1e-6)


@pytest.mark.parametrize("gap", [1e-2, 0.0])
def test_adversarial_close_top_singular_values(gap):
    # sigma_1 = 1, sigma_2 = 1 - gap: the vector converges slowly (or not at all for gap 0), sigma
    # must still be right.
    rng = np.random.default_rng(1)
    s = np.array([1.0, 1.0 - gap, 0.5, 0.3, 0.2, 0.1])
    a = (_orthonormal(rng, 40, 6) * s).astype(np.float32)
    b = _orthonormal(rng, 30, 6).astype(np.float32)
    v0 = jnp.ones(30) / np.sqrt(30.0)
    sigma, _ = product_power_iteration(a, b, v0, num_iters=1000)
    np.testing.assert_allclose(float(sigma), _top_sv(a, b), rtol=1e-4)


def test_estimate_is_monotone_lower_bound():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((50, 5)).astype(np.float32)
    b = rng.standard_normal((50, 5)).astype(np.float32)
    true = _top_sv(a, b)
    v = jnp.asarray(rng.standard_normal(50), jnp.float32)
    v = v / jnp.linalg.norm(v)
    prev = 0.0
    step = jax.jit(lambda a, b, v: product_power_iteration(a, b, v, num_iters=1))
    for _ in range(20):
        sigma, v = step(a, b, v)
        assert float(sigma) <= true * (1 + 1e-6)
        assert float(sigma) >= prev * (1 - 1e-6)
        prev = float(sigma)


def test_warm_start_tracks_drifting_weights_with_one_step():
    rng = np.random.default_rng(3)
    d, h, dh = 96, 4, 8
    wq = rng.standard_normal((d, h, dh)).astype(np.float32) / np.sqrt(d)
    wk = rng.standard_normal((d, h, dh)).astype(np.float32) / np.sqrt(d)
    state = init_attention_power_iteration(jax.random.key(0), wq)
    _, state = attention_power_iteration(wq, wk, state, num_iters=200)  # burn-in
    step = jax.jit(lambda q, k, s: attention_power_iteration(q, k, s, num_iters=1))
    for _ in range(100):  # a slow "training" drift, one power step per training step
        wq = wq + 1e-3 * rng.standard_normal(wq.shape).astype(np.float32) / np.sqrt(d)
        sigma, state = step(wq, wk, state)
    ref = [_top_sv(wq[:, i], wk[:, i]) for i in range(h)]
    np.testing.assert_allclose(np.asarray(sigma), ref, rtol=1e-3)
    # A transient (W_Q x 4) is tracked exactly after a single step: the direction is unchanged.
    sigma4, _ = step(4 * wq, wk, state)
    np.testing.assert_allclose(np.asarray(sigma4), 4 * np.asarray(ref), rtol=1e-3)
    assert int(state.count) == 300


def test_gqa_equals_expanded_keys_and_numpy():
    rng = np.random.default_rng(4)
    d, h, g, dh = 64, 6, 2, 8
    wq = rng.standard_normal((d, h, dh)).astype(np.float32)
    wk = rng.standard_normal((d, g, dh)).astype(np.float32)
    state = init_attention_power_iteration(jax.random.key(1), wq)
    fn = jax.jit(lambda q, k, s: attention_power_iteration(q, k, s, num_iters=400))
    sigma_gqa, st_gqa = fn(wq, wk, state)
    wk_expanded = np.repeat(wk, h // g, axis=1)  # head i uses key head i // (h // g)
    sigma_mha, st_mha = fn(wq, wk_expanded, state)
    np.testing.assert_allclose(np.asarray(sigma_gqa), np.asarray(sigma_mha), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(st_gqa.v), np.asarray(st_mha.v), rtol=1e-5, atol=1e-6)
    ref = [_top_sv(wq[:, i], wk[:, i // (h // g)]) for i in range(h)]
    np.testing.assert_allclose(np.asarray(sigma_gqa), ref, rtol=1e-4)


def test_vmap_over_layers_equals_loop():
    rng = np.random.default_rng(5)
    layers, d, h, g, dh = 3, 32, 4, 2, 4
    wq = rng.standard_normal((layers, d, h, dh)).astype(np.float32)
    wk = rng.standard_normal((layers, d, g, dh)).astype(np.float32)
    states = jax.vmap(init_attention_power_iteration)(
        jax.random.split(jax.random.key(2), layers), wq
    )
    fn = lambda q, k, s: attention_power_iteration(q, k, s, num_iters=300)
    sigma, _ = jax.jit(jax.vmap(fn))(wq, wk, states)
    assert sigma.shape == (layers, h)
    for li in range(layers):
        st = jax.tree.map(lambda x, li=li: x[li], states)
        np.testing.assert_allclose(
            np.asarray(sigma[li]), np.asarray(fn(wq[li], wk[li], st)[0]), rtol=1e-6
        )
        ref = [_top_sv(wq[li, :, i], wk[li, :, i // 2]) for i in range(h)]
        np.testing.assert_allclose(np.asarray(sigma[li]), ref, rtol=1e-4)


def test_group_stacked_sigma_matches_numpy_and_brackets_heads():
    rng = np.random.default_rng(6)
    d, h, g, dh = 40, 6, 2, 5
    m = h // g
    wq = rng.standard_normal((d, h, dh)).astype(np.float32)
    wk = rng.standard_normal((d, g, dh)).astype(np.float32)
    state = init_power_iteration(jax.random.key(3), (g,), d)
    sigma_g, st = attention_group_power_iteration(wq, wk, state, num_iters=500)
    assert st.v.shape == (g, d)
    for j in range(g):
        heads = range(j * m, (j + 1) * m)
        stacked = np.concatenate(
            [wq[:, i].astype(np.float64) @ wk[:, j].astype(np.float64).T for i in heads], axis=0
        )
        ref = np.linalg.svd(stacked, compute_uv=False)[0]
        np.testing.assert_allclose(float(sigma_g[j]), ref, rtol=1e-4)
        per_head = max(_top_sv(wq[:, i], wk[:, j]) for i in heads)
        assert per_head <= ref * (1 + 1e-6) <= np.sqrt(m) * per_head * (1 + 1e-6)


def test_zero_weights_give_zero_sigma_without_nan():
    v0 = jnp.ones(8) / np.sqrt(8.0)
    sigma, v = product_power_iteration(jnp.zeros((8, 2)), jnp.zeros((8, 2)), v0, num_iters=3)
    assert float(sigma) == 0.0
    assert np.all(np.isfinite(np.asarray(v)))


def test_bad_inputs_raise():
    v = jnp.ones(4)
    with pytest.raises(ValueError, match="inner dimension"):
        product_power_iteration(jnp.ones((4, 2)), jnp.ones((4, 3)), v)
    with pytest.raises(ValueError, match="num_iters"):
        product_power_iteration(jnp.ones((4, 2)), jnp.ones((4, 2)), v, num_iters=0)
    with pytest.raises(ValueError, match="multiple"):
        wq = jnp.ones((8, 3, 2))
        attention_power_iteration(
            wq, jnp.ones((8, 2, 2)), init_attention_power_iteration(jax.random.key(0), wq)
        )
    with pytest.raises(ValueError, match=r"\(d, H, d_h\)"):
        attention_power_iteration(jnp.ones((8, 6)), jnp.ones((8, 6)), None)


def test_randomized_svd_exact_low_rank():
    rng = np.random.default_rng(7)
    k = 5
    s_true = np.array([10.0, 5.0, 3.0, 2.0, 1.0])
    a = (_orthonormal(rng, 120, k) * s_true) @ _orthonormal(rng, 80, k).T
    u, s, vt = jax.jit(lambda key, a: randomized_svd(key, a, rank=k))(
        jax.random.key(0), a.astype(np.float32)
    )
    assert u.shape == (120, k) and s.shape == (k,) and vt.shape == (k, 80)
    np.testing.assert_allclose(np.asarray(s), s_true, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(u.T @ u), np.eye(k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(vt @ vt.T), np.eye(k), atol=1e-5)
    np.testing.assert_allclose(np.asarray((u * s) @ vt), a, atol=1e-5)


def test_randomized_svd_with_noise_tail_matches_numpy():
    rng = np.random.default_rng(8)
    a = rng.standard_normal((150, 100)) * 0.1 + (
        rng.standard_normal((150, 8)) * 3
    ) @ rng.standard_normal((8, 100))
    k = 8
    u, s, vt = randomized_svd(jax.random.key(1), a.astype(np.float32), rank=k, num_power_iters=3)
    s_ref = np.linalg.svd(a, compute_uv=False)
    np.testing.assert_allclose(np.asarray(s), s_ref[:k], rtol=1e-4)
    err = np.linalg.norm(a - np.asarray((u * s) @ vt, np.float64), 2)
    assert err <= s_ref[k] * (1 + 1e-3)


def test_randomized_svd_bad_inputs():
    with pytest.raises(ValueError, match="rank"):
        randomized_svd(jax.random.key(0), jnp.ones((4, 3)), rank=4)
    with pytest.raises(ValueError, match="2-D"):
        randomized_svd(jax.random.key(0), jnp.ones((2, 4, 3)), rank=1)
    with pytest.raises(TypeError, match="floating"):
        randomized_svd(jax.random.key(0), jnp.ones((4, 3), jnp.int32), rank=1)


@pytest.mark.parametrize("gap", [1e-3, 0.0])
def test_lanczos_matches_numpy_in_few_steps_on_clustered_spectra(gap):
    rng = np.random.default_rng(9)
    s = np.concatenate([[1.0, 1.0 - gap], np.linspace(0.98, 0.1, 10)])
    a = (_orthonormal(rng, 60, 12) * s).astype(np.float32)
    b = _orthonormal(rng, 50, 12).astype(np.float32)
    v0 = jnp.asarray(rng.standard_normal(50), jnp.float32)
    fn = jax.jit(lambda a, b, v: product_power_iteration(a, b, v, num_iters=12, method="lanczos"))
    sigma, v = fn(a, b, v0 / jnp.linalg.norm(v0))
    np.testing.assert_allclose(float(sigma), _top_sv(a, b), rtol=1e-5)
    np.testing.assert_allclose(float(jnp.linalg.norm(v)), 1.0, rtol=1e-5)
    # the Ritz vector is a good warm start: ||M v|| is within 1e-4 of sigma
    m = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(
        np.linalg.norm(m @ np.asarray(v, np.float64)), _top_sv(a, b), rtol=1e-4
    )
    # the power iteration with the same number of products is far off on this spectrum
    sigma_pow, _ = product_power_iteration(a, b, v0 / jnp.linalg.norm(v0), num_iters=12)
    assert abs(float(sigma_pow) - _top_sv(a, b)) > 10 * abs(float(sigma) - _top_sv(a, b))


def test_lanczos_gqa_equals_expanded_keys():
    rng = np.random.default_rng(10)
    d, h, g, dh = 64, 4, 2, 8
    wq = rng.standard_normal((d, h, dh)).astype(np.float32)
    wk = rng.standard_normal((d, g, dh)).astype(np.float32)
    state = init_attention_power_iteration(jax.random.key(4), wq)
    fn = jax.jit(lambda q, k, s: attention_power_iteration(q, k, s, num_iters=8, method="lanczos"))
    sigma_gqa, _ = fn(wq, wk, state)
    sigma_mha, _ = fn(wq, np.repeat(wk, h // g, axis=1), state)
    np.testing.assert_allclose(np.asarray(sigma_gqa), np.asarray(sigma_mha), rtol=1e-6)
    ref = [_top_sv(wq[:, i], wk[:, i // 2]) for i in range(h)]
    np.testing.assert_allclose(np.asarray(sigma_gqa), ref, rtol=1e-4)
    with pytest.raises(ValueError, match="method"):
        product_power_iteration(wq[:, 0], wk[:, 0], jnp.ones(d), method="krylov")


def test_lanczos_more_steps_than_rank_is_stable():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((40, 3)).astype(np.float32)
    b = rng.standard_normal((30, 3)).astype(np.float32)
    sigma, v = product_power_iteration(
        a, b, jnp.ones(30) / np.sqrt(30.0), num_iters=20, method="lanczos"
    )
    assert np.all(np.isfinite(np.asarray(v)))
    np.testing.assert_allclose(float(sigma), _top_sv(a, b), rtol=1e-5)
