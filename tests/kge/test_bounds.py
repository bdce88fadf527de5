"""Forster-type sign-rank bounds on matrices and graphs whose answer is known."""

import numpy as np
import pytest
import scipy.linalg

from lowrank_jax.kge import linear_output_dim_bound
from lowrank_jax.kge.bounds import WEIGHTINGS, forster_bound, sign_rank_lower_bound


def test_hadamard_bound_is_sqrt_n():
    for n in (4, 16, 64):
        h = scipy.linalg.hadamard(n)
        np.testing.assert_allclose(forster_bound(h), np.sqrt(n), rtol=1e-10)
        np.testing.assert_allclose(
            sign_rank_lower_bound((h > 0).astype(float), weighting="plain"), np.sqrt(n), rtol=1e-10
        )


def test_rank_one_pattern_gives_one():
    rng = np.random.default_rng(0)
    u, v = rng.choice([-1.0, 1.0], 12), rng.choice([-1.0, 1.0], 9)
    y = np.outer(u, v)
    np.testing.assert_allclose(forster_bound(y), 1.0, rtol=1e-10)
    assert sign_rank_lower_bound((y > 0).astype(float)) <= 1.0 + 1e-9


def test_bounds_never_exceed_a_known_sign_rank():
    rng = np.random.default_rng(1)
    for r in (1, 2, 3, 6):
        for _ in range(5):
            a = (rng.normal(size=(40, r)) @ rng.normal(size=(r, 25)) > 0).astype(float)
            if a.all() or not a.any():
                continue
            for w in (*WEIGHTINGS, "best"):
                assert sign_rank_lower_bound(a, weighting=w) <= r + 1e-9, (r, w)
    # the identity pattern 2I - 1 has sign-rank 3 (points on a circle)
    assert sign_rank_lower_bound(np.eye(30)) <= 3.0


def test_gram_norm_matches_dense_float64():
    rng = np.random.default_rng(2)
    a = (rng.random((30, 12)) < 0.2).astype(float)
    a[0] = 1.0  # an all-true row
    q, e = a.shape
    p_row = a.mean(1)
    c = np.where((p_row == 0) | (p_row == 1), 0.5, p_row)
    matrices = {
        "plain": 2 * a - 1,
        "centered": a - a.mean(),
        "row_centered": (a - c[:, None]) / np.minimum(c, 1 - c)[:, None],
    }
    for w, m in matrices.items():
        ref = np.sqrt(q * e) * np.abs(m).min() / np.linalg.norm(m, 2)
        np.testing.assert_allclose(sign_rank_lower_bound(a, weighting=w), ref, rtol=1e-9)


def test_graph_bound_on_a_hadamard_graph():
    h = scipy.linalg.hadamard(16)  # symmetric, so the inverse queries repeat the same rows
    s, o = np.nonzero(h > 0)
    train = np.stack([s, np.zeros_like(s), o], 1).astype(np.int32)
    out = linear_output_dim_bound(train, num_entities=16, num_relations=1)
    assert out["queries"] == 32 and out["triples"] == len(s)
    np.testing.assert_allclose(out["forster_plain"], 4.0, rtol=1e-10)
    assert out["sign_rank_bound"] >= 4.0 - 1e-9
    assert out["min_dim"] >= 3
    np.testing.assert_allclose(out["density"], (h > 0).mean(), rtol=1e-12)


def test_bound_grows_with_density_on_random_graphs():
    from lowrank_jax.kge import make_synthetic_kg

    b = [
        linear_output_dim_bound(
            make_synthetic_kg(num_entities=120, num_relations=2, density=p, seed=0).train,
            num_entities=120,
            num_relations=2,
        )["sign_rank_bound"]
        for p in (0.05, 0.2, 0.45)
    ]
    assert b[0] < b[1] < b[2]


def test_errors():
    with pytest.raises(ValueError, match="zero entry"):
        forster_bound(np.array([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="weighting"):
        sign_rank_lower_bound(np.eye(3), weighting="max")
    with pytest.raises(ValueError, match="only 0 and 1"):
        sign_rank_lower_bound(2 * np.eye(3))
