"""Trajectory merges (LAWA, EMA, ExPO, Extra-Merge): streamed results equal their definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import merging
from lowrank_jax.merging.averaging import expo, window_matrix
from lowrank_jax.merging.streaming import weighted_sum, weighted_sums

RTOL = 1e-5  # float32 accumulation against float64 references
ATOL = 1e-6


def _tree(vec: np.ndarray) -> dict:
    """Splits a flat vector of 2·3 + 4 + 5 = 15 entries into a small nested parameter tree."""
    return {
        "params": {
            "dense": {"kernel": jnp.asarray(vec[:6].reshape(2, 3), jnp.float32)},
            "bias": jnp.asarray(vec[6:10], jnp.float32),
        },
        "head": jnp.asarray(vec[10:15], jnp.float32),
    }


def _flat(tree: dict) -> np.ndarray:
    t = jax.tree.map(lambda x: np.asarray(x, np.float64), tree)
    return np.concatenate([t["head"], t["params"]["bias"], t["params"]["dense"]["kernel"].ravel()])


def _ref_flat(vec: np.ndarray) -> np.ndarray:
    return _flat(_tree(vec))


def _trajectory(n=12, p=15, seed=0):
    rng = np.random.default_rng(seed)
    drift = rng.normal(size=p)
    noise = 0.3 * rng.normal(size=(n, p))
    thetas = np.arange(n)[:, None] * drift[None] * 0.1 + noise + rng.normal(size=p)
    # Round through float32 so the float64 references see exactly the stored values.
    return thetas.astype(np.float32).astype(np.float64)


def test_lawa_ema_expo_weighted_sums_match_definitions():
    thetas = _trajectory()
    n = len(thetas)
    ckpts = [_tree(t) for t in thetas]
    ref = lambda v: _ref_flat(v)  # noqa: E731  (same ordering as _flat)
    np.testing.assert_allclose(
        _flat(merging.lawa(ckpts, window=4)), ref(thetas[-4:].mean(0)), rtol=RTOL, atol=ATOL
    )
    # All of a one-shot iterator.
    np.testing.assert_allclose(
        _flat(merging.lawa(iter(ckpts))), ref(thetas.mean(0)), rtol=RTOL, atol=ATOL
    )
    beta = 0.8
    e = thetas[0]
    for t in thetas[1:]:
        e = beta * e + (1 - beta) * t
    np.testing.assert_allclose(
        _flat(merging.ema(iter(ckpts), decay=beta)), ref(e), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        _flat(expo(ckpts[-2], ckpts[-1], alpha=1.5)),
        ref(thetas[-1] + 1.5 * (thetas[-1] - thetas[-2])),
        rtol=RTOL,
        atol=ATOL,
    )
    w1, w2 = np.linspace(-1, 1, n), np.cos(np.arange(n))
    per_leaf = {
        "params/dense/kernel": w1,
        "params/bias": w2,
        "head": np.ones(n) / n,
    }
    a, b, c = weighted_sums(iter(ckpts), [w1, w2, per_leaf])
    np.testing.assert_allclose(_flat(a), ref(w1 @ thetas), rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(_flat(b), ref(w2 @ thetas), rtol=RTOL, atol=1e-5)
    expected = np.concatenate([thetas.mean(0)[10:15], (w2 @ thetas)[6:10], (w1 @ thetas)[:6]])
    np.testing.assert_allclose(_flat(c), expected, rtol=RTOL, atol=1e-5)
    # The sliding window merges M_W ... M_N.
    merges = [_flat(m) for m in merging.window_merges(iter(ckpts), window=3)]
    a = window_matrix(n, window=3)
    assert a.shape == (n - 2, n)
    np.testing.assert_allclose(
        np.stack(merges), np.stack([ref(r) for r in a @ thetas]), rtol=RTOL, atol=ATOL
    )


def _numpy_extra_merge(thetas: np.ndarray, window: int):
    """The in-memory definition: stack the window merges, centre, SVD."""
    n = len(thetas)
    merges = np.stack([thetas[j - window + 1 : j + 1].mean(0) for j in range(window - 1, n)])
    x = merges - merges.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    u = vt[0]
    lag = min(window, len(merges) - 1)
    if (merges[-1] - merges[-1 - lag]) @ u < 0:
        u = -u
    coords = x @ u
    i, j = np.triu_indices(len(coords), 1)
    rate = np.median((coords[j] - coords[i]) / (j - i))
    return merges[-1], u, rate, s[0] ** 2 / np.sum(s**2), coords


@pytest.mark.parametrize("per_tensor", [False, True])
def test_extra_merge_equals_stack_then_svd(per_tensor):
    thetas = _trajectory(n=14)
    ckpts = [_tree(t) for t in thetas]
    window, alpha = 4, 2.5
    out = merging.extra_merge(
        ckpts, window=window, alpha=alpha, key=jax.random.key(0), per_tensor=per_tensor
    )
    if not per_tensor:
        m_n, u, rate, rho1, coords = _numpy_extra_merge(thetas, window)
        np.testing.assert_allclose(out.pca.rho1, rho1, rtol=1e-5)
        np.testing.assert_allclose(out.pca.rate, rate, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(out.pca.coords, coords, rtol=1e-4, atol=1e-5)
        expected = m_n + alpha * rate * u
    else:
        # Per tensor: one SVD per leaf (in _flat's order: head, bias, kernel).
        expected = np.zeros(15)
        for sl in (slice(10, 15), slice(6, 10), slice(0, 6)):
            m_n, u, rate, _, _ = _numpy_extra_merge(thetas[:, sl], window)
            expected[sl] = m_n + alpha * rate * u
        expected = _ref_flat(expected)
        assert set(out.pca) == {"params/dense/kernel", "params/bias", "head"}
    if not per_tensor:
        expected = _ref_flat(expected)
    np.testing.assert_allclose(_flat(out.params), expected, rtol=1e-4, atol=1e-5)
    # The line form agrees with the direct weighted sum.
    line = merging.extra_merge_line(
        lambda: iter(ckpts), window=window, key=jax.random.key(0), per_tensor=per_tensor
    )
    np.testing.assert_allclose(_flat(line.at(alpha)), _flat(out.params), rtol=1e-5, atol=1e-5)


def test_straight_line_has_rho1_one_and_default_alpha_recovers_the_last_checkpoint():
    rng = np.random.default_rng(1)
    start, d = rng.normal(size=15), rng.normal(size=15)
    thetas = (start[None] + np.arange(20)[:, None] * 0.05 * d[None]).astype(np.float32)
    ckpts = [_tree(t.astype(np.float64)) for t in thetas]
    for window in (1, 5, 10):
        sketch = merging.sketch_trajectory(ckpts, key=jax.random.key(0))
        assert sketch.exact
        pca = merging.trajectory_pca(sketch, window=window)
        np.testing.assert_allclose(pca.rho1, 1.0, atol=1e-6)
        np.testing.assert_allclose(pca.rate, 0.05 * np.linalg.norm(d), rtol=1e-4)
        # M_N lags θ_N by (W-1)/2 steps along the line; the default α undoes exactly that lag.
        out = merging.extra_merge(ckpts, window=window, key=jax.random.key(0))
        assert out.alpha == merging.default_alpha(window) == (window - 1) / 2
        np.testing.assert_allclose(
            _flat(out.params), _ref_flat(thetas[-1].astype(np.float64)), rtol=1e-4, atol=1e-5
        )


def test_sketched_gram_is_close_when_parameters_exceed_the_sketch():
    rng = np.random.default_rng(2)
    n, p = 16, 40_000
    drift = rng.normal(size=p)
    thetas = (
        np.arange(n)[:, None] * 0.02 * drift + 0.05 * rng.normal(size=(n, p)) + rng.normal(size=p)
    ).astype(np.float32)
    ckpts = [
        {"w": jnp.asarray(t[: p // 2].reshape(100, -1)), "b": jnp.asarray(t[p // 2 :])}
        for t in thetas
    ]
    sketch = merging.sketch_trajectory(ckpts, key=jax.random.key(3), sketch_dim=8192)
    assert not sketch.exact and sketch.sketch.shape == (n, 8192)
    # Same leaf order as the tree's flattening: "b" then "w".
    flat = np.concatenate([thetas[:, p // 2 :], thetas[:, : p // 2]], axis=1).astype(np.float64)
    diffs = flat - flat[0]
    exact = diffs @ diffs.T
    err = np.abs(sketch.gram() - exact) / np.sqrt(np.outer(np.diag(exact), np.diag(exact)) + 1e-30)
    assert err.max() < 0.06  # ~ 4 standard deviations of 1/sqrt(8192)
    _, _, _, rho1, _ = _numpy_extra_merge(flat, 5)
    assert abs(merging.trajectory_pca(sketch, window=5).rho1 - rho1) < 0.01


# The river-valley toy of specs §5 (4a): f(x, y) = A·softplus(-x) + (h/2)|y|², 100 parameters,
# noisy SGD for 5k steps, a checkpoint every 50; the last 40 checkpoints are merged. The step size
# and noise put the late trajectory where the drift along the river and the bouncing across it
# are of similar size (raw ρ₁ ≈ 0.7–0.9), as in late pre-training at a constant learning rate.
A, H, LR, SIGMA, X0 = 0.3, 100.0, 1e-3, 3.0, -3.0


def _river_valley(seed: int, *, steps=5000, every=50):
    rng = np.random.default_rng(seed)
    theta = np.zeros(100)
    theta[0] = X0
    out = []
    for t in range(1, steps + 1):
        grad = np.concatenate([[-A / (1.0 + np.exp(theta[0]))], H * theta[1:]])
        theta = theta - LR * (grad + SIGMA * rng.normal(size=100))
        if t % every == 0:
            out.append(theta.copy())
    return np.stack(out)


def _river_loss(theta):
    theta = np.asarray(theta, np.float64)
    return float(A * np.logaddexp(0.0, -theta[0]) + 0.5 * H * np.sum(theta[1:] ** 2))


def test_river_valley_toy():
    """Merged points lie near a line (ρ₁ > 0.9, above raw) and stepping along it beats LAWA/EMA."""
    thetas = _river_valley(0)[-40:].astype(np.float32)
    ckpts = [{"theta": jnp.asarray(t)} for t in thetas]
    key = jax.random.key(0)
    sketch = merging.sketch_trajectory(ckpts, key=key)
    raw = merging.trajectory_pca(sketch, window=1).rho1
    merged = merging.trajectory_pca(sketch, window=10).rho1
    assert merged > 0.9 and merged > raw + 0.1, (raw, merged)
    loss = lambda tree: _river_loss(tree["theta"])  # noqa: E731
    out = merging.extra_merge(
        ckpts, window=10, key=key, loss_fn=loss, alphas=np.arange(0.0, 36.0, 1.0)
    )
    assert out.alpha > 0
    lawa = loss(merging.lawa(ckpts, window=10))
    ema = min(loss(merging.ema(ckpts, decay=b)) for b in (0.8, 0.9, 0.95))
    best = loss(out.params)
    assert best < lawa - 1e-3 and best < ema - 1e-3, (best, lawa, ema)
    # U-shape: the loss rises again at the far end of the grid.
    assert out.search.losses[-1] > out.search.best_loss + 1e-3
    assert out.search.losses[0] > out.search.best_loss + 1e-3


def _mismatched():
    good = _tree(np.arange(15.0))
    bad = {
        "params": {
            "dense": {"kernel": jnp.zeros((3, 2))},
            "bias": jnp.zeros(4),
        },
        "head": jnp.zeros(5),
    }
    return good, bad


@pytest.mark.parametrize(
    "call",
    [
        lambda c: merging.lawa(c, window=2),
        lambda c: merging.lawa(iter(c)),
        lambda c: merging.ema(c, decay=0.5),
        lambda c: expo(c[0], c[2], alpha=1.0),
        lambda c: weighted_sum(c, np.ones(3) / 3),
        lambda c: list(merging.window_merges(c, window=2)),
        lambda c: merging.sketch_trajectory(c, key=jax.random.key(0)),
        lambda c: merging.extra_merge(c, window=2, key=jax.random.key(0)),
        lambda c: merging.extra_merge_line(c, window=2, key=jax.random.key(0)),
    ],
)
def test_every_merge_names_the_first_differing_path(call):
    good, bad = _mismatched()
    with pytest.raises(ValueError, match=r"'params/dense/kernel'.*shape \(3, 2\) vs \(2, 3\)"):
        call([good, good, bad])


def test_missing_leaf_and_one_shot_iterator_errors():
    good, _ = _mismatched()
    missing = {"params": {"dense": good["params"]["dense"]}, "head": good["head"]}
    with pytest.raises(ValueError, match="no parameter at 'params/bias'"):
        merging.lawa([good, missing])
    with pytest.raises(TypeError, match="fresh iterator"):
        merging.extra_merge(iter([good] * 4), window=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="window=4 leaves 1 merge"):
        merging.extra_merge([good] * 4, window=4, key=jax.random.key(0))
    with pytest.raises(TypeError, match="non-floating leaf at 'step'"):
        merging.lawa([{"w": jnp.ones(2), "step": jnp.int32(1)}] * 2)


def test_numpy_checkpoints_take_the_host_path_and_match_the_float64_definitions():
    """Checkpoints loaded as NumPy arrays (e.g. ``.npz``) are accumulated and sketched on the
    host block by block; results equal the float64 definitions and the device path. One leaf is
    longer than a host block (2**20 entries) so the blocked fold crosses a block boundary."""
    rng = np.random.default_rng(3)
    n, big, k = 6, (1 << 20) + 3333, 1000
    base = rng.normal(size=big + 7)
    drift = rng.normal(size=big + 7)
    thetas = base + 0.01 * np.arange(n)[:, None] * drift + 0.003 * rng.normal(size=(n, big + 7))
    thetas = thetas.astype(np.float32)
    host = [{"big": t[:big], "small": {"w": t[big:].reshape(1, 7)}} for t in thetas]
    device = [jax.tree.map(jnp.asarray, c) for c in host]
    flat = lambda tree: np.concatenate(  # noqa: E731
        [np.asarray(tree["big"], np.float64), np.asarray(tree["small"]["w"], np.float64).ravel()]
    )
    t64 = thetas.astype(np.float64)
    for ckpts in (host, device):
        np.testing.assert_allclose(flat(merging.lawa(ckpts)), t64.mean(0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            flat(merging.lawa(ckpts, window=3)), t64[-3:].mean(0), rtol=1e-5, atol=1e-5
        )
        e = t64[0]
        for t in t64[1:]:
            e = 0.7 * e + 0.3 * t
        np.testing.assert_allclose(flat(merging.ema(ckpts, decay=0.7)), e, rtol=1e-5, atol=1e-5)
        out = merging.lawa(ckpts)
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(out))
        assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, ckpts[0])
    # the sketch: the same folded rows on both paths, and inner products as expected (P > k)
    key = jax.random.key(0)
    s_host = merging.sketch_trajectory(host, key=key, sketch_dim=k, per_tensor=True)
    s_dev = merging.sketch_trajectory(device, key=key, sketch_dim=k, per_tensor=True)
    np.testing.assert_allclose(s_host.sketch, s_dev.sketch, rtol=1e-4, atol=1e-3)
    for p in s_dev.leaf_sketches:
        np.testing.assert_allclose(
            s_host.leaf_sketches[p], s_dev.leaf_sketches[p], rtol=1e-4, atol=1e-3
        )
    # the fold itself, against a float64 reference: σ ⊙ (θ_i − θ₁), coordinates summed mod k
    packed = merging.sketch.sketch_signs(key, 0, big)  # leaf 0 in flattening order: "big"
    signs = merging.sketch.unpack_signs(packed, 0, big).astype(np.float64)
    np.testing.assert_array_equal(merging.sketch.unpack_signs(packed, 8, 24), signs[8:24])
    assert set(np.unique(signs)) == {-1, 1} and abs(signs.mean()) < 0.01
    y = signs * (t64[2, :big] - t64[0, :big])
    want = np.bincount(np.arange(big) % k, weights=y, minlength=k)
    np.testing.assert_allclose(s_host.leaf_sketches["big"][2], want, rtol=1e-4, atol=1e-3)
    a = merging.extra_merge(host, window=2, key=key, sketch_dim=k)
    b = merging.extra_merge(device, window=2, key=key, sketch_dim=k)
    assert a.pca.rho1 == pytest.approx(b.pca.rho1, rel=1e-6)
    np.testing.assert_allclose(flat(a.params), flat(b.params), rtol=1e-5, atol=1e-5)
