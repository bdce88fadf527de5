"""Adjoint matching and the flow log-likelihood on a Gaussian base with a linear reward, where the
tilted optimum ``N(μ₀ + s²c, s²)`` and every velocity are known in closed form."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.generative import adjoint, flows

MU0, S = jnp.array([1.0, -1.0]), 0.5
C = jnp.array([2.0, 0.0])  # the log-tilt f(x) = c·x: p* = N(MU0 + S² c, S²)
MU1 = MU0 + S**2 * C


def _gauss_velocity(mu, x, t):
    # N(0, I) -> N(mu, S² I) along x_t = (1-t) x0 + t x1.
    t = jnp.broadcast_to(jnp.asarray(t, x.dtype), x.shape[:1])[:, None]
    k = (t * S**2 - (1 - t)) / ((1 - t) ** 2 + t**2 * S**2)
    return mu + k * (x - t * mu)


def _base(params, x, t):
    del params
    return _gauss_velocity(MU0, x, t)


class _TimeShift(nn.Module):
    """A function of t only (zero at init): v_base + g(t) contains the tilted velocity."""

    @nn.compact
    def __call__(self, t):
        t = jnp.atleast_1d(jnp.asarray(t, jnp.float32))[:, None]
        k = jnp.arange(1, 5, dtype=jnp.float32)
        h = jnp.concatenate([t, jnp.sin(np.pi * k * t), jnp.cos(np.pi * k * t)], -1)
        h = nn.silu(nn.Dense(32)(h))
        return nn.Dense(2, kernel_init=nn.initializers.zeros)(h)


_SHIFT = _TimeShift()


def _model(params, x, t):
    return _base(None, x, t) + jnp.broadcast_to(_SHIFT.apply(params, t), x.shape)


def _linear_tilt(x, c):
    return x @ c


def test_lean_adjoint_gives_the_tilted_velocity_in_closed_form():
    # The optimal control: v* − v_base = −(σ²/2)·E[ã | X_t]; for the Gaussian base and a linear
    # tilt the adjoint is deterministic and v* − v_base = Δμ·(1 − t·k(t)) exactly.
    steps = 200
    xs, _ = adjoint.simulate_memoryless(
        _base, None, jax.random.key(0), num=64, dim=2, num_steps=steps
    )
    adjs = adjoint.lean_adjoint(_base, None, xs, -jnp.broadcast_to(C, xs[-1].shape))
    for k in (20, 100, 180):
        t = k / steps
        sigma2 = 2 * (1 - t) / t
        got = -0.5 * sigma2 * adjs[k]
        want = _gauss_velocity(MU1, xs[k], t) - _gauss_velocity(MU0, xs[k], t)
        np.testing.assert_allclose(got, want, atol=0.03 * float(jnp.abs(MU1 - MU0).max()))


def test_lean_adjoint_is_the_pathwise_gradient_along_the_base_trajectory():
    net = flows.VelocityMLP(features=(16, 16))
    params = net.init(jax.random.key(1), jnp.zeros((1, 2)), 0.0)
    steps = 8
    xs, noise = adjoint.simulate_memoryless(
        net.apply, params, jax.random.key(2), num=5, dim=2, num_steps=steps
    )
    reward = lambda x: jnp.sum(jnp.sin(x[:, 0]) * x[:, 1] ** 2)  # noqa: E731
    adjs = adjoint.lean_adjoint(net.apply, params, xs, -jax.grad(reward)(xs[-1]))
    times = jnp.linspace(0.0, 1.0, steps + 1)

    def replay(x, start):  # the base SDE's flow map with the noise held fixed
        for k in range(start, steps):
            mean, std = adjoint._transition(net.apply, params, x, times[k], times[k + 1])
            x = mean + std * noise[k]
        return reward(x)

    np.testing.assert_allclose(replay(xs[0], 0), reward(xs[-1]), rtol=1e-5)
    for start in (0, 3, 7):
        grad = jax.grad(replay)(xs[start], start)
        np.testing.assert_allclose(-adjs[start], grad, rtol=1e-4, atol=1e-5)


def test_adjoint_matching_moves_the_mean_to_the_tilted_optimum():
    params = _SHIFT.init(jax.random.key(3), 0.5)
    tuned, losses = adjoint.train_adjoint_matching(
        params, params, C, jax.random.key(4), apply_fn=_model, log_tilt=_linear_tilt,
        tx=optax.adam(1e-2), dim=2, num_steps=300, batch_size=128, time_steps=20,
    )  # fmt: skip
    assert float(jnp.mean(losses[-50:])) < 0.2 * float(losses[0])
    before = flows.sample_flow(_model, params, jax.random.key(5), num=4000, dim=2, num_steps=100)
    after = flows.sample_flow(_model, tuned, jax.random.key(5), num=4000, dim=2, num_steps=100)
    np.testing.assert_allclose(jnp.mean(before, 0), MU0, atol=0.05)
    np.testing.assert_allclose(jnp.mean(after, 0), MU1, atol=0.08)
    np.testing.assert_allclose(jnp.std(after, 0), S, atol=0.05)


def test_flow_log_likelihood_and_kl_of_gaussians():
    x = MU0 + S * jax.random.normal(jax.random.key(6), (500, 2))
    logp = adjoint.flow_log_likelihood(_base, None, x, num_steps=100)
    want = -0.5 * jnp.sum(((x - MU0) / S) ** 2, -1) - 2 * jnp.log(S) - jnp.log(2 * jnp.pi)
    np.testing.assert_allclose(logp, want, atol=2e-3)
    # KL(N(μ₁, S²)‖N(μ₀, S²)) = |μ₁ − μ₀|²/(2S²), the flows' params being the means.
    kl, se = adjoint.flow_kl(_gauss_velocity, MU1, MU0, jax.random.key(7), num=4000, dim=2)
    want = float(jnp.sum((MU1 - MU0) ** 2) / (2 * S**2))
    assert float(kl) == pytest.approx(want, abs=max(3 * float(se), 0.01))
    same, _ = adjoint.flow_kl(_gauss_velocity, MU0, MU0, jax.random.key(7), num=500, dim=2)
    assert abs(float(same)) < 1e-4


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_steps=1"):
        adjoint.simulate_memoryless(_base, None, jax.random.key(0), num=2, dim=2, num_steps=1)
