"""SABER pieces (reconstruction) against their definitions, float64 NumPy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.continual.saber import (
    alignment_penalty,
    balance_by_input_energy,
    balance_weights,
    decompose_update,
    recompose,
)
from lowrank_jax.optim import SubspaceMemory

TOL = dict(rtol=1e-5, atol=1e-5)


def _mem(q, capacity):
    basis = np.zeros((q.shape[0], capacity))
    basis[:, : q.shape[1]] = q
    return SubspaceMemory(jnp.asarray(basis, jnp.float32), jnp.asarray(q.shape[1], jnp.int32))


def test_decompose_update_parts_are_orthogonal_and_add_up():
    rng = np.random.default_rng(0)
    n, m = 10, 6
    q_all, _ = np.linalg.qr(rng.standard_normal((n, 5)))
    u, q = q_all[:, :3], q_all[:, 3:]  # shared and earlier-specific bases, mutually orthogonal
    delta = rng.standard_normal((n, m))
    s, d = decompose_update(jnp.asarray(delta, jnp.float32), _mem(u, 4), _mem(q, 3))
    s, d = np.asarray(s, np.float64), np.asarray(d, np.float64)
    np.testing.assert_allclose(s, u @ u.T @ delta, **TOL)
    np.testing.assert_allclose(d, delta - q_all @ q_all.T @ delta, **TOL)
    np.testing.assert_allclose(u.T @ d, 0, atol=1e-5)
    np.testing.assert_allclose(q.T @ d, 0, atol=1e-5)
    # with no earlier specific subspace the parts add up to the update
    empty = SubspaceMemory(jnp.zeros((n, 3)), jnp.asarray(0, jnp.int32))
    s2, d2 = decompose_update(jnp.asarray(delta, jnp.float32), _mem(u, 4), empty)
    np.testing.assert_allclose(np.asarray(s2) + np.asarray(d2), delta, **TOL)


def test_decompose_with_non_orthogonal_bases_projects_off_their_union():
    rng = np.random.default_rng(1)
    n = 8
    u, _ = np.linalg.qr(rng.standard_normal((n, 2)))
    q, _ = np.linalg.qr(
        np.concatenate(
            [u[:, :1] + 0.3 * rng.standard_normal((n, 1)), rng.standard_normal((n, 1))], 1
        )
    )
    delta = rng.standard_normal((n, 4))
    _, d = decompose_update(jnp.asarray(delta, jnp.float32), _mem(u, 2), _mem(q, 2))
    c = np.concatenate([u, q], 1)
    ref = delta - c @ np.linalg.pinv(c) @ delta
    np.testing.assert_allclose(np.asarray(d), ref, atol=1e-4)


def test_balance_weights_and_recompose():
    e = np.array([1.0, 4.0, 0.25, 0.0])
    w = np.asarray(balance_weights(e, gamma=0.5, min_weight=0.25))
    mean = e.mean()
    ref = np.clip((mean / np.where(e > 0, e, 1)) ** 0.5, 0.25, 1.0)
    ref[e == 0] = 1.0
    np.testing.assert_allclose(w, ref, **TOL)
    np.testing.assert_allclose(balance_weights(e, gamma=0.0), 1.0)
    rng = np.random.default_rng(2)
    s = rng.standard_normal((3, 5, 4))
    d = rng.standard_normal((3, 5, 4)) * np.array([1.0, 3.0, 0.5])[:, None, None]
    total, lam, beta = recompose(
        jnp.asarray(s, jnp.float32), jnp.asarray(d, jnp.float32), gamma=1.0, min_weight=0.1
    )
    ed = (d**2).sum((1, 2))
    lam_ref = np.clip(ed.mean() / ed, 0.1, 1.0)
    es = (s**2).sum((1, 2))
    beta_ref = np.clip(es.mean() / es, 0.1, 1.0)
    np.testing.assert_allclose(lam, lam_ref, rtol=1e-5)
    np.testing.assert_allclose(beta, beta_ref, rtol=1e-5)
    ref = np.einsum("t,tnm->nm", beta_ref, s) + np.einsum("t,tnm->nm", lam_ref, d)
    np.testing.assert_allclose(total, ref, rtol=1e-4, atol=1e-4)
    total_mean, _, beta_mean = recompose(
        jnp.asarray(s, jnp.float32), jnp.asarray(d, jnp.float32), shared_mode="mean"
    )
    norms = np.sqrt(es)
    np.testing.assert_allclose(beta_mean, norms.mean() / (3 * norms), rtol=1e-5)


def test_alignment_penalty():
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((6, 2)))
    a = rng.standard_normal((6, 3))
    p = float(alignment_penalty(jnp.asarray(a, jnp.float32), _mem(u, 3)))
    np.testing.assert_allclose(p, np.sum((a - u @ u.T @ a) ** 2), rtol=1e-5)
    inside = u @ rng.standard_normal((2, 3))
    assert float(alignment_penalty(jnp.asarray(inside, jnp.float32), _mem(u, 3))) < 1e-9
    empty = SubspaceMemory(jnp.zeros((6, 2)), jnp.asarray(0, jnp.int32))
    assert float(alignment_penalty(jnp.asarray(a, jnp.float32), empty)) == 0.0


def test_errors():
    with pytest.raises(ValueError, match="gamma"):
        balance_weights(np.ones(2), gamma=-1.0)
    with pytest.raises(ValueError, match="min_weight"):
        balance_weights(np.ones(2), min_weight=0.0)
    with pytest.raises(ValueError, match=r"\(T, n, m\)"):
        recompose(np.ones((2, 3, 3)), np.ones((3, 3, 3)))
    with pytest.raises(ValueError, match="shared_mode"):
        recompose(np.ones((2, 3, 3)), np.ones((2, 3, 3)), shared_mode="sum")


def test_balance_by_input_energy_gains_per_direction():
    rng = np.random.default_rng(4)
    n = 5
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    c = np.array([4.0, 1.0, 0.0, 2.0, 0.0])
    a = np.array([1.0, 1.0, 3.0, 0.0, 0.0])
    old_cov, new_cov = v @ np.diag(c) @ v.T, v @ np.diag(a) @ v.T
    delta = rng.standard_normal((n, 3))
    out = np.asarray(
        balance_by_input_energy(jnp.asarray(delta, jnp.float32), old_cov, new_cov, strength=2.0),
        np.float64,
    )
    rho = np.array([1 / (1 + 8), 1 / (1 + 2), 1.0, 0.0, 1.0])
    np.testing.assert_allclose(out, v @ np.diag(rho) @ v.T @ delta, atol=1e-4)
    # no old tasks or strength 0: unchanged
    same = balance_by_input_energy(delta, np.zeros((n, n)), new_cov, strength=2.0)
    np.testing.assert_allclose(same, delta, atol=1e-5)
    same = balance_by_input_energy(delta, old_cov, new_cov, strength=0.0)
    np.testing.assert_allclose(same, delta, atol=1e-4)
    # the change seen by old inputs never grows
    assert np.trace(out.T @ old_cov @ out) <= np.trace(delta.T @ old_cov @ delta) + 1e-6
    with pytest.raises(ValueError, match="strength"):
        balance_by_input_energy(delta, old_cov, new_cov, strength=-1.0)
