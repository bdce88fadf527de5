"""attention_logit_report: bias folding, the empirical max logit and the bounds vs float64 NumPy."""

import math

import jax
import numpy as np
import pytest

from lowrank_jax import fp8
from lowrank_jax.fp8.diagnostics import attention_logit_report, fold_attention_bias
from lowrank_jax.fp8.scale_rule import ScaleRule


def test_report_matches_float64_reference_and_worst_case_bound_holds():
    rng = np.random.default_rng(0)
    b, n, d, h, dh, g = 3, 10, 32, 4, 8, 1.3
    x = rng.standard_normal((b, n, d))
    x = g * math.sqrt(d) * x / np.linalg.norm(x, axis=-1, keepdims=True)  # ‖x‖ = g√d exactly
    wq, wk = (rng.standard_normal((d, h, dh)) / math.sqrt(d) for _ in range(2))
    bq, bk = (0.3 * rng.standard_normal((h, dh)) for _ in range(2))
    mask = np.ones((b, n), bool)
    mask[0, 7:] = False
    f32 = lambda a: np.asarray(a, np.float32)
    rep = attention_logit_report(
        f32(x),
        f32(wq),
        f32(wk),
        ScaleRule(seq_len=n, delta=1e-3),
        b_q=f32(bq),
        b_k=f32(bk),
        mask=mask,
        key=jax.random.key(0),
        norm_gain=g,
        num_iters=300,
    )
    q = np.einsum("bnd,dhk->bnhk", x, wq) + bq
    k = np.einsum("bnd,dhk->bnhk", x, wk) + bk
    s = np.einsum("bihk,bjhk->bhij", q, k) / math.sqrt(dh)
    pair = mask[:, None, :, None] & mask[:, None, None, :]
    np.testing.assert_allclose(
        np.asarray(rep.max_logit), np.where(pair, np.abs(s), 0).max(axis=(0, 2, 3)), rtol=1e-5
    )
    wq_aug = np.concatenate([wq, bq[None]], 0)
    wk_aug = np.concatenate([wk, bk[None]], 0)
    sigma = [np.linalg.svd(wq_aug[:, i] @ wk_aug[:, i].T, compute_uv=False)[0] for i in range(h)]
    np.testing.assert_allclose(np.asarray(rep.sigma), sigma, rtol=1e-4)
    # the deterministic bound holds for every token with ‖x‖ ≤ g√d, biases included
    assert np.all(np.asarray(rep.max_logit) <= np.asarray(rep.worst_case_bound) * (1 + 1e-5))
    gamma = fp8.chernoff_gamma(rank=dh, seq_len=n, delta=1e-3)
    ratio = fp8.rank_aware_tightness(d=d + 1, rank=dh, gamma=gamma)[1]  # folded: d + 1
    np.testing.assert_allclose(
        np.asarray(rep.rank_agnostic_bound / rep.rank_aware_bound), ratio, rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(rep.scale * rep.rank_aware_bound), fp8.fp8_max("e4m3"), rtol=1e-5
    )


def test_fold_attention_bias_shapes():
    w = np.zeros((5, 2, 3), np.float32)
    assert fold_attention_bias(w, np.ones((2, 3))).shape == (6, 2, 3)
    with pytest.raises(ValueError, match="H, d_h"):
        fold_attention_bias(w, np.ones((3,)))
