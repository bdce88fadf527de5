"""CASA against a float64 NumPy port of the reference ``transfer.py``, and its invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from lowrank_jax import adapters, merging
from lowrank_jax.merging.casa import casa_diagnostics


def reference_casa(
    b, a, w_s, w_t, *, rank, rot=0.5, q=0.5, arb_q=0.85, pairs_only=False, complement=None
):
    """``cluster_aware_spectral_arbitration`` of github.com/Noahwangyuchen/CASA in float64 NumPy.

    PyTorch orientation: ``W (out, in)``, ``ΔW = B A`` with ``B (out, r)``, ``A (r, in)``; the exact
    truncated SVD replaces ``svd_lowrank``. ``pairs_only``: our deliberate difference, suppression
    only on the ``min(out, in)`` block of singular pairs. ``complement``: an orthogonal
    ``(|out - in|,) * 2`` matrix rotating the full SVD's complement basis (another valid full SVD).
    Returns ``(B_new A_new, c_new, mask_high, suppress)``.
    """
    u_s, s_s, vh_s = np.linalg.svd(w_s, full_matrices=True)
    p = len(s_s)
    if complement is not None:
        if u_s.shape[0] > p:
            u_s[:, p:] = u_s[:, p:] @ complement
        else:
            vh_s[p:] = complement.T @ vh_s[p:]
    c_fft = u_s.T @ (w_t - w_s) @ vh_s.T
    cs = (u_s.T @ b) @ (a @ vh_s.T)
    d_out, d_in = c_fft.shape
    if cs.shape[0] == cs.shape[1]:
        cum = np.cumsum(s_s**2) / np.sum(s_s**2)
        k = int(np.nonzero(cum >= 0.90)[0][0]) + 1
    else:
        k = len(s_s)
    cs_k, s_k = cs[:k, :k], s_s[:k]
    rotation = np.abs(cs_k) / (np.abs(s_k[:, None] - s_k[None, :]) + 1e-6)
    np.fill_diagonal(rotation, 0)
    rows, cols = np.nonzero(rotation > rot)
    adj = np.zeros((k, k), int)
    adj[rows, cols] = adj[cols, rows] = 1
    n_clusters, labels = connected_components(csr_matrix(adj), directed=False)
    cd_k = c_fft[:k, :k]
    member = np.eye(n_clusters)[labels].T
    sizes = member.sum(1) + 1e-6
    rx = member @ np.linalg.norm(cd_k, axis=1) / sizes
    tx = member @ np.linalg.norm(cd_k, axis=0) / sizes
    idx_rx = np.isin(labels, np.nonzero(rx >= np.quantile(rx, q))[0])
    idx_tx = np.isin(labels, np.nonzero(tx >= np.quantile(tx, q))[0])
    full_rows = np.zeros(d_out, bool)
    full_rows[:k] = idx_rx
    full_cols = np.zeros(d_in, bool)
    full_cols[:k] = idx_tx
    mask_high = full_rows[:, None] | full_cols[None, :]
    energy = np.abs(cs * c_fft)
    dot = member @ (cs_k * cd_k) @ member.T
    n_cs = np.sqrt(member @ cs_k**2 @ member.T)
    n_cd = np.sqrt(member @ cd_k**2 @ member.T)
    context = np.ones((d_out, d_in))
    context[:k, :k] = member.T @ (dot / (n_cs * n_cd + 1e-8)) @ member
    score = energy * context
    same = np.sign(cs) == np.sign(c_fft)
    c_new = cs - c_fft
    c_new[mask_high] = cs[mask_high]
    cand = mask_high & same
    if pairs_only:
        cand[p:, :] = False
        cand[:, p:] = False
    suppress = np.zeros_like(cand)
    if cand.sum():
        suppress = cand & (score > np.quantile(score[cand], arb_q))
        larger = np.where(np.abs(cs) > np.abs(c_fft), cs, c_fft)
        c_new[suppress] = (larger - c_fft)[suppress]
    uc, sc, vch = np.linalg.svd(c_new)
    new = u_s @ (uc[:, :rank] * sc[:rank]) @ vch[:rank] @ vh_s
    return new, c_new, mask_high, suppress


def clustered_problem(n, m, seed):
    """Source with near-degenerate singular values, a drifted target and a rank-2 LoRA."""
    rng = np.random.default_rng(seed)
    p = min(n, m)
    base = np.repeat([6.0, 4.0, 2.5, 1.5, 1.0, 0.6, 0.4, 0.2], 3)[:p]
    s = base + 0.01 * rng.normal(size=p)
    u, _ = np.linalg.qr(rng.normal(size=(n, n)))
    v, _ = np.linalg.qr(rng.normal(size=(m, m)))
    w_s = (u[:, :p] * s) @ v[:, :p].T
    w_t = w_s + 0.08 * rng.normal(size=(n, m))
    a = 0.3 * rng.normal(size=(n, 2))
    b = 0.3 * rng.normal(size=(2, m))
    return w_s, w_t, a, b


@pytest.mark.parametrize("shape", [(12, 12), (9, 12)])
def test_casa_matches_the_reference_port_in_float64(shape):
    n, m = shape
    w_s, w_t, a, b = clustered_problem(n, m, seed=0)
    delta = a @ b
    # reference in PyTorch orientation: W = K^T, B = b^T, A = a^T
    # non-square: our suppression stays on the block of singular pairs (module docstring)
    pairs_only = n != m
    want, c_ref, high_ref, sup_ref = reference_casa(
        b.T, a.T, w_s.T, w_t.T, rank=4, pairs_only=pairs_only
    )
    assert high_ref.any() and sup_ref.any() and (~high_ref).any()  # every branch is exercised
    with jax.enable_x64(True):
        basis = merging.source_basis(jnp.asarray(delta), jnp.asarray(w_s), jnp.asarray(w_t))
        arb = merging.casa_arbitration(basis.c_lora, basis.c_fft, basis.s)
        fa, fb = merging.casa_matrix(jnp.asarray(delta), jnp.asarray(w_s), jnp.asarray(w_t), rank=4)
        got = np.asarray(fa @ fb)
        # in the same basis the decisions are identical (transposed orientation)
        c_ours = np.asarray(basis.u.T @ basis.u @ arb.c_new)
        assert int(arb.k) <= min(n, m)
        np.testing.assert_array_equal(np.asarray(arb.mask_high).sum(), high_ref.sum())
        np.testing.assert_array_equal(np.asarray(arb.suppress).sum(), sup_ref.sum())
        labels = np.asarray(arb.labels)
        assert len(set(labels[labels >= 0])) < int(arb.k)  # some cluster has several members
    np.testing.assert_allclose(got, want.T, atol=1e-9)
    assert np.linalg.norm(c_ours) > 0


def _orthogonal(rng, k):
    q, r = np.linalg.qr(rng.normal(size=(k, k)))
    return q * np.sign(np.diag(r))


@pytest.mark.parametrize("shape", [(14, 8), (8, 14)])
def test_non_square_casa_does_not_depend_on_the_full_svds_complement(shape):
    n, m = shape
    p = min(n, m)
    w_s, w_t, a, b = clustered_problem(n, m, seed=4)
    delta = a @ b
    rng = np.random.default_rng(5)
    q = _orthogonal(rng, abs(n - m))  # another orthonormal basis of the complement
    flip = rng.choice([-1.0, 1.0], size=p)  # and other signs of the singular pairs
    with jax.enable_x64(True):
        basis = merging.source_basis(jnp.asarray(delta), jnp.asarray(w_s), jnp.asarray(w_t))
        u, v = np.asarray(basis.u).copy(), np.asarray(basis.v).copy()
        u[:, :p] *= flip
        v[:, :p] *= flip
        if n > m:
            u[:, p:] = u[:, p:] @ q
        else:
            v[:, p:] = v[:, p:] @ q
        np.testing.assert_allclose((u[:, :p] * np.asarray(basis.s)) @ v[:, :p].T, w_s, atol=1e-12)
        ambient = []
        for uu, vv in ((np.asarray(basis.u), np.asarray(basis.v)), (u, v)):
            arb = merging.casa_arbitration(
                jnp.asarray(uu.T @ delta @ vv), jnp.asarray(uu.T @ (w_t - w_s) @ vv), basis.s
            )
            assert np.asarray(arb.suppress).any() and not np.asarray(arb.suppress)[p:, p:].any()
            ambient.append(uu @ np.asarray(arb.c_new) @ vv.T)
        np.testing.assert_allclose(ambient[1], ambient[0], atol=1e-10)
        # the transfer is equivariant: rotating the problem rotates the LoRA it returns
        o, r = _orthogonal(rng, n), _orthogonal(rng, m)
        fa, fb = merging.casa_matrix(jnp.asarray(delta), jnp.asarray(w_s), jnp.asarray(w_t), rank=4)
        ga, gb = merging.casa_matrix(
            jnp.asarray(o @ delta @ r), jnp.asarray(o @ w_s @ r), jnp.asarray(o @ w_t @ r), rank=4
        )
        np.testing.assert_allclose(np.asarray(ga @ gb), o @ np.asarray(fa @ fb) @ r, atol=1e-9)
    # the repository's rule (suppression over the whole full-SVD matrix) depends on the basis
    ref = [reference_casa(b.T, a.T, w_s.T, w_t.T, rank=4, complement=c)[0] for c in (None, q)]
    assert np.linalg.norm(ref[1] - ref[0]) > 1e-3 * np.linalg.norm(ref[0])
    ours = [
        reference_casa(b.T, a.T, w_s.T, w_t.T, rank=4, complement=c, pairs_only=True)[0]
        for c in (None, q)
    ]
    np.testing.assert_allclose(ours[1], ours[0], atol=1e-10)


def test_casa_is_the_identity_when_source_equals_target():
    w_s, _, a, b = clustered_problem(12, 12, seed=1)
    delta = jnp.asarray(a @ b, jnp.float32)
    w = jnp.asarray(w_s, jnp.float32)
    fa, fb = merging.casa_matrix(delta, w, w, rank=2)
    np.testing.assert_allclose(np.asarray(fa @ fb), np.asarray(delta), atol=1e-5)
    fa, fb = merging.casa_matrix(delta, w, w, rank=5, weight=2.0)
    np.testing.assert_allclose(np.asarray(fa @ fb), 2 * np.asarray(delta), atol=1e-5)


def test_casa_output_has_the_stated_rank():
    w_s, w_t, a, b = clustered_problem(12, 12, seed=2)
    args = (jnp.asarray(a @ b), jnp.asarray(w_s), jnp.asarray(w_t))
    for rank in (1, 6):
        fa, fb = merging.casa_matrix(*(x.astype(jnp.float32) for x in args), rank=rank)
        assert fa.shape == (12, rank) and fb.shape == (rank, 12)
        assert np.linalg.matrix_rank(np.asarray(fa @ fb, np.float64), tol=1e-5) == rank


def test_rotation_inside_a_degenerate_cluster_keeps_the_spectrum():
    w_s, _, a, b = clustered_problem(12, 12, seed=3)
    u, s, vt = np.linalg.svd(w_s)
    i = int(np.argmin(np.abs(np.diff(s[:8]))))  # the closest pair among the top k = 8
    theta = 0.3  # rotate the left singular vectors i and i+1 into each other
    rot = np.eye(12)
    c, t = np.cos(theta), np.sin(theta)
    rot[i : i + 2, i : i + 2] = [[c, -t], [t, c]]
    w_t = (u @ rot) @ np.diag(s) @ vt
    stats = merging.spectral_diagnostics(
        jnp.asarray(a @ b, jnp.float32),
        jnp.asarray(w_s, jnp.float32),
        jnp.asarray(w_t, jnp.float32),
    )
    assert float(stats["weight_drift"]) > 0.01
    assert float(stats["spectrum_drift"]) < 1e-5 < float(stats["weight_drift"])
    # all off-diagonal drift sits on the pair (i, i+1), whose gap is among the smallest
    np.testing.assert_allclose(float(stats["fft_near_degenerate_mass"]), 1.0, atol=1e-4)
    same = merging.spectral_diagnostics(
        jnp.asarray(a @ b, jnp.float32),
        jnp.asarray(w_s, jnp.float32),
        jnp.asarray(w_s, jnp.float32),
    )
    assert float(same["weight_drift"]) == 0.0 and float(same["spectrum_drift"]) < 1e-6


PARAMS = {"x": {"kernel": jnp.zeros((10, 8))}, "y": {"kernel": jnp.zeros((8, 8))}}


def _problem_trees():
    src, tgt = {}, {}
    for i, name in enumerate(PARAMS):
        n, m = PARAMS[name]["kernel"].shape
        w_s, w_t, _, _ = clustered_problem(n, m, seed=10 + i)
        src[name] = {"kernel": jnp.asarray(w_s, jnp.float32)}
        tgt[name] = {"kernel": jnp.asarray(w_t, jnp.float32)}
    ads = adapters.init(jax.random.key(0), src, [(r".*kernel", adapters.lora(rank=2, alpha=4.0))])
    ads = {
        p: ad.replace(factors={**ad.factors, "b": 0.2 * jnp.ones_like(ad.factors["b"])})
        for p, ad in ads.items()
    }
    return src, tgt, ads


def test_casa_over_pytrees_and_its_errors():
    src, tgt, ads = _problem_trees()
    moved = merging.casa(src, tgt, ads, rank=3)
    for path, ad in moved.items():
        name = path.split("/")[0]
        want = merging.casa_matrix(
            adapters.delta(ads[path], (ad.matrix)),
            src[name]["kernel"],
            tgt[name]["kernel"],
            rank=3,
        )
        assert ad.kind.rank == 3 and ad.kind.scale == 1.0
        np.testing.assert_allclose(
            np.asarray(adapters.delta(ad, ad.matrix)), np.asarray(want[0] @ want[1]), atol=1e-5
        )
    merged = adapters.fold(tgt, moved)  # loads on the target
    assert merged["x"]["kernel"].shape == (10, 8)
    same = merging.casa(src, src, ads, rank=2)
    for path, ad in same.items():
        np.testing.assert_allclose(
            np.asarray(adapters.delta(ad, ad.matrix)),
            np.asarray(adapters.delta(ads[path], ad.matrix)),
            atol=1e-5,
        )
    diag = casa_diagnostics(src, tgt, ads)
    assert set(diag) == set(ads) and 0.0 <= diag["x/kernel"]["high_fraction"] <= 1.0
    # mismatched trees: the message names the first differing path
    with pytest.raises(ValueError, match="'x/kernel'"):
        merging.casa(src, {"y": tgt["y"]}, ads, rank=2)
    with pytest.raises(ValueError, match="'x/kernel'"):
        merging.casa(src, {**tgt, "x": {"kernel": jnp.zeros((8, 10))}}, ads, rank=2)
    with pytest.raises(ValueError, match="'x/kernel'"):
        casa_diagnostics({"y": src["y"]}, {"y": tgt["y"]}, ads)
    with pytest.raises(ValueError, match="rank"):
        merging.casa(src, tgt, ads, rank=9)
    with pytest.raises(ValueError, match="arbitrate_q"):
        merging.casa(src, tgt, ads, rank=2, arbitrate_q=1.5)
