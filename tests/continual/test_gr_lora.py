"""GR-LoRA pieces (reconstruction): entropy selection, mismatch loss, statistics, synthetic OOD."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.continual.gr_lora import (
    masked_entropy,
    mismatch_loss,
    select_module,
    synthesize_global,
    synthesize_local,
)
from lowrank_jax.continual.statistics import class_statistics


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_masked_entropy_matches_numpy():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 6))
    mask = np.array([0, 1, 1, 0, 1, 0], bool)
    p = _softmax(z[:, mask])
    ref = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(masked_entropy(z, mask), ref, rtol=1e-5)


def test_select_module_picks_lowest_entropy():
    # module 0 confident on its classes for example 0; module 1 confident for example 1
    masks = np.array([[1, 1, 0, 0], [0, 0, 1, 1]], bool)
    logits = np.zeros((2, 2, 4))
    logits[0, 0, 0] = 8.0
    logits[1, 1, 3] = 8.0
    weights, ent = select_module(logits, masks)
    np.testing.assert_array_equal(np.asarray(weights), [[1, 0], [0, 1]])
    assert ent.shape == (2, 2)
    soft, _ = select_module(logits, masks, temperature=0.1)
    np.testing.assert_allclose(np.asarray(soft).sum(-1), 1.0, rtol=1e-6)
    assert np.asarray(soft)[0, 0] > 0.99
    with pytest.raises(ValueError, match="temperature"):
        select_module(logits, masks, temperature=0.0)
    with pytest.raises(ValueError, match=r"\(T, b, C\)"):
        select_module(logits[0], masks)


def test_mismatch_loss_is_kl_from_uniform():
    mask = np.array([1, 1, 1, 0], bool)
    uniform = np.array([[2.0, 2.0, 2.0, 9.0]])
    assert float(mismatch_loss(uniform, mask)) == pytest.approx(0.0, abs=1e-6)
    z = np.array([[3.0, 0.0, -1.0, 5.0]])
    p = _softmax(z[:, :3])
    ref = np.sum((1 / 3) * np.log((1 / 3) / p))
    np.testing.assert_allclose(float(mismatch_loss(z, mask)), ref, rtol=1e-5)


def test_class_statistics_and_synthesis():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 1, (200, 3)), rng.normal(5, 2, (200, 3))])
    y = np.repeat([0, 2], 200)
    stats = class_statistics(x, y, 4, shrinkage=0.0)
    np.testing.assert_allclose(stats.mean[0], x[:200].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.var[2], x[200:].var(0), rtol=1e-5)
    np.testing.assert_array_equal(stats.count, [200, 0, 200, 0])
    shrunk = class_statistics(x, y, 4, shrinkage=0.5)
    np.testing.assert_allclose(shrunk.var[0], 0.5 * x[:200].var(0) + 0.5 * x.var(0), rtol=1e-5)
    more = class_statistics(np.ones((5, 3)), np.full(5, 1), 4, previous=stats)
    np.testing.assert_allclose(more.mean[0], stats.mean[0])
    np.testing.assert_allclose(more.mean[1], 1.0)
    g = synthesize_global(jax.random.key(0), stats, jnp.array([2]), 4000)
    np.testing.assert_allclose(np.asarray(g).mean(0), stats.mean[2], atol=0.15)
    np.testing.assert_allclose(np.asarray(g).std(0), np.sqrt(stats.var[2]), rtol=0.06)
    local = synthesize_local(
        jax.random.key(1), stats, jnp.array([0, 2]), 4000, low=0.5, high=0.5, noise=0.0
    )
    np.testing.assert_allclose(
        np.asarray(local),
        np.tile((stats.mean[0] + stats.mean[2]) / 2, (4000, 1)),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="labels"):
        class_statistics(x, y, 2)
