"""The library's one truncated SVD (spectral.svd) against NumPy's float64 SVD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.spectral import svd

RNG = np.random.default_rng(0)
A = RNG.standard_normal((3, 9, 6)).astype(np.float32)  # a batch of three (9, 6) matrices


def _best(a, k):
    u, s, vt = np.linalg.svd(a.astype(np.float64), full_matrices=False)
    return (u[..., :k] * s[..., None, :k]) @ vt[..., :k, :], s[..., :k]


def test_truncated_svd_and_approximation_match_numpy_batched():
    u, s, vt = jax.jit(lambda a: svd.truncated_svd(a, rank=2))(A)
    assert u.shape == (3, 9, 2) and s.shape == (3, 2) and vt.shape == (3, 2, 6)
    best, s_ref = _best(A, 2)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5)
    np.testing.assert_allclose(svd.lowrank_approximation(A, rank=2), best, atol=1e-5)


def test_lowrank_approximation_threshold_keeps_only_the_large_values():
    a = np.diag([5.0, 3.0, 1.0]).astype(np.float32)
    got = svd.lowrank_approximation(a, rank=3, threshold=2.0)
    np.testing.assert_allclose(got, np.diag([5.0, 3.0, 0.0]), atol=1e-6)


def test_balanced_factors_split_the_truncation_evenly_under_a_scale():
    x, y = svd.balanced_factors(A[0], rank=3, scale=0.5)
    np.testing.assert_allclose(0.5 * x @ y, _best(A[0], 3)[0], atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(x, axis=0), jnp.linalg.norm(y, axis=1), rtol=1e-5)


def test_product_svd_never_forms_the_product_but_equals_its_svd():
    a, b = RNG.standard_normal((40, 4)), RNG.standard_normal((30, 4))
    u, s, vt = svd.product_svd(a.astype(np.float32), b.astype(np.float32), rank=3)
    best, s_ref = _best(a @ b.T, 3)
    np.testing.assert_allclose(s, s_ref, rtol=1e-5)
    np.testing.assert_allclose((u * s) @ vt, best, atol=1e-4)


def test_bad_ranks_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"rank must be an int in \[1, 6\]"):
        svd.truncated_svd(A, rank=7)
    with pytest.raises(ValueError, match="matrix"):
        svd.truncated_svd(np.ones(3), rank=1)
    with pytest.raises(ValueError, match="share q"):
        svd.product_svd(np.ones((4, 2)), np.ones((4, 3)), rank=1)
