"""GIST's off-diagonal energy diagnostic (specs §11 (4a)) against its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models, selection
from lowrank_jax.selection.diagnostics import coordinate_subset, lora_vs_full_offdiag
from lowrank_jax.selection.gradients import flatten_per_example


def _reference(g, center=False):
    g = np.asarray(g, np.float64)
    g = g - g.mean(0) if center else g
    f = g.T @ g / len(g)  # the D x D second moment, formed explicitly
    off = f - np.diag(np.diag(f))
    return np.linalg.norm(off) / np.linalg.norm(np.diag(f))


def test_offdiag_ratio_equals_the_dense_definition():
    g = np.random.default_rng(0).standard_normal((7, 12)) * np.linspace(0.1, 3, 12)
    for center in (False, True):
        got = float(selection.offdiag_energy_ratio(jnp.asarray(g, jnp.float32), center=center))
        np.testing.assert_allclose(got, _reference(g, center), rtol=1e-4)


def test_offdiag_ratio_zero_for_diagonal_and_large_for_rank_one():
    # Each example's gradient on its own coordinate: F is diagonal, ρ = 0.
    g = np.zeros((6, 10), np.float32)
    g[np.arange(6), [0, 2, 3, 5, 7, 9]] = [1.0, -2.0, 0.5, 3.0, 1.5, -1.0]
    assert float(selection.offdiag_energy_ratio(g)) < 1e-3
    # Every gradient along one all-ones direction: F = c·11ᵀ, ρ = √(D² − D)/√D = √(D − 1).
    g = np.outer([1.0, -2.0, 0.5], np.ones(10)).astype(np.float32)
    np.testing.assert_allclose(float(selection.offdiag_energy_ratio(g)), 3.0, rtol=1e-5)
    # The permutation null keeps each column's values and breaks the rank-one dependence:
    # independent coordinates give ρ ≈ √((D − 1)/(N + 2)).
    g = np.outer(np.random.default_rng(1).standard_normal(40), np.ones(30)).astype(np.float32)
    null = np.asarray(selection.permutation_null(g, key=jax.random.key(0)))
    np.testing.assert_array_equal(np.sort(null, 0), np.sort(g, 0))
    np.testing.assert_allclose(float(selection.offdiag_energy_ratio(g)), np.sqrt(29), rtol=1e-4)
    assert 0.6 < float(selection.offdiag_energy_ratio(null)) / np.sqrt(29 / 42) < 1.6
    with pytest.raises(ValueError, match="N, D"):
        selection.offdiag_energy_ratio(np.ones((4, 1)))


def test_lora_vs_full_uses_equal_sizes_and_the_named_coordinates():
    model = models.MLP((8, 8), 3)
    x = jax.random.normal(jax.random.key(0), (9, 5))
    variables = model.init(jax.random.key(1), x[:1])
    rules = [(r".*dense_1/kernel", adapters.lora(2))]
    ad = jax.tree.map(lambda a: a + 0.3, adapters.init(jax.random.key(2), variables, rules))
    fwd = adapters.adapt(model.apply)

    def loss(ad, variables, ex):
        logits = fwd(variables, ad, ex["x"][None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ex["y"][None])[0]

    ex = {"x": x, "y": jnp.arange(9) % 3}
    out = lora_vs_full_offdiag(loss, ad, variables, ex, key=jax.random.key(3), chunk_size=4)
    assert out["num_params"] == 2 * (8 + 8) and out["num_examples"] == 9
    assert {"lora_null", "full_null", "full_adapted_null"} <= set(out)
    # "full_adapted" draws from dense_1's kernel only; check against a direct computation.
    idx = coordinate_subset(variables, 32, key=jax.random.fold_in(jax.random.key(3), 1),
                                      paths=["params/dense_1/kernel"])  # fmt: skip
    leaves = adapters.paths.named_leaves(variables)
    start = sum(v.size for k, v in leaves.items() if k < "params/dense_1/kernel")
    assert list(leaves).index("params/dense_1/kernel") == 3 and idx.min() >= start
    assert idx.max() < start + 64 and len(np.unique(idx)) == 32
    full = jax.vmap(jax.grad(lambda v, e: loss(ad, v, e)), in_axes=(None, 0))(variables, ex)
    flat = np.asarray(flatten_per_example(full))[:, idx]
    np.testing.assert_allclose(out["full_adapted"], _reference(flat), rtol=1e-3)
