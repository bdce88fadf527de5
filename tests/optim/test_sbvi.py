"""SBVI and AdaLoRA: the Wasserstein flow (noise variance, Gaussian posterior on a quadratic,
temperature), Stiefel retractions, bifurcation and rank recovery, pruning, budgets, state size."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters as A
from lowrank_jax import optim as O
from lowrank_jax.adapters.singular import random_stiefel
from lowrank_jax.optim.adalora import adalora_budget, adalora_orthogonality
from lowrank_jax.optim.sbvi import qr_retraction, sbvi_mean, sbvi_preconditioner, stiefel_project

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
    u = random_stiefel(key, 10, 4)
    g = jax.random.normal(jax.random.key(1), (10, 4))
    xi = stiefel_project(u, g)
    np.testing.assert_allclose(u.T @ xi + xi.T @ u, 0.0, atol=1e-6)  # tangent at U
    np.testing.assert_allclose(stiefel_project(u, xi), xi, atol=1e-6)  # a projector
    new = qr_retraction(u, -0.3 * xi)
    np.testing.assert_allclose(new.T @ new, np.eye(4), atol=1e-6)
    # First-order: qf(U + tξ) = U + tξ + O(t²).
    t = 1e-3
    np.testing.assert_allclose(qr_retraction(u, t * xi), u + t * xi, atol=2e-5)


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
    # SBVI: Adam moments of U, V + 8 r-vectors (2 moments of ∂σ, EMA, γ, mask, μ, Σ, ξ) + count;
    # AdaLoRA: Adam moments + two EMAs of every entry.
    assert size(sbvi) == 2 * n_params + 6 * R_MAX + 1
    assert size(ada) >= 4 * n_params
    assert size(sbvi) < size(ada)


def test_adalora_budget_schedule_and_final_rank():
    b = [
        int(adalora_budget(t, init_budget=16, target_budget=4, total_steps=100,
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
    ad, state = _train(tx, ad, loss, 800, extra_loss=lambda a: 0.1 * adalora_orthogonality(a))
    assert O.adalora_ranks(state) == {"w/kernel": 3}
    s = np.asarray(ad["w/kernel"].factors["s"])
    assert np.count_nonzero(s) == 3
    err = np.linalg.norm(A.delta(ad["w/kernel"], (N_IN, N_OUT)) - dw) / np.linalg.norm(dw)
    assert err < 0.1


def test_orthogonality_regulariser_is_zero_on_stiefel():
    params, _, _ = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(4))])
    assert float(adalora_orthogonality(ad)) < 1e-5
    ad_a = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(4, init="adalora"))])
    assert float(adalora_orthogonality(ad_a)) > 1.0


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


def _sigma_only(a, target, shape):
    """A spectral triple whose loss is ½ Σ a_i (σ_i − σ*_i)² (U, V get zero gradients)."""
    *stack, r = shape
    eye = jnp.broadcast_to(jnp.eye(r), (*stack, r, r))
    tree = {"m": {"u": eye, "s": jnp.zeros(shape), "v": eye}}
    loss = lambda t: 0.5 * jnp.sum(a * (t["m"]["s"] - target) ** 2)
    return tree, loss


@pytest.mark.parametrize("family", ["langevin", "gaussian"])
def test_one_step_noise_variance_is_2_eta_p_T(family):
    """Monte Carlo over 20,000 keys: the one-step spread of σ has variance 2ηpT, p = min(p_max,
    1/(|g| + ε)) after one step — including a mode with zero gradient (p = p_max, not 1/ε)."""
    eta, temp, pmax, n = 1e-2, 1e-2, 10.0, 20_000
    g = jnp.asarray([0.0, 1e-7, 0.05, 0.2, 1.0, 3.0])
    tree = {"m": {"u": jnp.eye(6), "s": jnp.full(6, 5.0), "v": jnp.eye(6)}}
    grads = {"m": {"u": jnp.zeros((6, 6)), "s": g, "v": jnp.zeros((6, 6))}}
    tx = O.scale_by_sbvi(
        learning_rate=eta, family=family, temperature=temp, friction=0.0, precond_max=pmax
    )
    state = tx.init(tree)
    step = jax.jit(jax.vmap(lambda k: tx.update(grads, state._replace(key=k), tree)[0]["m"]["s"]))
    s_new = 5.0 + np.asarray(step(jax.random.split(jax.random.key(1), n)), np.float64)
    p = np.minimum(pmax, 1.0 / (np.abs(np.asarray(g, np.float64)) + 1e-8))
    np.testing.assert_allclose(
        p, np.asarray(sbvi_preconditioner(g**2 * 1e-3, 1, precond_max=pmax)), rtol=1e-4
    )
    want_var = 2 * eta * p * temp
    np.testing.assert_allclose(s_new.var(0), want_var, rtol=0.05)  # sd of the estimate: 1%
    np.testing.assert_allclose(
        s_new.mean(0), 5.0 - eta * p * np.asarray(g), atol=4 * np.sqrt(want_var.max() / n)
    )
    assert np.sqrt(want_var[0]) <= np.sqrt(2 * eta * pmax * temp) + 1e-12  # the documented bound


def _run_quadratic(tx, tree, loss, steps, keep):
    @jax.jit
    def run(tree):
        def body(carry, _):
            t, s = carry
            u, s = tx.update(jax.grad(loss)(t), s, t)
            t = optax.apply_updates(t, u)
            return (t, s), (s.loc["m"], s.var["m"], t["m"]["s"])

        _, out = jax.lax.scan(body, (tree, tx.init(tree)), None, length=steps)
        return jax.tree.map(lambda x: x[-keep:], out)

    return [np.asarray(x, np.float64) for x in run(tree)]


def test_gaussian_flow_converges_to_the_gibbs_posterior_and_langevin_is_its_particle_limit():
    """L = ½a(σ − σ*)², ARD friction f = λγ fixed: the posterior ∝ exp(−(L + ½fσ²)/T) is
    N(aσ*/(a + f), T/(a + f)). The Gaussian flow's (μ, Σ), averaged over the last 2,000 steps,
    matches it (mean within 0.1 sd, variance within 10%); 4,000 Langevin particles (500 stacked
    copies × 8 modes) have the mean (within 0.1 sd) and the discrete OU variance T/(c(1 − ηc/2)), c = a + f
    (within 6%)."""
    a = jnp.asarray([0.5, 1.0, 2.0, 4.0, 0.5, 1.0, 2.0, 4.0])
    target = jnp.asarray([3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    temp, fric, eta = 0.02, 0.5, 0.02
    c = np.asarray(a, np.float64) + fric
    want_mu, want_var = np.asarray(a * target, np.float64) / c, temp / c
    kw = dict(
        learning_rate=eta, friction=fric, temperature=temp, anneal_steps=None, eb_every=10**6,
        prune_start=10**6, precond_max=1.0, gamma_init=1.0,
    )  # fmt: skip
    tree, loss = _sigma_only(a, target, (8,))
    mu, var, _ = _run_quadratic(O.scale_by_sbvi(family="gaussian", **kw), tree, loss, 6000, 2000)
    np.testing.assert_allclose(mu.mean(0), want_mu, atol=0.1 * np.sqrt(want_var).min())
    np.testing.assert_allclose(var.mean(0), want_var, rtol=0.10)

    tree, loss = _sigma_only(a, target, (500, 8))
    _, _, particles = _run_quadratic(
        O.scale_by_sbvi(family="langevin", **kw), tree, loss, 1500, 500
    )
    ou_var = temp / (c * (1 - eta * c / 2))  # p = p_max = 1 here (|g| ≈ √(aT) > 1)
    np.testing.assert_allclose(particles.mean((0, 1)), want_mu, atol=0.1 * np.sqrt(want_var).min())
    np.testing.assert_allclose(particles.var((0, 1)), ou_var, rtol=0.06)


def test_temperature_changes_the_result():
    """On the rank-3 regression: T = 0 keeps Σ = 0 exactly (a deterministic MAP flow), T = 1e-3
    (constant) gives each kept mode the posterior sd √(T/(c_i + λγ_i)) — c_i = u_iᵀ Cov(x) u_i ‖v_i‖²,
    the curvature of L in σ_i; Σ averaged over the last 300 steps, within 25% — and moves the means."""
    params, loss, _ = _regression()
    ad = A.init(jax.random.key(0), params, [("w/kernel", A.spectral(R_MAX))])
    kw = dict(
        learning_rate=1e-2, friction=1e-2, anneal_steps=None, prune_start=300, precond_max=10.0
    )
    runs = {}
    for temp in (0.0, 1e-3):
        tx = O.scale_by_sbvi(temperature=temp, **kw)

        @jax.jit
        def run(ad, tx=tx):
            def body(carry, _):
                a, s = carry
                u, s = tx.update(jax.grad(loss)(a), s, a)
                return (optax.apply_updates(a, u), s), s.var["w/kernel"].factors

            (ad, state), var = jax.lax.scan(body, (ad, tx.init(ad)), None, length=600)
            return ad, state, var[-300:].mean(0), var.max()

        runs[temp] = run(ad)
    ad0, state0, _, var0_max = runs[0.0]
    assert float(var0_max) == 0.0
    mu0 = np.asarray(O.sbvi_posterior(state0)["w/kernel"][0])
    np.testing.assert_array_equal(ad0["w/kernel"].factors["s"], mu0)  # the sample is the mean
    ad1, state1, var1, _ = runs[1e-3]
    mu1 = np.asarray(O.sbvi_posterior(state1)["w/kernel"][0])
    f = ad1["w/kernel"].factors
    x = np.random.default_rng(0).standard_normal((N_EX, N_IN))  # _regression's inputs
    curv = np.einsum("ir,ij,jr->r", f["u"], np.cov(x.T, bias=True), f["u"]) * np.sum(
        np.asarray(f["v"]) ** 2, 0
    )
    gamma = np.asarray(state1.gamma["w/kernel"].factors)
    kept = np.asarray(state1.mask["w/kernel"].factors)
    assert kept.sum() == 3
    want = np.sqrt(1e-3 / (curv + 1e-2 * gamma))[kept]
    np.testing.assert_allclose(np.sqrt(np.asarray(var1))[kept], want, rtol=0.25)
    assert np.max(np.abs(mu1 - mu0)) > 1e-3
    # sbvi_mean puts μ back into the parameters (they hold a sample μ + sξ).
    mean = sbvi_mean(ad1, state1)
    np.testing.assert_array_equal(mean["w/kernel"].factors["s"], mu1)
