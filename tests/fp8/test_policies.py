"""Scaling policies as state machines: geometry (vs float64 SVD), delayed, current; resets; errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import fp8
from lowrank_jax.fp8.bounds import geometry_aware_scale, rank_aware_alpha
from lowrank_jax.fp8.online import OnlineCalibrationState
from lowrank_jax.fp8.policies import current_scaling_policy
from lowrank_jax.spectral import PowerIterationState, attention_power_iteration

L, D, H, G, DH = 2, 48, 4, 2, 6


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    wq = rng.standard_normal((L, D, H, DH)).astype(np.float32) / np.sqrt(D)
    wk = rng.standard_normal((L, D, G, DH)).astype(np.float32) / np.sqrt(D)
    return jnp.asarray(wq), jnp.asarray(wk), jnp.asarray([1.0, 1.3], jnp.float32)


def _sigma64(wq, wk):
    wq, wk = np.asarray(wq, np.float64), np.asarray(wk, np.float64)
    return np.array(
        [
            [
                np.linalg.svd(wq[li, :, h] @ wk[li, :, h // (H // G)].T, compute_uv=False)[0]
                for h in range(H)
            ]
            for li in range(L)
        ]
    )


def test_geometry_state_machine_matches_per_layer_vmap_and_float64_svd():
    wq, wk, gains = _weights()
    kw = dict(seq_len=64, delta=1e-3)
    rule = fp8.ScaleRule(**kw)
    policy = fp8.geometry_scaling_policy(rule, num_iters=400, burn_in_iters=0)
    st = policy.init(jax.random.key(0), wq, wk, gains)
    assert st.v.shape == (L, H, D) and st.sigma.shape == (L, H)
    scales, new = jax.jit(policy.scales)(st, wq, wk, gains)

    def one_layer(q, k, v, g):  # the per-layer power iteration and the rule, vmapped over layers
        st = PowerIterationState(v, jnp.zeros(H), jnp.zeros((), jnp.int32))
        sigma, st = attention_power_iteration(q, k, st, num_iters=400)
        return rule.scales(sigma, d=D, head_dim=DH, norm_gain=g), st

    ref_scales, ref_state = jax.jit(jax.vmap(one_layer))(wq, wk, st.v, gains)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(ref_scales), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new.v), np.asarray(ref_state.v), rtol=1e-5, atol=1e-6)
    assert int(new.count) == 400
    sigma = _sigma64(wq, wk)
    np.testing.assert_allclose(np.asarray(new.sigma), sigma, rtol=1e-4)
    want = geometry_aware_scale(sigma, d=D, head_dim=DH, norm_gain=np.asarray(gains)[:, None], **kw)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(want), rtol=1e-4)
    agnostic = fp8.geometry_scaling_policy(fp8.ScaleRule(rank_aware=False, **kw))
    agn, _ = agnostic.scales(new, wq, wk, gains)
    ratio = fp8.rank_aware_tightness(d=D, rank=DH, gamma=fp8.chernoff_gamma(rank=DH, **kw))[1]
    np.testing.assert_allclose(np.asarray(scales / agn), ratio, rtol=1e-4)


def test_geometry_policy_follows_a_weight_spike_at_once_and_delayed_does_not():
    wq, wk, gains = _weights(1)
    geo = fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=64), burn_in_iters=300)
    st = geo.init(jax.random.key(1), wq, wk, gains)
    before, st = jax.jit(geo.scales)(st, wq, wk, gains)
    after, st = jax.jit(geo.scales)(st, 4.0 * wq, wk, gains)  # W^Q <- 4 W^Q
    # warm-started at the converged vector, one power step gives exactly 4σ: the scale drops 4x
    np.testing.assert_allclose(np.asarray(before / after), 4.0, rtol=1e-4)
    assert geo.observe(st, jnp.ones((L, H))) is st  # nothing observes activations
    # delayed scaling uses the amax of earlier steps: the scale at the spike step is unchanged
    dly = fp8.delayed_scaling_policy(history_len=4)
    ds = dly.init(None, wq, wk, gains)
    ds = dly.observe(ds, jnp.full((L, H), 2.0))
    s1, ds = dly.scales(ds, 4.0 * wq, wk, gains)
    np.testing.assert_allclose(np.asarray(s1), 448.0 / 2.0)


def test_delayed_policy_is_update_delayed_scaling_and_reset_forgets():
    wq, wk, gains = _weights()
    pol = fp8.delayed_scaling_policy(history_len=3, margin=1.0, algo="max")
    st = pol.init(None, wq, wk, gains)
    ref = fp8.init_delayed_scaling((L, H), history_len=3)
    rng = np.random.default_rng(0)
    for _ in range(5):
        amax = jnp.asarray(rng.uniform(0.5, 5.0, (L, H)), jnp.float32)
        st = jax.jit(pol.observe)(st, amax)
        ref = fp8.update_delayed_scaling(ref, amax, margin=1.0)
        jax.tree.map(np.testing.assert_array_equal, st, ref)
    fresh = pol.reset(st, wq, wk, gains)
    assert float(jnp.abs(fresh.amax_history).max()) == 0.0 and float(fresh.scale.max()) == 1.0
    keep = fp8.delayed_scaling_policy(history_len=3, reset_history=False)
    assert keep.reset(st, wq, wk, gains) is st


def test_geometry_reset_reconverges_from_the_warm_state():
    wq, wk, gains = _weights(2)
    pol = fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=32), burn_in_iters=400)
    st = pol.init(jax.random.key(0), wq, wk, gains)
    other_q, other_k, _ = _weights(3)
    st = pol.reset(st, other_q, other_k, gains)
    np.testing.assert_allclose(np.asarray(st.sigma), _sigma64(other_q, other_k), rtol=1e-4)
    assert int(st.count) == 800


def test_current_policy_defers_to_the_kernel():
    wq, wk, gains = _weights()
    pol = current_scaling_policy()
    st = pol.init(jax.random.key(0), wq, wk, gains)
    scales, st = pol.scales(st, wq, wk, gains)
    assert scales is None and st == ()


def test_single_layer_kernels_and_bad_input():
    wq, wk, gains = _weights()
    pol = fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=16), num_iters=300, burn_in_iters=0)
    st = pol.init(jax.random.key(0), wq[0], wk[0], 1.0)
    s, st = pol.scales(st, wq[0], wk[0], 1.0)
    assert s.shape == (H,)
    np.testing.assert_allclose(np.asarray(st.sigma), _sigma64(wq, wk)[0], rtol=1e-4)
    with pytest.raises(ValueError, match="policy's init"):
        pol.scales(st, wq, wk, gains)
    with pytest.raises(ValueError, match="leading"):
        pol.scales(st, wq, wk[0], gains)
    with pytest.raises(ValueError, match="d, H, d_h"):
        pol.init(jax.random.key(0), wq[0, 0], wk[0, 0], 1.0)
    with pytest.raises(ValueError, match="num_iters"):
        fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=16), num_iters=0)
    with pytest.raises(ValueError, match="ScaleRule"):
        fp8.geometry_scaling_policy(16)
    with pytest.raises(ValueError, match="delta"):
        fp8.ScaleRule(seq_len=16, delta=1.5)
    with pytest.raises(ValueError, match="gamma"):
        fp8.ScaleRule(seq_len=16, gamma=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp8.ScaleRule(seq_len=16).seq_len = 8
    with pytest.raises(ValueError, match="history_len"):
        fp8.delayed_scaling_policy(history_len=0)
    with pytest.raises(ValueError, match="algo"):
        fp8.delayed_scaling_policy(algo="mean")
    with pytest.raises(ValueError, match="FP8 format"):
        fp8.ScaleRule(seq_len=16, fmt="e3m4")


def test_online_calibration_follows_its_definition_against_float64():
    # κ = clip(m · max(last h ratios amax/B), floor, 1/α); 1/α (the worst case B_wc) before any
    # observation and after reset; the scale is c R / (κ B), B the rank-aware bound (float64 here).
    wq, wk, gains = _weights()
    m, h, n, delta = 1.25, 3, 64, 1e-3
    policy = fp8.online_calibration(
        fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=n, delta=delta), burn_in_iters=400),
        history=h, margin=m, floor=1 / 16,
    )  # fmt: skip
    alpha = rank_aware_alpha(d=D, rank=DH, seq_len=n, delta=delta)
    b_wc = _sigma64(wq, wk) * D * np.asarray(gains, np.float64)[:, None] ** 2 / np.sqrt(DH)
    bound = alpha * b_wc
    r = fp8.fp8_max("e4m3")
    st = policy.init(jax.random.key(0), wq, wk, gains)
    assert isinstance(st, OnlineCalibrationState)
    scales = jax.jit(policy.scales)
    s, st = scales(st, wq, wk, gains)
    # first step: the deterministic worst case (a bug that starts from κ = 1 or 0 fails here)
    np.testing.assert_allclose(np.asarray(s), r / b_wc, rtol=1e-4)
    ratios = [0.5, 2.0, 0.7, 0.6, 0.4]  # amax / B observed at steps 0..4
    for t, rho in enumerate(ratios):
        st = policy.observe(st, jnp.asarray(rho * bound, jnp.float32))
        s, st = scales(st, wq, wk, gains)
        kappa = np.clip(m * max(ratios[max(0, t + 1 - h) : t + 1]), 1 / 16, 1 / alpha)
        # the window drops the 2.0 after h = 3 more steps (a history that never forgets, or
        # one that keeps only the last ratio, fails at t = 2 or t = 4)
        np.testing.assert_allclose(np.asarray(s), r / (kappa * bound), rtol=1e-4, err_msg=f"{t}")
    # W^Q x4: amax and B both scale by 4, κ does not move, so the scale is divided by exactly 4
    s4, _ = scales(st, 4 * wq, wk, gains)
    np.testing.assert_allclose(np.asarray(s4), np.asarray(s) / 4, rtol=1e-4)
    # a ratio above the worst case is capped at B_wc; reset forgets the ratios
    st = policy.observe(st, jnp.asarray(10 / alpha * bound, jnp.float32))
    np.testing.assert_allclose(np.asarray(scales(st, wq, wk, gains)[0]), r / b_wc, rtol=1e-4)
    st = policy.reset(st, wq, wk, gains)
    assert int(st.seen) == 0
    np.testing.assert_allclose(np.asarray(scales(st, wq, wk, gains)[0]), r / b_wc, rtol=1e-4)
    geometry = fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=n))
    with pytest.raises(ValueError, match="margin >= 1"):
        fp8.online_calibration(geometry, margin=0.5)
    with pytest.raises(ValueError, match="cap"):
        fp8.online_calibration(fp8.delayed_scaling_policy())


def test_online_calibration_wraps_any_policy():
    # over delayed scaling, with a cap given: κ = cap before any observation, then the windowed
    # max of amax · s / R (clipped to [floor, cap]) from the inner scale s of that step
    wq, wk, gains = _weights()
    inner = fp8.delayed_scaling_policy(history_len=4)
    pol = fp8.online_calibration(inner, worst_case=4.0, history=2, margin=1.0)
    st = pol.init(None, wq, wk, gains)
    s, st = pol.scales(st, wq, wk, gains)
    np.testing.assert_allclose(np.asarray(s), 1.0 / 4.0)  # inner init scale 1, κ = 4
    st = pol.observe(st, jnp.full((L, H), 112.0))  # ρ = 112 · 1 / 448 = 1/4: κ = floor = 1
    s, st = pol.scales(st, wq, wk, gains)
    np.testing.assert_allclose(np.asarray(s), 448.0 / 112.0)
    st = pol.observe(st, jnp.full((L, H), 900.0))  # ρ = 900 · 4 / 448 > 4: κ = cap
    s, st = pol.scales(st, wq, wk, gains)
    np.testing.assert_allclose(np.asarray(s), 448.0 / 900.0 / 4.0, rtol=1e-6)
    assert int(st.inner.count) == 2 and int(st.seen) == 2
    assert int(pol.reset(st, wq, wk, gains).seen) == 0
