"""lowrank_jax.fp8: tail-bound inversion, the bound against random draws, delayed scaling, casting."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrank_jax.fp8 import (
    ScaleRule,
    chernoff_gamma,
    fp8_max,
    fp8_quantize_dequantize,
    init_delayed_scaling,
    logit_bound,
    rank_aware_tightness,
    update_delayed_scaling,
    worst_case_logit_bound,
)
from lowrank_jax.fp8.bounds import (
    geometry_aware_scale,
    norm_gain_bound,
    rank_agnostic_alpha,
    rank_agnostic_scale,
    rank_agnostic_tail_bound,
    rank_aware_alpha,
    rank_aware_tail_bound,
)
from lowrank_jax.fp8.delayed import current_scale
from lowrank_jax.fp8.emulation import fp8_overflow_count
from lowrank_jax.spectral import attention_power_iteration, init_attention_power_iteration


def test_formats():
    assert fp8_max("e4m3") == 448.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert fp8_max("e5m2") == 57344.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)
    assert fp8_max(jnp.float8_e4m3fn) == 448.0
    with pytest.raises(ValueError, match="e4m3"):
        fp8_max("e3m4")


@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_alpha_inverts_tail_bounds(gamma):
    kw = dict(d=4096, seq_len=2048)
    a = rank_aware_alpha(rank=128, delta=1e-6, gamma=gamma, **kw)
    np.testing.assert_allclose(
        float(rank_aware_tail_bound(a, rank=128, gamma=gamma, **kw)), 1e-6, rtol=1e-4
    )
    b = rank_agnostic_alpha(delta=1e-6, **kw)
    np.testing.assert_allclose(float(rank_agnostic_tail_bound(b, **kw)), 1e-6, rtol=1e-4)
    # rank-aware thresholds are sqrt(d / (gamma r)) times smaller, scales that much larger
    ratio, sqrt_ratio = rank_aware_tightness(d=4096, rank=128, gamma=gamma)
    assert ratio == 4096 / (gamma * 128)
    np.testing.assert_allclose(b / a, sqrt_ratio, rtol=1e-12)
    sig = jnp.array([0.5, 2.0])
    s_aware = geometry_aware_scale(sig, head_dim=128, delta=1e-6, gamma=gamma, **kw)
    s_agn = rank_agnostic_scale(sig, head_dim=128, delta=1e-6, **kw)
    np.testing.assert_allclose(np.asarray(s_aware / s_agn), sqrt_ratio, rtol=1e-5)


def test_scale_closed_form_float64():
    sigma = np.array([[0.7, 1.3], [2.0, 0.1]])
    d, dh, n, delta, gamma, g, c = 1024, 64, 512, 1e-5, 1.5, 1.7, 1.25
    s = geometry_aware_scale(
        sigma,
        d=d,
        head_dim=dh,
        seq_len=n,
        norm_gain=g,
        delta=delta,
        gamma=gamma,
        calibration=c,
        fmt="e5m2",
    )
    ref = (
        c
        * 57344.0
        * math.sqrt(dh)
        / (g**2 * sigma * math.sqrt(gamma * dh * math.log(2 * n * n / delta)))
    )
    np.testing.assert_allclose(np.asarray(s), ref, rtol=1e-6)
    assert s.shape == (2, 2) and s.dtype == jnp.float32
    b_wc = worst_case_logit_bound(sigma, d=d, head_dim=dh, norm_gain=g)
    np.testing.assert_allclose(np.asarray(b_wc), sigma * d * g**2 / math.sqrt(dh), rtol=1e-6)


def _sphere(rng, shape, d, g):
    x = rng.standard_normal((*shape, d))
    return g * math.sqrt(d) * x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize(
    ("spectrum", "gamma"), [("gaussian", None), ("flat", None), ("gaussian", 2.0)]
)
def test_bound_never_exceeded_over_random_draws(spectrum, gamma):
    # Isotropic tokens with ||x|| = g sqrt(d) (LayerNorm outputs), 300 draws of n tokens each; at
    # delta = 1e-3 the expected number of violations is <= 0.3, the observed one must be 0.
    # gamma=None is chernoff_gamma (valid for any spectrum); gamma=2 needs a decaying spectrum.
    rng = np.random.default_rng(0)
    d, dh, n, g, delta, draws = 256, 16, 64, 1.5, 1e-3, 300
    if spectrum == "gaussian":
        wq = rng.standard_normal((d, dh)) / math.sqrt(d)
        wk = rng.standard_normal((d, dh)) / math.sqrt(d)
    else:  # all r singular values equal: the worst case for the rank-aware bound
        wq = np.linalg.qr(rng.standard_normal((d, dh)))[0]
        wk = np.linalg.qr(rng.standard_normal((d, dh)))[0]
    sigma = np.linalg.svd(wq @ wk.T, compute_uv=False)[0]
    x = _sphere(rng, (draws, n), d, g)
    s = np.einsum("bik,bjk->bij", x @ wq, x @ wk) / math.sqrt(dh)
    emp = np.abs(s).max(axis=(1, 2))
    kw = dict(d=d, head_dim=dh, seq_len=n, norm_gain=g, delta=delta)
    bound = float(logit_bound(sigma, gamma=gamma, **kw))
    b_wc = float(worst_case_logit_bound(sigma, d=d, head_dim=dh, norm_gain=g))
    assert np.all(emp <= b_wc)
    assert int(np.sum(emp > bound)) == 0, (emp.max(), bound)
    assert emp.max() > 0.3 * bound  # and it is not vacuous
    assert bound < float(logit_bound(sigma, rank_aware=False, **kw))
    # the scale keeps every draw inside the FP8 range
    scale = float(geometry_aware_scale(sigma, gamma=gamma, **kw))
    assert int(fp8_overflow_count(jnp.asarray(s, jnp.float32), scale)) == 0


def test_flat_spectrum_with_gamma_one_is_violated():
    # The test above has power: with gamma = 1 the flat spectrum exceeds the bound (sub-exponential
    # tail), which is why the default gamma is chernoff_gamma.
    rng = np.random.default_rng(0)
    d, dh, n, delta = 256, 16, 64, 1e-3
    wq = np.linalg.qr(rng.standard_normal((d, dh)))[0]
    wk = np.linalg.qr(rng.standard_normal((d, dh)))[0]
    x = _sphere(rng, (300, n), d, 1.0)
    emp = np.abs(np.einsum("bik,bjk->bij", x @ wq, x @ wk)).max(axis=(1, 2)) / math.sqrt(dh)
    bound = float(logit_bound(1.0, d=d, head_dim=dh, seq_len=n, delta=delta, gamma=1.0))
    assert int(np.sum(emp > bound)) > 30


def test_chernoff_gamma_solves_the_legendre_transform():
    from scipy.optimize import minimize_scalar

    for r, n, delta in [(16, 64, 1e-3), (128, 4096, 1e-6)]:
        gamma = chernoff_gamma(rank=r, seq_len=n, delta=delta)
        big_l = math.log(2 * n * n / delta)
        t = math.sqrt(gamma * r * big_l)
        res = minimize_scalar(
            lambda lam, t=t, r=r: -(lam * t + 0.5 * r * math.log(1 - lam * lam)),
            bounds=(0.0, 1 - 1e-12),
            method="bounded",
            options={"xatol": 1e-12},
        )
        np.testing.assert_allclose(-res.fun, big_l, rtol=1e-6)
        assert 2.0 < gamma < 4.0


def _delayed_reference(amaxes, history_len, margin, algo, r=448.0, init_scale=1.0):
    history, scale, used = [0.0] * history_len, init_scale, []
    for a in amaxes:
        used.append(scale)  # the scale applied at this step was computed before seeing `a`
        history = [a, *history[:-1]]
        ref = max(history) if algo == "max" else history[0]
        if ref > 0 and np.isfinite(ref):
            scale = r / ref / 2.0**margin
    return np.array(used), scale


@pytest.mark.parametrize(
    ("history_len", "margin", "algo"), [(4, 0, "max"), (1, 1, "max"), (3, 0, "most_recent")]
)
def test_delayed_scaling_matches_definition_step_by_step(history_len, margin, algo):
    amaxes = [1.0, 2.0, 0.5, 0.0, 8.0, np.inf, 0.25, 0.3, 0.2, 0.1, 3.0, 0.05]
    ref_used, ref_final = _delayed_reference(amaxes, history_len, margin, algo)
    state = init_delayed_scaling((), history_len=history_len)
    update = jax.jit(lambda s, a: update_delayed_scaling(s, a, margin=margin, algo=algo))
    used = []
    for a in amaxes:
        used.append(float(state.scale))
        state = update(state, jnp.float32(a))
    np.testing.assert_allclose(used, ref_used, rtol=1e-6)
    np.testing.assert_allclose(float(state.scale), ref_final, rtol=1e-6)
    assert int(state.count) == len(amaxes) and state.amax_history.shape == (history_len,)


def test_delayed_scaling_agrees_with_flax_fp8_ops_compute_scale():
    from flax.linen import fp8_ops  # Flax stores 1/scale

    state = init_delayed_scaling((3,), history_len=5)
    rng = np.random.default_rng(1)
    for _ in range(8):
        amax = jnp.asarray(rng.uniform(0.1, 10.0, 3), jnp.float32)
        new = update_delayed_scaling(state, amax, margin=1)
        flax_inv = fp8_ops.compute_scale(
            jnp.max(new.amax_history, 0), 1.0 / state.scale, 448.0, margin=1
        )
        np.testing.assert_allclose(np.asarray(new.scale), 1.0 / np.asarray(flax_inv), rtol=1e-6)
        state = new


def test_current_scale_and_bad_inputs():
    np.testing.assert_allclose(np.asarray(current_scale(jnp.array([2.0, 0.0]))), [224.0, 1.0])
    with pytest.raises(ValueError, match="algo"):
        update_delayed_scaling(init_delayed_scaling(), 1.0, algo="mean")
    with pytest.raises(ValueError, match="shape"):
        update_delayed_scaling(init_delayed_scaling((2,)), jnp.ones(3))
    with pytest.raises(ValueError, match="delta"):
        rank_aware_alpha(d=8, rank=2, seq_len=4, delta=1.5)
    with pytest.raises(ValueError, match="history_len"):
        init_delayed_scaling(history_len=0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_dequantize_against_ml_dtypes(fmt):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(1000) * 3).astype(np.float32)
    scale = np.float32(11.0)
    dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
    r = fp8_max(fmt)
    ref = np.clip(x * scale, -r, r).astype(dt).astype(np.float32) / scale
    y = jax.jit(lambda x: fp8_quantize_dequantize(x, scale, fmt=fmt))(x)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-6)
    # relative rounding error of the normal range: 2^-(mantissa bits + 1)
    big = np.abs(x * scale) > 1.0
    rel = np.abs(np.asarray(y) - x)[big] / np.abs(x)[big]
    assert rel.max() <= (2.0**-4 if fmt == "e4m3" else 2.0**-3) + 1e-7


def test_saturation_overflow_and_gradient():
    x = jnp.array([1000.0, -50.0, 10.0], jnp.float32)
    y = fp8_quantize_dequantize(x, 1.0)
    np.testing.assert_allclose(np.asarray(y), [448.0, -48.0, 10.0])  # 50 rounds to 48 in E4M3
    assert np.isnan(np.asarray(fp8_quantize_dequantize(x, 1.0, saturate=False))[0])
    assert int(fp8_overflow_count(x, 1.0)) == 1 and int(fp8_overflow_count(x, 10.0)) == 2
    grad = jax.grad(lambda x: fp8_quantize_dequantize(x, 1.0).sum())(x)
    np.testing.assert_allclose(np.asarray(grad), [0.0, 1.0, 1.0])


def test_norm_gain_bound_covers_layernorm_outputs():
    rng = np.random.default_rng(3)
    d = 64
    gain, bias = rng.uniform(0.5, 2.0, d), rng.standard_normal(d) * 0.3
    h = rng.standard_normal((500, d)) * 5 + 2
    xhat = (h - h.mean(-1, keepdims=True)) / h.std(-1, keepdims=True)
    x = gain * xhat + bias
    g = float(norm_gain_bound(gain, bias))
    assert np.linalg.norm(x, axis=-1).max() <= g * math.sqrt(d) * (1 + 1e-6)
    assert float(norm_gain_bound(jnp.float32(1.5))) == 1.5


def test_scale_rule_on_tracked_sigma_vmapped_over_layers():
    rng = np.random.default_rng(4)
    layers, d, h, g, dh = 2, 64, 4, 2, 8
    wq = rng.standard_normal((layers, d, h, dh)).astype(np.float32) / 8
    wk = rng.standard_normal((layers, d, g, dh)).astype(np.float32) / 8
    st = jax.vmap(init_attention_power_iteration)(jax.random.split(jax.random.key(0), layers), wq)
    rule = ScaleRule(seq_len=128)

    def fn(q, k, s):
        sigma, s = attention_power_iteration(q, k, s, num_iters=300)
        return rule.scales(sigma, d=d, head_dim=dh, norm_gain=1.2), s

    scales, st = jax.jit(jax.vmap(fn))(wq, wk, st)
    assert scales.shape == (layers, h)
    sigma = np.array(
        [
            [
                np.linalg.svd(
                    wq[li, :, i].astype(np.float64) @ wk[li, :, i // 2].T, compute_uv=False
                )[0]
                for i in range(h)
            ]
            for li in range(layers)
        ]
    )
    ref = geometry_aware_scale(sigma, d=d, head_dim=dh, seq_len=128, norm_gain=1.2)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(ref), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(st.sigma), sigma, rtol=1e-4)
