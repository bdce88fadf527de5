"""P7 kernel-score diffusion: score identities, OU marginals, the exponential integrator, chunking,
input errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import generative as g
from lowrank_jax.generative.baselines import dsm_loss, mlp_denoiser
from lowrank_jax.generative.kernel_score import (
    early_stopping_time,
    geometric_time_grid,
    kernel_denoiser,
    kernel_log_density,
    kernel_score,
    ou_forward,
    ou_mean_std,
    reverse_diffusion,
    terminal_time,
)
from lowrank_jax.generative.subspaces import (
    LAWS,
    class_subspaces,
    isometric_embedding,
    project_onto_class_subspaces,
)


def _data(n=7, d=3, m=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.normal(size=(m, d)) * 1.5


def _np_log_density(x, data, t):
    """float64 NumPy reference of log p̂_t(x) = log (1/n) Σ_i N(x; m_t X_i, σ_t² I)."""
    m, s2 = math.exp(-t), 1.0 - math.exp(-2 * t)
    d2 = ((x[:, None, :] - m * data[None]) ** 2).sum(-1)
    ell = -d2 / (2 * s2)
    top = ell.max(1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(ell - top).sum(1))
    return lse - math.log(len(data)) - 0.5 * x.shape[1] * math.log(2 * math.pi * s2)


@pytest.mark.parametrize("t", [0.05, 0.7, 3.0])
def test_kernel_score_is_the_gradient_of_log_density_float64(t):
    data, x = _data()
    with jax.enable_x64():
        xs, ds = jnp.asarray(x), jnp.asarray(data)
        logp = kernel_log_density(xs, ds, t)
        np.testing.assert_allclose(np.asarray(logp), _np_log_density(x, data, t), rtol=1e-12)
        grad = jax.vmap(jax.grad(lambda p: kernel_log_density(p[None], ds, t)[0]))(xs)
        score = kernel_score(xs, ds, t)
        assert score.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(score), np.asarray(grad), rtol=1e-9, atol=1e-9)
        # Tweedie: x̂₀ = (x + σ² ŝ)/m is the softmax-weighted mean of the training points
        m, s2 = math.exp(-t), 1 - math.exp(-2 * t)
        ell = -((x[:, None] - m * data[None]) ** 2).sum(-1) / (2 * s2)
        w = np.exp(ell - ell.max(1, keepdims=True))
        w /= w.sum(1, keepdims=True)
        np.testing.assert_allclose(
            np.asarray(kernel_denoiser(xs, ds, t)), w @ data, rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("chunk", [1, 4, 50])
def test_chunked_score_equals_unchunked(chunk):
    data, x = _data(n=13, d=4, m=6, seed=1)
    with jax.enable_x64():
        full = kernel_score(x, data, 0.3)
        part = kernel_score(x, data, 0.3, chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(part), np.asarray(full), rtol=1e-11, atol=1e-11)
        lp = kernel_log_density(x, data, 0.3, chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(lp), _np_log_density(x, data, 0.3), rtol=1e-12)
    # float32, far from the data (logits ~ -1e4): the running log-sum-exp stays finite
    far = jnp.asarray(x * 30, jnp.float32)
    a = kernel_score(far, jnp.asarray(data, jnp.float32), 0.01, chunk_size=chunk)
    b = kernel_score(far, jnp.asarray(data, jnp.float32), 0.01)
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-2)


def test_score_clip_and_density_floor():
    data, x = _data(n=5, d=3, m=8, seed=2)
    t = 0.2
    with jax.enable_x64():
        s = np.asarray(kernel_score(x, data, t))
        c = 0.3
        clipped = np.asarray(kernel_score(x, data, t, clip=c))
        bound = c * math.sqrt(math.log(5)) / math.sqrt(1 - math.exp(-2 * t))
        norms = np.linalg.norm(s, axis=1)
        np.testing.assert_allclose(
            clipped, s * np.minimum(1, bound / norms)[:, None], rtol=1e-10, atol=1e-12
        )
        log_rho = float(np.median(_np_log_density(x, data, t)))
        floored = np.asarray(kernel_score(x, data, t, log_density_floor=log_rho))
        factor = np.minimum(1.0, np.exp(_np_log_density(x, data, t) - log_rho))
        np.testing.assert_allclose(floored, s * factor[:, None], rtol=1e-9, atol=1e-12)
        assert np.any(factor < 1) and np.any(factor == 1)


def test_ou_marginals_mean_and_variance():
    t = np.array([0.01, 0.3, 2.0])
    m, s = ou_mean_std(t)
    np.testing.assert_allclose(np.asarray(m), np.exp(-t), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s) ** 2, 1 - np.exp(-2 * t), rtol=1e-5)
    x0 = jnp.full((200_000, 1), 2.0)
    for ti in t:
        xt = np.asarray(ou_forward(jax.random.key(1), x0, float(ti)))
        se = math.sqrt((1 - math.exp(-2 * ti)) / len(xt))
        assert abs(xt.mean() - 2 * math.exp(-ti)) < 5 * se + 1e-6
        np.testing.assert_allclose(xt.var(), 1 - math.exp(-2 * ti), rtol=0.02)
    # per-row times
    xt = ou_forward(jax.random.key(2), jnp.ones((3, 2)), jnp.asarray(t, jnp.float32))
    assert xt.shape == (3, 2)


def test_exponential_integrator_is_exact_on_a_gaussian():
    """One training point a: p̂_t = N(m_t a, σ_t² I) exactly. The ODE maps y at T to
    m_{t0} a + σ_{t0}(y - m_T a)/σ_T on any grid, and the SDE keeps the marginal law."""
    a = np.array([[0.5, -1.0, 2.0]])
    with jax.enable_x64():
        den = lambda x, t: kernel_denoiser(x, jnp.asarray(a), t)  # noqa: E731
        y = np.random.default_rng(0).normal(size=(4, 3))
        t_max, t0 = 3.0, 0.01
        for steps in (1, 3, 40):
            times = geometric_time_grid(t_max, t0, steps).astype(jnp.float64)
            out = np.asarray(reverse_diffusion(None, den, y, times, tweedie=False))
            m0, s0 = math.exp(-t0), math.sqrt(1 - math.exp(-2 * t0))
            mt, st = math.exp(-t_max), math.sqrt(1 - math.exp(-2 * t_max))
            np.testing.assert_allclose(out, m0 * a + s0 * (y - mt * a) / st, rtol=1e-10)
        # Tweedie step returns the training point itself
        times = geometric_time_grid(t_max, t0, 3).astype(jnp.float64)
        tw = np.asarray(reverse_diffusion(None, den, y, times, tweedie=True))
        np.testing.assert_allclose(tw, np.repeat(a, 4, 0), rtol=1e-10)
        # SDE from the exact marginal at T keeps the exact marginal at t0 (mean and variance)
        n = 100_000
        mt, st = math.exp(-t_max), math.sqrt(1 - math.exp(-2 * t_max))
        y0 = mt * a + st * np.random.default_rng(1).normal(size=(n, 3))
        times = geometric_time_grid(t_max, 0.05, 5).astype(jnp.float64)
        out = np.asarray(
            reverse_diffusion(jax.random.key(0), den, y0, times, stochastic=True, tweedie=False)
        )
        m0, s0 = math.exp(-0.05), math.sqrt(1 - math.exp(-0.1))
        np.testing.assert_allclose(out.mean(0), m0 * a[0], atol=5 * s0 / math.sqrt(n))
        np.testing.assert_allclose(out.var(0), s0**2 * np.ones(3), rtol=0.02)


def test_sampler_concentrates_on_the_subspaces():
    key = jax.random.key(0)
    bases = g.random_subspaces(key, 12, (2, 2, 1))
    x, _ = g.sample_union_of_subspaces(key, bases, num=200, weights=(0.5, 0.3, 0.2), laws=LAWS)
    out = g.sample_kernel_diffusion(key, x, num_samples=48, k=2, num_steps=20, chunk_size=64)
    chunked = g.sample_kernel_diffusion(
        key, x, num_samples=48, k=2, num_steps=20, chunk_size=64, sample_chunk_size=20
    )
    dist = [np.linalg.norm(out - (out @ u) @ u.T, axis=1) for u in bases]
    # the Tweedie output lies on the union (up to averages across subspaces near the origin)
    off = np.min(np.stack(dist), 0)
    assert np.quantile(off, 0.75) < 1e-3 and np.max(off) < 0.05
    assert np.all(np.isfinite(chunked)) and chunked.shape == (48, 12)
    sde = g.sample_kernel_diffusion(key, x, num_samples=48, k=2, num_steps=20, stochastic=True)
    dist = [np.linalg.norm(sde - (sde @ u) @ u.T, axis=1) for u in bases]
    assert np.median(np.min(np.stack(dist), 0)) < 1e-2


def test_time_grid_and_early_stopping():
    grid = np.asarray(geometric_time_grid(5.0, 0.01, 4))
    np.testing.assert_allclose(grid, 0.01 * 500.0 ** (1 - np.arange(5) / 4), rtol=1e-5)
    t0 = early_stopping_time(10_000, 3)
    np.testing.assert_allclose(math.sqrt(1 - math.exp(-2 * t0)), 10_000 ** (-1 / 3), rtol=1e-9)
    t0 = early_stopping_time(10_000, 1)  # max(k, 2)
    np.testing.assert_allclose(math.sqrt(1 - math.exp(-2 * t0)), 0.01, rtol=1e-9)
    assert terminal_time(1000) == pytest.approx(math.log(1000))


def test_intrinsic_dimension_by_local_pca():
    key = jax.random.key(3)
    for k in (1, 3):
        bases = g.random_subspaces(key, 30, (k, k, k - 1))
        x, _ = g.sample_union_of_subspaces(key, bases, num=800, weights=(0.5, 0.3, 0.2), laws=LAWS)
        k_hat, local = g.estimate_intrinsic_dim(key, x, num_anchors=60, num_neighbors=30)
        assert k_hat == k and local.shape == (60,)


def test_wasserstein1_matches_assignment_and_one_dimension():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 1)), rng.normal(size=(40, 1)) + 0.3
    exact_1d = np.mean(np.abs(np.sort(x[:, 0]) - np.sort(y[:, 0])))
    assert g.wasserstein1(x, y) == pytest.approx(exact_1d, rel=1e-9)
    assert g.wasserstein1(x, x) == pytest.approx(0.0, abs=1e-12)


def test_class_subspaces_are_an_exact_isometric_union():
    rng = np.random.default_rng(0)
    x = rng.random(size=(90, 12))
    labels = np.repeat(np.arange(3), 30)
    bases = class_subspaces(x, labels, k=2)
    p = project_onto_class_subspaces(x, labels, bases)
    np.testing.assert_allclose(project_onto_class_subspaces(p, labels, bases), p, atol=1e-12)
    q = isometric_embedding(bases, dim=8)
    np.testing.assert_allclose(q.T @ q, np.eye(8), atol=1e-10)
    z = p @ q
    d_p = np.linalg.norm(p[:, None] - p[None], axis=-1)
    d_z = np.linalg.norm(z[:, None] - z[None], axis=-1)
    np.testing.assert_allclose(d_z, d_p, atol=1e-10)


def test_bad_inputs_raise_clear_errors():
    data = jnp.zeros((10, 3))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="cannot exceed"):
        g.sample_kernel_diffusion(key, data, num_samples=4, k=4)
    with pytest.raises(ValueError, match="t_min < t_max"):
        geometric_time_grid(0.1, 1.0, 10)
    with pytest.raises(ValueError, match="positive finite"):
        geometric_time_grid(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="num_steps"):
        geometric_time_grid(1.0, 0.1, 0)
    with pytest.raises(ValueError, match="strictly decreasing"):
        reverse_diffusion(None, lambda x, t: x, jnp.zeros((2, 3)), jnp.array([0.1, 0.5, 1.0]))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        reverse_diffusion(
            None, lambda x, t: x, jnp.zeros((2, 3)), jnp.array([1.0, 0.1]), stochastic=True
        )
    with pytest.raises(ValueError, match="dimension D=4"):
        kernel_score(jnp.zeros((2, 4)), data, 0.5)
    with pytest.raises(ValueError, match="chunk_size"):
        kernel_score(jnp.zeros((2, 3)), data, 0.5, chunk_size=0)
    with pytest.raises(ValueError, match="clip"):
        kernel_score(jnp.zeros((2, 3)), data, 0.5, clip=-1.0)
    with pytest.raises(ValueError, match="lower scale"):
        early_stopping_time(4, 2, scale=3.0)
    with pytest.raises(ValueError, match="k=5"):
        g.random_subspaces(key, 4, (5,))
    with pytest.raises(ValueError, match="unknown law"):
        g.sample_union_of_subspaces(
            key, g.random_subspaces(key, 4, (1,)), num=3, weights=(1.0,), laws=("gauss",)
        )
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        g.estimate_intrinsic_dim(key, np.zeros((10, 3)), variance_threshold=1.5)
    with pytest.raises(ValueError, match="point sets"):
        g.wasserstein1(np.zeros((3, 2)), np.zeros((3, 3)))


def test_tweedie_output_is_embedding_invariant_and_the_noisy_sample_is_not():
    """With the final Tweedie step the sample is a convex combination of training points, so an
    isometric embedding R^3 -> R^40 maps samples to samples exactly; without it the sample keeps
    the reverse ODE's noise off the data span, of norm (σ_{t0}/σ_T) ‖(I - QQᵀ) z‖."""
    rng = np.random.default_rng(0)
    data3 = rng.normal(size=(30, 3))
    q = np.linalg.qr(rng.normal(size=(40, 3)))[0]  # (40, 3), orthonormal columns
    data40 = data3 @ q.T
    z40 = rng.normal(size=(16, 40))

    def run(data, z, tweedie):
        times = geometric_time_grid(4.0, 0.02, 25)
        denoise = lambda x, t: kernel_denoiser(x, data, t)  # noqa: E731
        return np.asarray(reverse_diffusion(None, denoise, z, times, tweedie=tweedie))

    s_0, s_T = math.sqrt(-math.expm1(-0.04)), math.sqrt(-math.expm1(-8.0))
    with jax.enable_x64():
        out3 = run(data3, z40 @ q, True)
        out40 = run(data40, z40, True)
        np.testing.assert_allclose(out40, out3 @ q.T, atol=1e-10)
        noisy3 = run(data3, z40 @ q, False)
        noisy40 = run(data40, z40, False)
    np.testing.assert_allclose(noisy40 @ q, noisy3, atol=1e-10)  # the in-span part is the same
    perp = np.linalg.norm(noisy40 - noisy40 @ q @ q.T, axis=1)
    expected = float(s_0 / s_T) * np.linalg.norm(z40 - z40 @ q @ q.T, axis=1)
    np.testing.assert_allclose(perp, expected, rtol=1e-8)
    assert np.min(perp) > 0.1 * float(s_0)  # the noisy sample is off the span by ~σ_{t0} √37


def test_log_log_slope_with_and_without_the_floor():
    n = np.array([125, 250, 500, 1000, 2000, 4000])
    floor = 0.05
    w1 = floor + 2.0 * n**-0.5
    slope, used = g.log_log_slope(n, w1, floor=floor)
    assert slope == pytest.approx(-0.5, abs=1e-9) and used == 6
    raw, _ = g.log_log_slope(n, w1)
    assert -0.45 < raw < -0.2  # the floor flattens the raw slope
    below = w1.copy()
    below[-1] = floor / 2  # under the floor: left out
    slope, used = g.log_log_slope(n, below, floor=floor)
    assert slope == pytest.approx(-0.5, abs=1e-9) and used == 5
    assert math.isnan(g.log_log_slope(n[:2], [0.01, 0.01], floor=floor)[0])
    with pytest.raises(ValueError, match="same length"):
        g.log_log_slope(n, w1[:3])
    with pytest.raises(ValueError, match="positive"):
        g.log_log_slope(-n, w1)


def test_tweedie_step_is_the_denoiser_at_t0_of_the_noisy_sample():
    key = jax.random.key(0)
    bases = g.random_subspaces(key, 8, (2, 2, 1))
    x, _ = g.sample_union_of_subspaces(key, bases, num=100, weights=(0.5, 0.3, 0.2), laws=LAWS)
    kw = dict(num_samples=20, k=2, num_steps=10, chunk_size=32)
    out = g.sample_kernel_diffusion(key, x, **kw)
    noisy = g.sample_kernel_diffusion(key, x, tweedie=False, **kw)
    t0 = jnp.asarray(early_stopping_time(100, 2), jnp.float32)
    np.testing.assert_allclose(kernel_denoiser(noisy, x, t0), out, atol=1e-5)
    assert np.min(np.linalg.norm(np.asarray(noisy - out), axis=1)) > 0.01  # σ(t0) = 0.1


def test_preconditioned_denoiser_is_the_wiener_filter_at_zero_and_its_target_has_unit_variance():
    zero = lambda params, x, t: jnp.zeros_like(x)  # noqa: E731
    sd, t = 0.3, 0.4
    m, s = math.exp(-t), math.sqrt(1 - math.exp(-2 * t))
    x = jnp.ones((2, 5))
    wiener = m * sd**2 / (m**2 * sd**2 + s**2)  # E[x0 | x_t] for x0 ~ N(0, sd² I)
    out = mlp_denoiser(zero, None, data_std=sd)(x, jnp.asarray(t))
    np.testing.assert_allclose(out, wiener * np.ones((2, 5)), rtol=1e-6)
    eps_out = mlp_denoiser(zero, None)(x, jnp.asarray(t))  # ε̂ = 0: x̂0 = x / m
    np.testing.assert_allclose(eps_out, np.ones((2, 5)) / m, rtol=1e-6)
    x0 = sd * jax.random.normal(jax.random.key(0), (4000, 8))
    for std in (sd, None):  # the zero network's loss is the target's variance, 1 for both
        loss = dsm_loss(None, zero, jax.random.key(1), x0, t_min=1e-3, t_max=5.0, data_std=std)
        assert float(loss) == pytest.approx(1.0, abs=0.03)
    with pytest.raises(ValueError, match="data_std"):
        mlp_denoiser(zero, None, data_std=0.0)
