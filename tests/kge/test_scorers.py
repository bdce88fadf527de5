"""Scorers as query encoders, against float64/complex128 NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.kge.scorers import init_scorer, query_embedding


def test_complex_realified_equals_complex_trilinear_product():
    params = init_scorer(
        jax.random.key(0), scorer="complex", num_entities=6, num_relations=4, dim=8
    )
    heads, rels = jnp.array([0, 3, 5]), jnp.array([1, 0, 3])
    scores = query_embedding(params, heads, rels, scorer="complex") @ params["entity"].T
    ent = np.asarray(params["entity"], np.float64)
    rel = np.asarray(params["relation"], np.float64)
    e_c = ent[:, :4] + 1j * ent[:, 4:]
    r_c = rel[:, :4] + 1j * rel[:, 4:]
    ref = np.real(np.einsum("bi,bi,ei->be", e_c[heads], r_c[rels], np.conj(e_c)))
    np.testing.assert_allclose(scores, ref, atol=1e-5)


def test_distmult_and_tucker_match_reference():
    key = jax.random.key(1)
    p = init_scorer(key, scorer="distmult", num_entities=5, num_relations=3, dim=4)
    h = query_embedding(p, jnp.array([1, 2]), jnp.array([0, 2]), scorer="distmult")
    np.testing.assert_allclose(
        h, np.asarray(p["entity"])[[1, 2]] * np.asarray(p["relation"])[[0, 2]]
    )
    t = init_scorer(key, scorer="tucker", num_entities=5, num_relations=3, dim=4, relation_dim=2)
    assert t["core"].shape == (4, 2, 4)
    h = query_embedding(t, jnp.array([1, 4]), jnp.array([2, 0]), scorer="tucker")
    ref = np.einsum(
        "bi,bj,ijk->bk",
        np.asarray(t["entity"], np.float64)[[1, 4]],
        np.asarray(t["relation"], np.float64)[[2, 0]],
        np.asarray(t["core"], np.float64),
    )
    np.testing.assert_allclose(h, ref, atol=1e-6)


def test_scorer_errors():
    with pytest.raises(ValueError, match="even"):
        init_scorer(jax.random.key(0), scorer="complex", num_entities=3, num_relations=1, dim=5)
    with pytest.raises(ValueError, match="unknown scorer"):
        init_scorer(jax.random.key(0), scorer="rotate", num_entities=3, num_relations=1, dim=4)
