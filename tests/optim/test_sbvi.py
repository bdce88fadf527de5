"""SBVI and AdaLoRA: Stiefel retractions, bifurcation and rank recovery, pruning, budgets, state size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters as A
from lowrank_jax import optim as O

N_IN, N_OUT, N_EX, R_MAX = 16, 12, 600, 8


def _regression(seed=0, strengths=(2.0, 1.0, 0.5)):
    """y = x (W₀ + ΔW*) + noise with a rank-3 ΔW*; the adapter has r_max = 8 modes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_EX, N_IN)).astype(np.float32)
    w0 = (rng.standard_normal((N_IN, N_OUT)) / 4).astype(np.float32)
    k = len(strengths)
    u = np.linalg.qr(rng.standard_normal((N_IN, k)))[0]
    v = np.linalg.qr(rng.standard_normal((N_OUT, k)))[0]
    dw = (u * np.asarray(strengths)) @ v.T
    y = (x @ (w0 + dw) + 0.1 * rng.standard_normal((N_EX, N_OUT))).astype(np.float32)
    params = {"w": {"kernel": jnp.asarray(w0)}}
    fwd = A.adapt(lambda p, xx: xx @ p["w"]["kernel"])

    def loss(ad):
        return 0.5 * jnp.mean(jnp.sum((fwd(params, ad, x) - y) ** 2, -1))

    return params, loss, dw


def _train(tx, ad, loss, steps, extra_loss=None):
    total = loss if extra_loss is None else (lambda a: loss(a) + extra_loss(a))

    @jax.jit
    def run(ad, state):
        def body(carry, _):
            a, s = carry
            g = jax.grad(total)(a)
            u, s = tx.update(g, s, a)
            return (optax.apply_updates(a, u), s), None

        (ad, state), _ = jax.lax.scan(body, (ad, state), None, length=steps)
        return ad, state

    return run(ad, tx.init(ad))


def test_projection_is_tangent_and_retraction_is_on_the_manifold():
    key = jax.random.key(0)
    u = A.random_stiefel(key, 10, 4)
    g = jax.random.normal(jax.random.key(1), (10, 4))
    xi = O.stiefel_project(u, g)
    np.testing.assert_allclose(u.T @ xi + xi.T @ u, 0.0, atol=1e-6)  # tangent at U
    np.testing.assert_allclose(O.stiefel_project(u, xi), xi, atol=1e-6)  # a projector
    new = O.qr_retraction(u, -0.3 * xi)
    np.testing.assert_allclose(new.T @ new, np.eye(4), atol=1e-6)
    # First-order: qf(U + tξ) = U + tξ + O(t²).
    t = 1e-3
    np.testing.assert_allclose(O.qr_retraction(u, t * xi), u + t * xi, atol=2e-5)


def test_sbvi_keeps_factors_on_stiefel_and_recovers_the_rank():
    params, loss, dw = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(R_MAX))])
    tx = O.scale_by_sbvi(
        learning_rate=1e-2, friction=1e-2, temperature=1e-5, anneal_steps=600, prune_start=300
    )
    ad, state = _train(tx, ad, loss, 800)
    f = ad["w/kernel"].factors
    for x in (f["u"], f["v"]):
        np.testing.assert_allclose(x.T @ x, np.eye(R_MAX), atol=1e-5)
    assert O.sbvi_ranks(state) == {"w/kernel": 3}
    s = np.sort(np.asarray(f["s"]))[::-1]
    assert s[2] > 0.3 and np.all(s[3:] == 0.0)  # bifurcation: a clear gap, the rest pruned
    err = np.linalg.norm(A.delta(ad["w/kernel"], (N_IN, N_OUT)) - dw) / np.linalg.norm(dw)
    assert err < 0.05


def test_pruned_modes_stay_pruned():
    params, loss, _ = _regression(strengths=(2.0,))
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(4))])
    tx = O.scale_by_sbvi(learning_rate=1e-2, friction=1e-2, prune_start=100, eb_every=5)
    ad, state = _train(tx, ad, loss, 300)
    mask = np.asarray(state.mask["w/kernel"].factors)
    assert mask.sum() == 1
    # Now push every mode with a strong, constant gradient: pruned σ stay exactly 0.
    grads = jax.tree.map(jnp.zeros_like, ad)
    grads["w/kernel"].factors["s"] = -10.0 * jnp.ones(4)
    update = jax.jit(tx.update)
    for _ in range(20):
        upd, state = update(grads, state, ad)
        ad = optax.apply_updates(ad, upd)
    s = np.asarray(ad["w/kernel"].factors["s"])
    np.testing.assert_array_equal(s[~mask], 0.0)
    np.testing.assert_array_equal(np.asarray(state.mask["w/kernel"].factors), mask)


def test_sbvi_state_is_smaller_than_adalora():
    params, _, _ = _regression()
    ad_s = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(R_MAX))])
    ad_a = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(R_MAX, init="adalora"))])
    sbvi = O.scale_by_sbvi(learning_rate=1e-2).init(ad_s)
    ada = O.scale_by_adalora(inner=optax.adam(1e-2), target_rank=2, total_steps=10).init(ad_a)
    size = lambda t: sum(
        int(x.size)
        for x in jax.tree.leaves(t)
        if jnp.issubdtype(x.dtype, jnp.number) or x.dtype == bool
    )
    n_params = A.count_params(ad_s)
    # SBVI: Adam moments of U, V + O(r); AdaLoRA: Adam moments + two EMAs of every entry.
    assert size(sbvi) <= 2 * n_params + 4 * R_MAX + 1
    assert size(ada) >= 4 * n_params
    assert size(sbvi) < size(ada)


def test_adalora_budget_schedule_and_final_rank():
    b = [
        int(O.adalora_budget(t, init_budget=16, target_budget=4, total_steps=100,
                             init_warmup=10, final_warmup=20))
        for t in (0, 10, 11, 45, 80, 81, 100)
    ]  # fmt: skip
    assert b[0] == b[1] == 16 and b[-1] == b[-2] == 4 and 4 <= b[3] <= b[2] <= 16
    params, loss, dw = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(R_MAX, init="adalora"))])
    tx = O.scale_by_adalora(
        inner=optax.adam(1e-2), target_rank=3, total_steps=800, init_warmup=100,
        final_warmup=200, mask_interval=10,
    )  # fmt: skip
    ad, state = _train(tx, ad, loss, 800, extra_loss=lambda a: 0.1 * O.adalora_orthogonality(a))
    assert O.adalora_ranks(state) == {"w/kernel": 3}
    s = np.asarray(ad["w/kernel"].factors["s"])
    assert np.count_nonzero(s) == 3
    err = np.linalg.norm(A.delta(ad["w/kernel"], (N_IN, N_OUT)) - dw) / np.linalg.norm(dw)
    assert err < 0.1


def test_orthogonality_regulariser_is_zero_on_stiefel():
    params, _, _ = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(4))])
    assert float(O.adalora_orthogonality(ad)) < 1e-5
    ad_a = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(4, init="adalora"))])
    assert float(O.adalora_orthogonality(ad_a)) > 1.0


def test_sbvi_errors():
    with pytest.raises(ValueError, match="out-of-range"):
        O.scale_by_sbvi(learning_rate=-1.0)
    tx = O.scale_by_sbvi(learning_rate=1e-2)
    with pytest.raises(ValueError, match="spectral adapters"):
        tx.init({"w": jnp.zeros(3)})
    params, _, _ = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(2))])
    with pytest.raises(ValueError, match="needs params"):
        tx.update(ad, tx.init(ad))
    with pytest.raises(ValueError, match="init_warmup"):
        O.scale_by_adalora(inner=optax.sgd(1.0), target_rank=1, total_steps=10, init_warmup=10)
