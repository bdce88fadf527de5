"""Exact σ_max(W_Q W_Kᵀ) by the thin-QR core against a float64 NumPy SVD of the d×d product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import fp8
from lowrank_jax.fp8.policies import GeometryScalingState
from lowrank_jax.fp8.sigma import attention_top_singular, split_heads


def _svd64(wq, wk):
    wq, wk = np.asarray(wq, np.float64), np.asarray(wk, np.float64)
    lead, (d, h, dh), g = wq.shape[:-3], wq.shape[-3:], wk.shape[-2]
    wq, wk = wq.reshape(-1, d, h, dh), wk.reshape(-1, d, g, dh)
    s, v = np.zeros((len(wq), h)), np.zeros((len(wq), h, d))
    for i in range(len(wq)):
        for j in range(h):
            _, sv, vt = np.linalg.svd(wq[i, :, j] @ wk[i, :, j // (h // g)].T)
            s[i, j], v[i, j] = sv[0], vt[0]
    return s.reshape(*lead, h), v.reshape(*lead, h, d)


@pytest.mark.parametrize(
    "shape", [((3,), 64, 8, 2, 12), ((), 40, 4, 4, 8), ((2, 2), 16, 6, 3, 24)]
)  # layers, d, H, G, d_h (the last has d < d_h: rank-deficient cores)
def test_thin_qr_core_is_exact_against_float64_svd(shape):
    lead, d, h, g, dh = shape
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((*lead, d, h, dh)).astype(np.float32) / np.sqrt(d)
    wk = rng.standard_normal((*lead, d, g, dh)).astype(np.float32) / np.sqrt(d)
    wq[..., 0, :] *= 5.0  # a dominant head: different scales across heads
    ref_s, ref_v = _svd64(wq, wk)
    sigma = jax.jit(fp8.attention_sigma_max)(wq, wk)
    assert sigma.shape == (*lead, h)
    np.testing.assert_allclose(np.asarray(sigma), ref_s, rtol=2e-6)
    s2, v = attention_top_singular(wq, wk)
    np.testing.assert_allclose(np.asarray(s2), ref_s, rtol=2e-6)
    align = np.abs(np.sum(np.asarray(v, np.float64) * ref_v, axis=-1))  # sign is arbitrary
    np.testing.assert_allclose(align, 1.0, atol=1e-5)


def test_exact_start_is_a_fixed_point_of_the_power_tracker_and_offline_scales():
    rng = np.random.default_rng(1)
    wq = jnp.asarray(rng.standard_normal((2, 256, 4, 8)), jnp.float32) / 16
    wk = jnp.asarray(rng.standard_normal((2, 256, 2, 8)), jnp.float32) / 16
    sigma, v = attention_top_singular(wq, wk)
    st = GeometryScalingState(jnp.zeros((), jnp.int32), v, sigma)
    rule = fp8.ScaleRule(seq_len=64)
    scales, st = fp8.geometry_scaling_policy(rule).scales(st, wq, wk, jnp.ones(2))
    np.testing.assert_allclose(np.asarray(st.sigma), np.asarray(sigma), rtol=1e-5)
    offline = fp8.attention_scales(wq, wk, rule, jnp.ones((2, 1)))
    np.testing.assert_allclose(np.asarray(offline), np.asarray(scales), rtol=1e-5)
    agn = fp8.attention_scales(wq, wk, fp8.ScaleRule(seq_len=64, rank_aware=False))
    ratio = fp8.rank_aware_tightness(
        d=256, rank=8, gamma=fp8.chernoff_gamma(rank=8, seq_len=64, delta=1e-6)
    )[1]
    np.testing.assert_allclose(np.asarray(offline / agn), ratio, rtol=1e-5)


def test_shape_errors():
    with pytest.raises(ValueError, match="multiple"):
        fp8.attention_sigma_max(np.zeros((8, 4, 2)), np.zeros((8, 3, 2)))
    with pytest.raises(ValueError, match="leading"):
        fp8.attention_sigma_max(np.zeros((2, 8, 4, 2)), np.zeros((8, 4, 2)))


def test_scales_from_an_ordinary_models_2d_query_and_key_kernels():
    # BERT/MiniLM-style Dense kernels (layers, d, H*d_h), GQA keys (layers, d, G*d_h).
    rng = np.random.default_rng(2)
    layers, d, h, g, dh = 2, 32, 4, 2, 8
    wq = (rng.standard_normal((layers, d, h * dh)) / np.sqrt(d)).astype(np.float32)
    wk = (rng.standard_normal((layers, d, g * dh)) / np.sqrt(d)).astype(np.float32)
    # Column h*d_h + j is entry j of head h: the float64 reference slices columns per head.
    ref = np.zeros((layers, h))
    for i in range(layers):
        for j in range(h):
            q = wq[i][:, j * dh : (j + 1) * dh].astype(np.float64)
            kh = j // (h // g)
            k = wk[i][:, kh * dh : (kh + 1) * dh].astype(np.float64)
            ref[i, j] = np.linalg.svd(q @ k.T, compute_uv=False)[0]
    q4, k4 = split_heads(wq, wk, num_heads=h, num_kv_heads=g)
    assert q4.shape == (layers, d, h, dh) and k4.shape == (layers, d, g, dh)
    np.testing.assert_allclose(np.asarray(fp8.attention_sigma_max(q4, k4)), ref, rtol=2e-6)
    rule = fp8.ScaleRule(seq_len=128)
    scales = fp8.attention_scales(wq, wk, rule, num_heads=h, num_kv_heads=g)
    np.testing.assert_array_equal(scales, fp8.attention_scales(q4, k4, rule))
    with pytest.raises(ValueError, match=r"H=3 dividing its last axis"):
        split_heads(wq, wk, num_heads=3)
    with pytest.raises(ValueError, match=r"w_k's last axis must be G\*d_h = 4\*8 = 32"):
        fp8.attention_scales(wq, wk, rule, num_heads=h)  # G defaults to H: 32 != 16
    with pytest.raises(ValueError, match="num_kv_heads needs num_heads"):
        fp8.attention_scales(wq, wk, rule, num_kv_heads=g)
