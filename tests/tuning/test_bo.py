"""LoRA-BO (P15): EI against its definition, the tinygp posterior against a float64 NumPy GP,
BO against random search on a synthetic discrete function, baselines, and input errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import stats as sps

from lowrank_jax import tuning
from lowrank_jax.tuning import bo
from lowrank_jax.tuning.bo import (
    embed,
    expected_improvement,
    fit_gp,
    gp_neg_log_posterior,
    gp_predict,
    init_gp_params,
)
from lowrank_jax.tuning.search import tpe_search


def test_expected_improvement_equals_closed_form_scipy_and_the_integral():
    mean = np.array([0.3, -1.0, 2.0, 0.5, 0.1])
    std = np.array([0.5, 2.0, 0.1, 1e-3, 0.0])
    best, xi = 0.4, 0.05
    ei = np.asarray(expected_improvement(mean, std, best, xi=xi), np.float64)
    d = mean - best - xi
    with np.errstate(divide="ignore", invalid="ignore"):
        z = d / std
        ref = np.where(std > 0, d * sps.norm.cdf(z) + std * sps.norm.pdf(z), np.maximum(d, 0))
    np.testing.assert_allclose(ei, ref, rtol=1e-5, atol=1e-7)
    # The definition E[max(f - best - xi, 0)], f ~ N(mean, std^2), by quadrature.
    for m, s, e in zip(mean[:3], std[:3], ei[:3], strict=True):
        val, _ = integrate.quad(
            lambda f, m=m, s=s: max(f - best - xi, 0.0) * sps.norm.pdf(f, m, s), m - 12 * s, m + 12 * s,
            points=[best + xi],
        )  # fmt: skip
        assert e == pytest.approx(val, rel=1e-4, abs=1e-7)
    assert ei[-1] == pytest.approx(0.0)  # std = 0, mean below the incumbent
    with pytest.raises(ValueError, match="xi must be >= 0"):
        expected_improvement(mean, std, best, xi=-0.1)


def _matern52(x1, x2):
    r = np.sqrt(((x1[:, None, :] - x2[None, :, :]) ** 2).sum(-1))
    return (1 + np.sqrt(5) * r + 5 * r**2 / 3) * np.exp(-np.sqrt(5) * r)


def _numpy_gp(params, f, idx, y):
    """Float64 GP posterior and log marginal likelihood after the same standardisation."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = f / np.exp(p["log_scale"])
    mu, sd = y.mean(), y.std()
    ys = (y - mu) / sd
    amp, noise = np.exp(p["log_amp"]), np.exp(p["log_noise"]) + 1e-4
    k = amp * _matern52(x[idx], x[idx]) + noise * np.eye(len(idx))
    ks = amp * _matern52(x, x[idx])
    r = ys - p["mean"]
    m = p["mean"] + ks @ np.linalg.solve(k, r)
    jitter = np.sqrt(np.finfo(np.float32).eps)
    v = amp + jitter - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T))
    _, logdet = np.linalg.slogdet(k)
    lml = -0.5 * r @ np.linalg.solve(k, r) - 0.5 * logdet - 0.5 * len(idx) * np.log(2 * np.pi)
    return mu + sd * m, sd**2 * v, lml


def _params():
    return {
        "mean": jnp.asarray(0.2),
        "log_amp": jnp.asarray(0.3),
        "log_noise": jnp.asarray(np.log(0.05), jnp.float32),
        "log_scale": jnp.asarray([0.1, -0.2, 0.4], jnp.float32),
    }


def test_gp_posterior_and_likelihood_with_padding_match_float64_numpy():
    rng = np.random.default_rng(0)
    f = rng.normal(size=(12, 3))
    idx = np.array([0, 3, 5, 7, 10])
    y = np.sin(f[idx, 0]) + f[idx, 1]
    emb = tuning.CandidateEmbedding(jnp.asarray(f, jnp.float32))
    params = _params()
    ref_m, ref_v, ref_lml = _numpy_gp(params, f, idx, y)
    for pad in (3,):  # padded slots: one compiled shape for every number of observations
        i = jnp.asarray(np.r_[idx, np.zeros(pad, int)])
        yy = jnp.asarray(np.r_[y, np.zeros(pad)], jnp.float32)
        mask = jnp.asarray(np.r_[np.ones(len(idx)), np.zeros(pad)] > 0)
        m, v = gp_predict(params, emb, i, yy, mask)
        np.testing.assert_allclose(m, ref_m, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(v, ref_v, rtol=1e-3, atol=2e-4)
        nlp = float(gp_neg_log_posterior(params, emb, i, yy, mask))
        d = 3
        prior = (
            0.5
            * np.sum((np.asarray(params["log_scale"]) - (np.sqrt(2) + 0.5 * np.log(d))) ** 2)
            / 3
        )
        prior += 0.5 * 0.3**2 + 0.5 * 0.2**2 + 0.5 * ((np.log(0.05) - np.log(1e-2)) / 2) ** 2
        assert nlp == pytest.approx(-ref_lml + prior, abs=2e-3), pad
    # Observed points: the posterior mean interpolates up to the noise.
    assert np.max(np.abs(np.asarray(m)[idx] - y)) < 0.3


def test_residual_token_starts_off_and_is_fitted_by_the_marginal_likelihood():
    rng = np.random.default_rng(1)
    c, t, k = 40, 3, 5
    tokens = rng.normal(size=(c, t, k)).astype(np.float32)
    mask = np.ones((c, t), bool)
    mask[:, -1] = rng.random(c) < 0.5
    emb = tuning.CandidateEmbedding(jnp.asarray(rng.normal(size=(c, 2)), jnp.float32),
                                    jnp.asarray(tokens), jnp.asarray(mask))  # fmt: skip
    p0 = init_gp_params(emb, residual_dim=2, key=jax.random.key(0))
    z = embed(p0, emb, jnp.arange(c))
    assert z.shape == (c, 4) and 0 < np.abs(np.asarray(z[:, 2:])).max() < 0.5
    # A target that depends on the token states only: the fit must move proj and raise the evidence.
    y = tokens[:, 0, 0] * 2.0
    idx = jnp.arange(20)
    args = (emb, idx, jnp.asarray(y[:20]), jnp.ones(20, bool))
    p = fit_gp(p0, *args, steps=150)
    assert float(gp_neg_log_posterior(p, *args)) < float(gp_neg_log_posterior(p0, *args)) - 1.0
    assert float(jnp.abs(p["proj"]).max()) > 2 * float(jnp.abs(p0["proj"]).max())
    # The readout is the masked attention average of the token states.
    q = jnp.asarray(rng.normal(size=k), jnp.float32)
    pq = {**p, "query": q, "proj": jnp.eye(k, 2)}
    logits = np.where(mask, tokens @ np.asarray(q), -np.inf)
    w = np.exp(logits - logits.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    ref = np.einsum("ct,ctk->ck", w, tokens)[:, :2]
    np.testing.assert_allclose(embed(pq, emb, jnp.arange(c))[:, 2:], ref, atol=1e-5)


def _synthetic():
    g = np.stack(np.meshgrid(*[np.arange(s) for s in (7, 6, 5)], indexing="ij"), -1).reshape(-1, 3)
    f = -((g[:, 0] - 4.3) ** 2) / 6 - (g[:, 1] - 1.7) ** 2 / 4 - 0.2 * (g[:, 2] - 2) ** 2
    return g, f


def test_bo_beats_random_search_on_a_discrete_function_in_expectation_over_seeds():
    axes = [np.linspace(0, 1, s) for s in (8, 8, 6)]
    g = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    f = -(4 * (g[:, 0] - 0.7) ** 2 + 3 * (g[:, 1] - 0.3) ** 2 + (g[:, 2] - 0.5) ** 2)
    emb = tuning.CandidateEmbedding(jnp.asarray(tuning.standardize_features(g)))
    bo_regret, rs_regret = [], []
    for seed in range(4):
        key = jax.random.key(seed)
        r = tuning.bayes_opt(f, emb, key=key, n_init=5, budget=16, fit_steps=100)
        assert len(set(r.points.tolist())) == 16  # each candidate at most once
        np.testing.assert_allclose(r.values, f[r.points])
        bo_regret.append(tuning.simple_regret(r, f.max())[-1])
        rs = tuning.random_search(f, len(f), key=key, budget=16)
        rs_regret.append(tuning.simple_regret(rs, f.max())[-1])
    # Loose but failable: BO's mean regret at most half of random search's.
    assert np.mean(bo_regret) * 2 < np.mean(rs_regret), (bo_regret, rs_regret)


def test_random_and_tpe_searches_follow_the_table():
    pytest.importorskip("optuna")
    g, f = _synthetic()
    r = tuning.random_search(f, len(f), key=jax.random.key(0), budget=10)
    assert len(set(r.points.tolist())) == 10
    np.testing.assert_allclose(r.best_so_far, np.maximum.accumulate(f[r.points]))
    t = tpe_search(f, (7, 6, 5), seed=0, budget=12, n_init=4)
    np.testing.assert_allclose(t.values, f[t.points])
    assert t.points.shape == (12,)
    assert tpe_search(f, (7, 6, 5), seed=0, budget=12, n_init=4).points.tolist() == (
        t.points.tolist()
    )


def test_bad_inputs_raise_clear_errors():
    g, f = _synthetic()
    emb = tuning.CandidateEmbedding(jnp.asarray(g, jnp.float32))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"\(c,\) = \(210,\) table"):
        tuning.bayes_opt(f[:-1], emb, key=key)
    with pytest.raises(ValueError, match="NaN/inf"):
        tuning.random_search(np.r_[f[:-1], np.nan], len(f), key=key)
    with pytest.raises(ValueError, match="exceeds the 210 candidates"):
        tuning.bayes_opt(f, emb, key=key, budget=300)
    with pytest.raises(ValueError, match="n_init <= budget"):
        tuning.bayes_opt(f, emb, key=key, n_init=10, budget=5)
    with pytest.raises(ValueError, match="needs embedding.tokens"):
        init_gp_params(emb, residual_dim=2, key=key)
    with pytest.raises(ValueError, match=r"tokens must have shape \(c, t, k\)"):
        init_gp_params(tuning.CandidateEmbedding(emb.features, jnp.zeros((3, 2, 2))))
    with pytest.raises(TypeError, match="floating point"):
        init_gp_params(tuning.CandidateEmbedding(jnp.asarray(g)))
    with pytest.raises(TypeError, match="CandidateEmbedding"):
        bo.init_gp_params(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="grid shape"):
        tpe_search(f, (), seed=0)
