"""LoRA-BO (P15): Gaussian-process Bayesian optimisation with Expected Improvement over a discrete
candidate set whose embedding may carry a learnable residual token.

The surrogate is a tinygp ``GaussianProcess`` (Matérn-5/2, ARD length scales, constant mean,
Gaussian noise) on an embedding ``z(c)`` of each candidate ``c``:

    z(c) = [ f(c) ; W_φ · r_θ(c) ],     r_θ(c) = Σ_t softmax_t(⟨h_t(c), e_θ⟩) h_t(c),

where ``f(c)`` (``(p,)``) are fixed features (hand-made knowledge, ordinal, one-hot, or a frozen
language model's sentence embedding of the configuration text) and ``r_θ`` is the *learnable
residual token*: a query ``e_θ`` (``(k,)``) that attends over the candidate's token states
``h_t(c)`` (``(t, k)``; e.g. the frozen MiniLM's last-layer states of the configuration's word
pieces, or one-hot value tokens), followed by the projection ``W_φ`` (``(k, q)``, initialised small, so
the residual starts nearly switched off). All of ``θ, φ`` and the kernel hyper-parameters are fitted
by maximising the log marginal likelihood of the observations (type-II maximum a posteriori: weak
Gaussian priors on the log-hyper-parameters and on ``θ, φ``), i.e. deep kernel learning (Wilson et
al. 2016) with a one-token readout as the deep part. The acquisition is Expected Improvement (for
maximisation)

    EI(c) = (μ(c) − y* − ξ) Φ(Z) + σ(c) φ(Z),   Z = (μ(c) − y* − ξ) / σ(c),

scored exhaustively over all not-yet-evaluated candidates.

References:
  P15 LoRA-BO: Baek, Lee, Kim, Oh, "Efficient Hyper-Parameter Search for LoRA via
  Language-aided Bayesian Optimization", arXiv 2602.11171 (ICML 2026). The paper's code is not
  released; this is the reconstruction of ``papers/specs.md`` §15: the token is read out *after*
  the frozen model (the spec's "cheaper variant": the token states are cached once, the learnable
  token attends over them) instead of being fed through the LLM; the deep-kernel projection acts
  on the token readout only while the fixed features enter through ARD length scales.
  Jones, Schonlau & Welch 1998 (EI); Wilson et al. 2016 (deep kernel learning);
  Hvarfner et al. 2024 (the dimension-scaled length-scale prior, as in BoTorch).

Example:
  >>> emb = CandidateEmbedding(features=jnp.asarray(feats))  # doctest: +SKIP
  >>> result = bayes_opt(scores, emb, key=jax.random.key(0), n_init=5, budget=30)  # doctest: +SKIP
  >>> result.best_so_far[-1]  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.scipy.stats import norm

from lowrank_jax.tuning import search
from lowrank_jax.tuning.search import SearchResult, search_result

__all__ = [
    "CandidateEmbedding",
    "bayes_opt",
    "embed",
    "expected_improvement",
    "fit_gp",
    "gp_neg_log_posterior",
    "gp_predict",
    "init_gp_params",
]

# Noise floor (standardised units) and the variance of padded observation slots.
_MIN_NOISE = 1e-4
_PAD_VARIANCE = 1e6


class CandidateEmbedding(NamedTuple):
    """The embedding inputs of ``c`` candidates.

    Attributes:
      features: ``(c, p)`` fixed features (standardise them per column, e.g. with
        :func:`lowrank_jax.tuning.standardize_features`).
      tokens: ``(c, t, k)`` token states read by the learnable residual token, or None (no
        residual).
      token_mask: ``(c, t)`` bool, True on real tokens (None: all real).
    """

    features: jax.Array
    tokens: jax.Array | None = None
    token_mask: jax.Array | None = None


def _check_embedding(embedding: CandidateEmbedding) -> int:
    if not isinstance(embedding, CandidateEmbedding):
        raise TypeError(f"expected a CandidateEmbedding, got {type(embedding).__name__}.")
    f = embedding.features
    if f.ndim != 2 or f.shape[0] < 1:
        raise ValueError(f"features must have shape (c, p) with c >= 1; got {f.shape}.")
    if not jnp.issubdtype(f.dtype, jnp.floating):
        raise TypeError(f"features must be floating point; got {f.dtype}.")
    if embedding.tokens is not None:
        t = embedding.tokens
        if t.ndim != 3 or t.shape[0] != f.shape[0]:
            raise ValueError(
                f"tokens must have shape (c, t, k) with c = {f.shape[0]} candidates; got {t.shape}."
            )
        m = embedding.token_mask
        if m is not None and m.shape != t.shape[:2]:
            raise ValueError(f"token_mask must have shape {t.shape[:2]}; got {m.shape}.")
    return f.shape[0]


def init_gp_params(
    embedding: CandidateEmbedding,
    *,
    residual_dim: int = 0,
    noise: float = 1e-2,
    key: jax.Array | None = None,
    proj_scale: float = 0.1,
) -> dict[str, jax.Array]:
    """Initial GP hyper-parameters (unconstrained) for ``embedding``.

    Args:
      embedding: the candidates' :class:`CandidateEmbedding`.
      residual_dim: ``q``, the output width of the learnable residual token (0: no residual; > 0
        needs ``embedding.tokens``).
      noise: initial noise variance in standardised units.
      key: PRNG key for the initial projection (needed with a residual).
      proj_scale: the initial projection is ``N(0, proj_scale²/k)`` entry-wise: small, so the
        residual starts nearly switched off, but not 0 (with a stationary kernel, ``proj = 0``
        is a stationary point of the marginal likelihood: every residual coordinate is equal).

    Returns:
      ``{"mean", "log_amp", "log_noise", "log_scale" (p + q,), "query" (k,), "proj" (k, q)}``
      (``query``/``proj`` only with a residual; ``query`` starts at 0: uniform attention). Length
      scales start at the prior's median ``exp(√2 + ½ log d)``.

    Raises:
      ValueError: ``residual_dim > 0`` without tokens or without a key, or negative.
    """
    _check_embedding(embedding)
    if not isinstance(residual_dim, int) or residual_dim < 0:
        raise ValueError(f"residual_dim must be an int >= 0; got {residual_dim!r}.")
    if residual_dim and embedding.tokens is None:
        raise ValueError("residual_dim > 0 needs embedding.tokens (the states the token reads).")
    if residual_dim and key is None:
        raise ValueError("residual_dim > 0 needs a PRNG key for the initial projection.")
    d = embedding.features.shape[1] + residual_dim
    params = {
        "mean": jnp.zeros(()),
        "log_amp": jnp.zeros(()),
        "log_noise": jnp.log(jnp.asarray(noise, jnp.float32)),
        "log_scale": jnp.full((d,), _scale_prior_mean(d), jnp.float32),
    }
    if residual_dim:
        k = embedding.tokens.shape[2]
        params["query"] = jnp.zeros((k,), jnp.float32)
        w = jax.random.normal(key, (k, residual_dim), jnp.float32)
        params["proj"] = w * (proj_scale / math.sqrt(k))
    return params


def _scale_prior_mean(d: int) -> float:
    return math.sqrt(2.0) + 0.5 * math.log(d)


def embed(params: dict[str, jax.Array], embedding: CandidateEmbedding, idx: jax.Array) -> jax.Array:
    """``z(c)`` for the candidates ``idx``: ``(len(idx), p + q)`` (see the module docstring)."""
    f = embedding.features[idx]
    if "proj" not in params:
        return f
    h = embedding.tokens[idx].astype(f.dtype)  # (n, t, k)
    logits = h @ params["query"]
    if embedding.token_mask is not None:
        logits = jnp.where(embedding.token_mask[idx], logits, -jnp.inf)
    readout = jnp.einsum("nt,ntk->nk", jax.nn.softmax(logits, axis=-1), h)
    return jnp.concatenate([f, readout @ params["proj"]], axis=-1)


def _gp(params, x, mask):
    import tinygp

    # tinygp's Matérn kernels default to the L1 distance (not positive definite in d > 1).
    matern = tinygp.kernels.Matern52(scale=1.0, distance=tinygp.kernels.distance.L2Distance())
    kernel = jnp.exp(params["log_amp"]) * matern
    noise = jnp.exp(params["log_noise"]) + _MIN_NOISE
    diag = jnp.where(mask, noise, _PAD_VARIANCE)
    return tinygp.GaussianProcess(
        kernel, x * jnp.exp(-params["log_scale"]), diag=diag, mean=params["mean"]
    )


def _standardize(y, mask):
    n = jnp.maximum(mask.sum(), 1)
    mu = jnp.where(mask, y, 0.0).sum() / n
    var = jnp.where(mask, (y - mu) ** 2, 0.0).sum() / n
    sd = jnp.where(var > 1e-12, jnp.sqrt(var), 1.0)
    return jnp.where(mask, (y - mu) / sd, 0.0), mu, sd


def gp_neg_log_posterior(
    params: dict[str, jax.Array],
    embedding: CandidateEmbedding,
    idx: jax.Array,
    y: jax.Array,
    mask: jax.Array,
) -> jax.Array:
    """Negative log marginal likelihood plus negative log prior (type-II MAP objective).

    ``y`` is standardised over the observed slots; slots with ``mask`` False are padding (they
    get variance 1e6 and value 0, so that one compiled function serves every number of
    observations: they change the likelihood by a parameter-independent constant up to O(1e-6)).

    Priors (Gaussian, on unconstrained values): ``log ℓ_j ~ N(√2 + ½ log d, √3²)`` (Hvarfner et al.
    2024), ``log amp ~ N(0, 1)``, ``log noise ~ N(log 1e-2, 2²)``, ``mean ~ N(0, 1)``,
    ``query, proj ~ N(0, 1)`` entry-wise.

    Args:
      params: from :func:`init_gp_params`.
      embedding: the candidates.
      idx: ``(n,)`` int indices of the observed candidates (padding slots: any valid index).
      y: ``(n,)`` observed values.
      mask: ``(n,)`` bool, True on real observations.

    Returns:
      Scalar objective (to minimise).
    """
    ys, _, _ = _standardize(y, mask)
    x = embed(params, embedding, idx)
    d = x.shape[1]
    nll = -_gp(params, x, mask).log_probability(ys)
    mu_s = _scale_prior_mean(d)
    prior = 0.5 * jnp.sum((params["log_scale"] - mu_s) ** 2) / 3.0
    prior += 0.5 * params["log_amp"] ** 2 + 0.5 * params["mean"] ** 2
    prior += 0.5 * ((params["log_noise"] - math.log(1e-2)) / 2.0) ** 2
    if "proj" in params:
        prior += 0.5 * jnp.sum(params["query"] ** 2) + 0.5 * jnp.sum(params["proj"] ** 2)
    # The padded slots' log-determinant is a constant; remove it so values are comparable.
    pad_const = 0.5 * (mask.size - mask.sum()) * (math.log(2 * math.pi) + math.log(_PAD_VARIANCE))
    return nll + prior - pad_const


@functools.partial(jax.jit, static_argnames=("steps", "learning_rate"))
def fit_gp(
    params: dict[str, jax.Array],
    embedding: CandidateEmbedding,
    idx: jax.Array,
    y: jax.Array,
    mask: jax.Array,
    *,
    steps: int = 200,
    learning_rate: float = 0.05,
) -> dict[str, jax.Array]:
    """Fits the hyper-parameters (and the residual token) by ``steps`` Adam steps on
    :func:`gp_neg_log_posterior`, starting from ``params``. Shapes as there."""
    tx = optax.adam(learning_rate)
    loss = functools.partial(gp_neg_log_posterior, embedding=embedding, idx=idx, y=y, mask=mask)

    def body(carry, _):
        p, s = carry
        g = jax.grad(loss)(p)
        g = jax.tree.map(lambda a: jnp.where(jnp.isfinite(a), a, 0.0), g)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=steps)
    return params


@jax.jit
def gp_predict(
    params: dict[str, jax.Array],
    embedding: CandidateEmbedding,
    idx: jax.Array,
    y: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Posterior mean and variance of the latent function at every candidate, in ``y``'s units.

    Args: as :func:`gp_neg_log_posterior`.

    Returns:
      ``(mean, var)``, each ``(c,)``: the tinygp posterior of the noise-free function
      ``f(z(c))`` given the observations (its variance includes tinygp's sqrt(eps) jitter).
    """
    ys, mu, sd = _standardize(y, mask)
    gp = _gp(params, embed(params, embedding, idx), mask)
    c = embedding.features.shape[0]
    z_all = embed(params, embedding, jnp.arange(c)) * jnp.exp(-params["log_scale"])

    def one(z):
        m, v = gp.predict(ys, z[None], return_var=True)
        return m[0], v[0]

    m, v = jax.lax.map(one, z_all, batch_size=256)
    return mu + sd * m, sd**2 * v


def expected_improvement(
    mean: jax.typing.ArrayLike,
    std: jax.typing.ArrayLike,
    best: jax.typing.ArrayLike,
    *,
    xi: float = 0.0,
) -> jax.Array:
    """Expected Improvement for maximisation, ``E[max(f − best − ξ, 0)]`` under ``f ~ N(mean, std²)``.

    ``EI = (μ − y* − ξ) Φ(Z) + σ φ(Z)`` with ``Z = (μ − y* − ξ)/σ``; where ``σ = 0`` it is
    ``max(μ − y* − ξ, 0)``.

    Args:
      mean: ``(c,)`` posterior means.
      std: ``(c,)`` posterior standard deviations (>= 0).
      best: the incumbent ``y*`` (scalar).
      xi: exploration margin ``ξ >= 0``.

    Returns:
      ``(c,)`` EI values (>= 0).

    Raises:
      ValueError: ``xi < 0``.
    """
    if xi < 0:
        raise ValueError(f"xi must be >= 0; got {xi}.")
    mean, std = jnp.asarray(mean), jnp.asarray(std)
    diff = mean - best - xi
    safe = jnp.where(std > 0, std, 1.0)
    z = diff / safe
    ei = diff * norm.cdf(z) + safe * norm.pdf(z)
    return jnp.where(std > 0, jnp.maximum(ei, 0.0), jnp.maximum(diff, 0.0))


def bayes_opt(
    objective: Any,
    embedding: CandidateEmbedding,
    *,
    key: jax.Array,
    n_init: int = 5,
    budget: int = 30,
    residual_dim: int = 0,
    fit_steps: int = 200,
    learning_rate: float = 0.05,
    xi: float = 0.01,
    warm_start: bool = True,
) -> SearchResult:
    """Maximises ``objective`` over the candidates by GP-EI (see the module docstring).

    ``n_init`` candidates are drawn uniformly without replacement; then, ``budget - n_init`` times:
    fit the GP (type-II MAP, :func:`fit_gp`), score EI (in standardised units, ``ξ = xi``) at every
    unevaluated candidate, evaluate the argmax. Each candidate is evaluated at most once.

    Args:
      objective: ``(c,)`` table of scores (a precomputed grid) or ``f(index) -> float``.
      embedding: the candidates' :class:`CandidateEmbedding`.
      key: PRNG key (initial design and the residual's initial projection).
      n_init: random initial evaluations.
      budget: total evaluations (initial ones included).
      residual_dim: width ``q`` of the learnable residual token (0: none).
      fit_steps, learning_rate: Adam steps and rate of each hyper-parameter fit.
      xi: EI margin in standardised units.
      warm_start: start each fit from the previous fit's parameters (else from the initial ones).

    Returns:
      :class:`~lowrank_jax.tuning.search.SearchResult` with ``budget`` evaluations.

    Raises:
      ValueError or TypeError: a bad embedding, table, or budget.
    """
    c = _check_embedding(embedding)
    f = search.score_function(objective, c)
    search.check_budget(n_init, budget, c)
    k_design, k_proj = jax.random.split(key)
    params0 = init_gp_params(embedding, residual_dim=residual_dim, key=k_proj)
    params = params0
    first = np.asarray(jax.random.choice(k_design, c, (n_init,), replace=False))
    idx = np.zeros(budget, np.int32)
    y = np.zeros(budget, np.float32)
    mask = np.zeros(budget, bool)
    for t, i in enumerate(first):
        idx[t], y[t], mask[t] = i, f(i), True
    for t in range(n_init, budget):
        args = (jnp.asarray(idx), jnp.asarray(y), jnp.asarray(mask))
        start = params if warm_start else params0
        params = fit_gp(start, embedding, *args, steps=fit_steps, learning_rate=learning_rate)
        mean, var = gp_predict(params, embedding, *args)
        sd = float(np.std(y[:t])) or 1.0
        ei = np.array(
            expected_improvement(
                mean / sd, jnp.sqrt(jnp.maximum(var, 0.0)) / sd, y[:t].max() / sd, xi=xi
            )
        )
        ei[idx[:t]] = -np.inf
        if not np.isfinite(ei).any():  # a failed fit: fall back to the best posterior mean
            ei = np.array(mean, np.float64)
            ei[idx[:t]] = -np.inf
        i = int(np.argmax(ei))
        idx[t], y[t], mask[t] = i, f(i), True
    return search_result(idx.copy(), y.astype(np.float64))
