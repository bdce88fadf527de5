"""Flow matching and the Euler sampler on a Gaussian, where the marginal velocity is known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax.generative import flows

MU, S = 2.0, 0.5


def _velocity(params, x, t):
    # N(0, 1) -> N(MU, S^2) along x_t = (1-t) x0 + t x1: x_t ~ N(t MU, sig_t^2),
    # sig_t^2 = (1-t)^2 + t^2 S^2, and v = MU + (sig_t'/sig_t)(x - t MU).
    t = jnp.broadcast_to(t, x.shape[:1])[:, None]
    var = (1 - t) ** 2 + t**2 * S**2
    return MU + params * (-(1 - t) + t * S**2) / var * (x - t * MU)


def test_euler_with_the_marginal_velocity_transports_the_gaussian():
    x = flows.sample_flow(_velocity, 1.0, jax.random.key(0), num=20000, dim=1, num_steps=400)
    assert float(jnp.mean(x)) == pytest.approx(MU, abs=0.03)
    assert float(jnp.std(x)) == pytest.approx(S, abs=0.02)


def test_the_marginal_velocity_minimises_the_flow_matching_loss():
    x1 = MU + S * jax.random.normal(jax.random.key(1), (50000, 1))
    key = jax.random.key(2)
    best = flows.flow_matching_loss(1.0, _velocity, key, x1)
    for wrong in (0.5, 1.5):
        assert float(flows.flow_matching_loss(wrong, _velocity, key, x1)) > float(best) + 0.01
    shifted = flows.flow_matching_loss(1.0, lambda p, x, t: _velocity(p, x, t) + 0.2, key, x1)
    assert float(shifted) == pytest.approx(float(best) + 0.04, abs=0.01)


def test_velocity_mlp_shapes_and_bad_inputs():
    net = flows.VelocityMLP(features=(8, 8))
    x = np.zeros((3, 5), np.float32)
    params = net.init(jax.random.key(0), x, 0.5)
    assert net.apply(params, x, jnp.array([0.0, 0.5, 1.0])).shape == (3, 5)
    with pytest.raises(ValueError, match="x1 must be"):
        flows.flow_matching_loss(params, net.apply, jax.random.key(0), np.zeros(5))
    with pytest.raises(ValueError, match="num_steps=0"):
        flows.sample_flow(net.apply, params, jax.random.key(0), num=2, dim=5, num_steps=0)


def test_train_flow_learns_the_resampled_law():
    # Two atoms at -1 and +1, stored equally often, weighted 1:4: the trained flow puts ~80% of
    # its samples near +1 (what stage 2 of TFFT relies on: resampling = the tilted target).
    data = jnp.concatenate([-jnp.ones((500, 1)), jnp.ones((500, 1))])
    logw = jnp.log(jnp.concatenate([jnp.full(500, 1.0), jnp.full(500, 4.0)]))
    net = flows.VelocityMLP(features=(32, 32), num_frequencies=4)
    params = net.init(jax.random.key(0), data[:1], 0.0)
    params, losses = flows.train_flow(
        params, data, logw, jax.random.key(1), apply_fn=net.apply, tx=optax.adam(3e-3),
        num_steps=800, batch_size=128,
    )  # fmt: skip
    assert float(jnp.mean(losses[-100:])) < float(jnp.mean(losses[:100]))
    x = flows.sample_flow(net.apply, params, jax.random.key(2), num=4000, dim=1, num_steps=40)
    assert float(jnp.mean(x > 0)) == pytest.approx(0.8, abs=0.05)
