"""mergekit's SLERP, Model Stock, Breadcrumbs and DELLA against their definitions (float64 NumPy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, merging
from lowrank_jax.merging.mergekit import (
    della_delta,
    della_keep_probabilities,
    model_stock_delta,
    slerp_delta,
)
from lowrank_jax.merging.task_vectors import task_vector_matrices

RNG = np.random.default_rng(0)


def _dense_tvs(k, shape=(6, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": jnp.asarray(rng.normal(size=shape), jnp.float32)} for _ in range(k)]


def _np_slerp(v0, v1, t):
    u0, u1 = v0 / np.linalg.norm(v0), v1 / np.linalg.norm(v1)
    theta = np.arccos(np.clip(np.sum(u0 * u1), -1, 1))
    return (np.sin((1 - t) * theta) * v0 + np.sin(t * theta) * v1) / np.sin(theta)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_matches_definition(t):
    a, b = _dense_tvs(2)
    got = merging.merge_slerp(a, b, t=t)
    want = _np_slerp(np.asarray(a["w"], np.float64), np.asarray(b["w"], np.float64), t)
    np.testing.assert_allclose(np.asarray(adapters.delta(got["w"], (6, 5))), want, atol=1e-5)


def test_slerp_of_unit_vectors_stays_on_the_sphere_at_angle_t_theta():
    x = RNG.normal(size=(4, 3))
    y = RNG.normal(size=(4, 3))
    x, y = x / np.linalg.norm(x), y / np.linalg.norm(y)
    theta = np.arccos(np.sum(x * y))
    z = np.asarray(slerp_delta(jnp.asarray(x), jnp.asarray(y), t=0.25), np.float64)
    assert abs(np.linalg.norm(z) - 1) < 1e-5
    assert abs(np.arccos(np.clip(np.sum(z * x), -1, 1)) - 0.25 * theta) < 1e-3
    # nearly colinear: linear interpolation, as mergekit
    near = np.asarray(slerp_delta(jnp.asarray(x), jnp.asarray(2 * x), t=0.5))
    np.testing.assert_allclose(near, 1.5 * x, atol=1e-6)


def test_model_stock_matches_paper_for_two_and_mergekit_mean_for_three():
    tvs = _dense_tvs(3, seed=1)
    d = [np.asarray(v["w"], np.float64).ravel() for v in tvs]
    cos = lambda a, b: a @ b / np.linalg.norm(a) / np.linalg.norm(b)  # noqa: E731
    c2 = cos(d[0], d[1])
    t2 = 2 * c2 / (1 + c2)  # Jang et al. 2024, eq. for N = 2
    got2 = adapters.delta(merging.merge_model_stock(tvs[:2])["w"], (6, 5))
    np.testing.assert_allclose(np.asarray(got2).ravel(), t2 * (d[0] + d[1]) / 2, atol=1e-5)
    c3 = np.mean([cos(d[0], d[1]), cos(d[0], d[2]), cos(d[1], d[2])])
    t3 = 3 * c3 / (1 + 2 * c3)
    got3 = adapters.delta(merging.merge_model_stock(tvs)["w"], (6, 5))
    np.testing.assert_allclose(np.asarray(got3).ravel(), t3 * sum(d) / 3, atol=1e-5)
    # identical fine-tunes: cos = 1, t = 1, the merge is the fine-tune itself
    same = model_stock_delta(jnp.stack([tvs[0]["w"]] * 2))
    np.testing.assert_allclose(np.asarray(same), np.asarray(tvs[0]["w"]), atol=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        model_stock_delta(tvs[0]["w"][None])


@pytest.mark.parametrize(("density", "gamma"), [(0.5, 0.1), (0.9, 0.2), (0.3, 0.0)])
def test_breadcrumbs_drops_outliers_and_small_entries(density, gamma):
    tvs = _dense_tvs(2, shape=(8, 5), seed=2)
    weights = [0.7, 1.4]
    got = np.asarray(
        adapters.delta(
            merging.merge_breadcrumbs(tvs, density=density, gamma=gamma, weights=weights)["w"],
            (8, 5),
        )
    )
    want = np.zeros((8, 5))
    size = 40
    for w, v in zip(weights, tvs, strict=True):
        x = np.asarray(v["w"], np.float64).ravel()
        order = np.argsort(-np.abs(x), kind="stable")  # largest first
        top = min(int(gamma * size), size - int(density * size))
        kept = order[top : top + int(density * size)]
        mask = np.zeros(size, bool)
        mask[kept] = True
        assert mask.sum() == int(density * size)
        want += w * np.where(mask, x, 0).reshape(8, 5)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _np_della(deltas, keep, density, epsilon, weights, scale):
    k, n, m = deltas.shape
    ranks = np.argsort(np.argsort(np.abs(deltas), axis=1, kind="stable"), axis=1, kind="stable")
    probs = density - epsilon + 2 * epsilon * ranks / (n - 1)
    pruned = np.where(keep, deltas / probs, 0.0)
    weighted = np.asarray(weights)[:, None, None] * pruned
    gamma = np.where(weighted.sum(0) >= 0, 1.0, -1.0)
    agree = np.sign(weighted) == gamma
    div = (agree * np.asarray(weights)[:, None, None]).sum(0)
    div[div == 0] = 1
    return scale * (weighted * agree).sum(0) / div


def test_della_matches_definition_with_given_masks():
    deltas = RNG.normal(size=(3, 9, 4))
    keep = RNG.random(size=deltas.shape) < 0.5
    weights, density, eps, lam = [1.0, 0.5, 2.0], 0.5, 0.2, 0.8
    got = della_delta(
        jnp.asarray(deltas, jnp.float32), jnp.asarray(keep), density=density, epsilon=eps,
        weights=weights, scale=lam,
    )  # fmt: skip
    want = _np_della(deltas, keep, density, eps, weights, lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_della_keeps_large_entries_more_often_and_is_unbiased():
    delta = jnp.asarray(RNG.normal(size=(11, 3)), jnp.float32)
    probs = np.asarray(della_keep_probabilities(delta, density=0.5, epsilon=0.2))
    np.testing.assert_allclose(probs.mean(0), 0.5, atol=1e-6)  # mean keep rate is the density
    mags = np.abs(np.asarray(delta))
    for j in range(3):  # within a column, larger magnitude -> larger keep probability
        order = np.argsort(mags[:, j])
        assert np.all(np.diff(probs[order, j]) > 0)
        np.testing.assert_allclose(probs[order, j][[0, -1]], [0.3, 0.7], atol=1e-6)

    # one task vector: no sign conflict, so the merge is the rescaled MagPrune, E = delta
    def draw(key):
        keep = jax.random.bernoulli(key, jnp.asarray(probs))[None]
        return della_delta(delta[None], keep, density=0.5, epsilon=0.2)

    samples = jax.vmap(draw)(jax.random.split(jax.random.key(0), 4000))
    mean, std = samples.mean(0), samples.std(0) / np.sqrt(4000)
    assert np.all(np.abs(np.asarray(mean - delta)) <= 4.5 * np.asarray(std) + 1e-6)


def test_merge_della_on_stacked_lora_uses_one_mask_per_layer_and_is_seeded():
    params = {"w": jnp.zeros((2, 6, 5))}
    spec = adapters.lora(rank=2, in_ndim=1, out_ndim=1)
    tvs = []
    for seed in range(2):
        ads = adapters.init(jax.random.key(seed), params, [(r"w", spec)])
        tvs.append({p: a.replace(factors={k: jnp.asarray(RNG.normal(size=f.shape), jnp.float32)
                                          for k, f in a.factors.items()}) for p, a in ads.items()})  # fmt: skip
    one = merging.merge_della(tvs, jax.random.key(1), density=0.5, epsilon=0.1)
    two = merging.merge_della(tvs, jax.random.key(1), density=0.5, epsilon=0.1)
    np.testing.assert_array_equal(
        np.asarray(one["w"].factors["a"]), np.asarray(two["w"].factors["a"])
    )
    assert one["w"].factors["a"].shape[0] == 2  # stacked layers kept
    views = task_vector_matrices(tvs)["w"][0]
    for layer in range(2):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), 0), layer)
        d = views[:, layer]
        probs = jax.vmap(lambda x: della_keep_probabilities(x, density=0.5, epsilon=0.1))(d)
        keep = jax.random.bernoulli(key, probs)
        want = della_delta(d, keep, density=0.5, epsilon=0.1)
        got = adapters.delta(one["w"], (2, 6, 5))[layer]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_bad_arguments_raise():
    tvs = _dense_tvs(2)
    with pytest.raises(ValueError, match="density"):
        merging.merge_breadcrumbs(tvs, density=0.0)
    with pytest.raises(ValueError, match="epsilon"):
        merging.merge_della(tvs, jax.random.key(0), density=0.1, epsilon=0.2)
    with pytest.raises(TypeError, match="t must be a float"):
        merging.merge_slerp(*tvs, t="half")


def test_model_stock_of_exactly_opposed_updates_is_zero_not_nan():
    d = jax.random.normal(jax.random.key(0), (4, 3))
    out = model_stock_delta(jnp.stack([d, -d]))
    np.testing.assert_array_equal(np.asarray(out), 0.0)
