r"""P9: a Fano-type lower-bound instance for multitask thresholds, and its Bayes risk floor.

The theorem of P9 (Hanneke & Xu, arXiv 2601.20774) is proved by Fano's method on a packing of
instances that share the marginal and differ in the noise near the decision boundary. This
module simulates such a packing for thresholds on ``[0, 1]`` (a reconstruction: the paper's
instance is not public) and computes the risk that *no* algorithm can beat on it:

* ``M`` hypotheses ``j``, Bayes thresholds ``t_j = ½ + (j − (M−1)/2) δ``; outside the window
  ``|x − ½| ≤ r``, ``r = ((M−1)/2 + 1) δ``, every task has the target's
  ``η_0(x) = ½ + ½ sign(x − ½)|2x − 1|^a`` (``a = 1/β − 1``); inside it a good task (and the
  target) has the shifted profile ``η_j(x) = ½ + ½ sign(x − t_j)|2(x − t_j)|^a`` and a decoy has
  ``η = ½``: decoys carry no information about ``j`` at all, good tasks only through the window;
* the separation is tied to the oracle's resolution, ``δ = c (n (k + 1))^{−β/(2−β)}`` with ``k``
  good sources (:func:`packing_separation`; capped so that ``r ≤ ¼``), so each source alone carries a KL divergence of
  order ``1/(k + 1)`` about ``j``, independent of ``n``: the instance is rescaled with ``n``, as a
  lower-bound construction is, and every ratio it produces is ``n``-independent *by construction*;
* a draw picks ``j`` uniformly and a uniform random set of ``k`` good sources among ``N``.

The **risk floor** is the Bayes risk under that prior (:func:`packing_posterior` with the subset
unknown: the likelihood sums over all ``C(N, k)`` good sets by an elementary-symmetric-polynomial
recursion; the decision minimises the posterior expected excess risk exactly, by bisection on its
monotone derivative). Every algorithm that sees the same samples, whatever it knows about the
family, has an average excess risk over the prior at least this large, hence a worst-case one
too. The same posterior with the good set known is the oracle's floor; their ratio is the price
of not knowing which sources are good. Fano's inequality lower-bounds the former; here it is
computed exactly (Monte Carlo over draws).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrank_jax.analysis import multitask

__all__ = [
    "PACKING_ESTIMATORS",
    "bayes_threshold",
    "packing_centers",
    "packing_eta",
    "packing_excess_risk",
    "packing_posterior",
    "packing_separation",
    "sample_packing_tasks",
    "simulate_packing_family",
]

PACKING_ESTIMATORS = (*multitask.ESTIMATORS, "bayes_floor", "bayes_oracle")
_TINY = 1e-6  # η is clipped to [_TINY, 1 − _TINY] in likelihoods (β = 1 has η ∈ {0, 1})


def packing_separation(n: int, num_good: jax.typing.ArrayLike, *, c: float, beta: float):
    """``δ = c (n (k + 1))^{−β/(2−β)}``: the oracle's resolution with ``k`` good sources + target.

    Args:
      n: samples per task; num_good: ``k`` (may be traced); c: the constant; beta: Bernstein
        exponent in (0, 1].

    Returns:
      Scalar float32 ``δ``.

    Raises:
      ValueError: β outside (0, 1].
    """
    multitask._check_beta(beta)
    return c * (n * (jnp.asarray(num_good, jnp.float32) + 1)) ** (-beta / (2 - beta))


def packing_centers(
    delta: jax.typing.ArrayLike, num_hypotheses: int
) -> tuple[jax.Array, jax.Array]:
    """``(t (M,), r)``: the hypotheses' Bayes thresholds ``½ + (j − (M−1)/2) δ`` and the window
    half-width ``r = ((M−1)/2 + 1) δ``.

    Raises:
      ValueError: ``num_hypotheses < 2``.
    """
    if num_hypotheses < 2:
        raise ValueError(f"num_hypotheses={num_hypotheses}: a packing needs at least 2")
    half = (num_hypotheses - 1) / 2
    delta = jnp.asarray(delta, jnp.float32)
    return 0.5 + (jnp.arange(num_hypotheses) - half) * delta, (half + 1) * delta


def packing_eta(
    x: jax.typing.ArrayLike, center: jax.typing.ArrayLike, *, beta: float, window, good=True
) -> jax.Array:
    """``P(y = 1 | x)`` of a task of the packing: the target profile outside ``|x − ½| ≤ window``;
    inside it the profile shifted to ``center`` (good tasks) or ``½`` (decoys, ``good=False``).

    Args:
      x: points (any shape); center: the hypothesis' threshold ``t_j`` (broadcast with ``x``);
      beta: Bernstein exponent; window: ``r``; good: bool, broadcast with ``x``.

    Returns:
      ``η`` in ``[0, 1]``, the broadcast shape of ``x``, ``center`` and ``good``.
    """
    x, center = jnp.asarray(x), jnp.asarray(center)
    a = multitask._check_beta(beta)
    inside = jnp.abs(x - 0.5) <= window
    d = jnp.clip(2 * (x - center), -1.0, 1.0)
    shifted = 0.5 + 0.5 * jnp.sign(d) * jnp.abs(d) ** a
    eta = jnp.where(inside, jnp.where(good, shifted, 0.5), multitask.target_eta(x, beta=beta))
    return eta


def _g(u, a):  # ∫_0^|u| (2s)^a ds
    return (2 * jnp.abs(u)) ** (a + 1) / (2 * (a + 1))


def packing_excess_risk(
    t: jax.typing.ArrayLike, center: jax.typing.ArrayLike, *, beta: float, window
) -> jax.Array:
    """Excess target risk of ``h_t`` under the hypothesis with threshold ``center`` (closed form).

    ``∫`` of ``|2η − 1|`` between ``t`` and ``center``: ``G(u) = (2|u|)^{a+1} / (2(a+1))`` of the
    shifted profile inside the window, plus the target profile's share outside it.

    Returns:
      The broadcast shape of ``t`` and ``center``.
    """
    a = multitask._check_beta(beta)
    t, c = jnp.asarray(t), jnp.asarray(center)
    hi, lo = 0.5 + window, 0.5 - window
    right = _g(jnp.minimum(t, hi) - c, a) + jnp.where(t > hi, _g(t - 0.5, a) - _g(window, a), 0.0)
    left = _g(c - jnp.maximum(t, lo), a) + jnp.where(t < lo, _g(0.5 - t, a) - _g(window, a), 0.0)
    return jnp.where(t >= c, right, left)


def sample_packing_tasks(
    key: jax.Array, center: jax.typing.ArrayLike, good: jax.typing.ArrayLike, *, n: int,
    beta: float, window,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``n`` samples from each of ``T`` tasks of the hypothesis ``center``: ``x, y`` ``(T, n)``.

    Args:
      key: PRNG key; center: ``t_j``; good: bool ``(T,)`` (row 0 is usually the target);
      n: samples per task; beta: Bernstein exponent; window: ``r``.

    Returns:
      ``x`` float32 in ``[0, 1]`` and ``y`` float32 in ``{0, 1}``, both ``(T, n)``.
    """
    good = jnp.asarray(good, bool)
    kx, ky = jax.random.split(key)
    x = jax.random.uniform(kx, (good.shape[0], n))
    eta = packing_eta(x, center, beta=beta, window=window, good=good[:, None])
    return x, (jax.random.uniform(ky, x.shape) < eta).astype(jnp.float32)


def _log_lik_ratio(x, y, centers, beta, window):
    """``(T, M)``: log-likelihood of each task's window samples as a good task of hypothesis j,
    minus that as a decoy (outside the window both are the target's, so they cancel)."""
    eta = packing_eta(x[..., None], centers, beta=beta, window=window)  # (T, n, M)
    eta = jnp.clip(eta, _TINY, 1 - _TINY)
    yy = y[..., None]
    ll = yy * jnp.log(eta) + (1 - yy) * jnp.log1p(-eta) - jnp.log(0.5)
    inside = (jnp.abs(x - 0.5) <= window)[..., None]
    return jnp.sum(jnp.where(inside, ll, 0.0), axis=1)


def _log_elementary_symmetric(log_r: jax.Array) -> jax.Array:
    """``(N+1, M)``: ``log e_m(r_1..r_N)`` for ``m = 0..N`` from ``log_r`` ``(N, M)``."""
    n_src, m = log_r.shape
    init = jnp.full((n_src + 1, m), -jnp.inf).at[0].set(0.0)

    def step(e, lr):  # e_m <- e_m + r_i e_{m-1}
        shifted = jnp.concatenate([jnp.full((1, m), -jnp.inf), e[:-1] + lr[None]], axis=0)
        return jnp.logaddexp(e, shifted), None

    out, _ = jax.lax.scan(step, init, log_r)
    return out


def packing_posterior(
    x: jax.Array,
    y: jax.Array,
    centers: jax.Array,
    *,
    beta: float,
    window,
    num_good: jax.typing.ArrayLike | None = None,
    good: jax.Array | None = None,
) -> jax.Array:
    """Log posterior ``(M,)`` over the hypotheses (uniform prior) given every task's samples.

    Row 0 of ``x, y`` ``(T, n)`` is the target (always good). Pass ``num_good`` (the good set is
    a uniform random ``k``-subset of the ``T − 1`` sources, summed over exactly) or ``good``
    (bool ``(T,)``: the good set is known, the oracle).

    Args:
      x, y: ``(T, n)`` samples; centers: ``(M,)`` hypotheses; beta: Bernstein exponent;
      window: ``r``; num_good / good: as above.

    Returns:
      ``(M,)`` normalised log posterior.

    Raises:
      ValueError: neither or both of ``num_good`` and ``good``, or ``num_good`` outside
        ``[0, T - 1]``.
    """
    if (num_good is None) == (good is None):
        raise ValueError("pass exactly one of num_good (good set unknown) and good (known)")
    lr = _log_lik_ratio(x, y, centers, beta, window)  # (T, M)
    known = num_good is not None and not isinstance(num_good, jax.core.Tracer)
    if known and not 0 <= int(num_good) <= lr.shape[0] - 1:
        raise ValueError(
            f"num_good counts the good sources besides the target: it must lie in "
            f"[0, {lr.shape[0] - 1}] for {lr.shape[0]} tasks; got {num_good}."
        )
    if good is not None:
        logp = jnp.sum(jnp.where(jnp.asarray(good, bool)[:, None], lr, 0.0), axis=0)
    else:
        e = _log_elementary_symmetric(lr[1:])
        logp = lr[0] + jnp.take(e, jnp.asarray(num_good), axis=0)
    return logp - jax.nn.logsumexp(logp)


def bayes_threshold(
    log_post: jax.Array, centers: jax.Array, *, beta: float, num_iters: int = 60
) -> jax.Array:
    """The threshold minimising the posterior expected excess risk ``Σ_j p_j G(t − t_j)``.

    The minimiser lies in ``[t_0, t_{M−1}]``, where every term is ``G(|t − t_j|)`` and the
    derivative ``Σ_j p_j sign(t − t_j)|2(t − t_j)|^a`` is non-decreasing: bisection on it.

    Args:
      log_post: ``(M,)`` log posterior (:func:`packing_posterior`); centers: ``(M,)`` ascending
        ``t_j``; beta: Bernstein exponent; num_iters: bisection steps (60: float32 exact).

    Returns:
      The scalar Bayes threshold.
    """
    a = multitask._check_beta(beta)
    p = jnp.exp(log_post)

    def slope(t):
        d = t - centers
        return jnp.sum(p * jnp.sign(d) * jnp.abs(2 * d) ** a)

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        up = slope(mid) > 0
        return jnp.where(up, lo, mid), jnp.where(up, mid, hi)

    lo, hi = jax.lax.fori_loop(0, num_iters, body, (centers[0], centers[-1]))
    return 0.5 * (lo + hi)


def simulate_packing_family(
    key: jax.Array,
    *,
    num_tasks: int,
    n: int,
    num_good: jax.typing.ArrayLike,
    beta: float = 0.5,
    c: float = 1.0,
    num_hypotheses: int = 5,
    num_draws: int = 200,
    n_val: int = 20,
    agreement_z: float = 2.0,
    lepski_c: float = 1.0,
    batch_size: int = 8,
) -> jax.Array:
    """Excess target risks on the packing: ``(num_draws, len(PACKING_ESTIMATORS))``.

    Each draw picks ``j`` uniformly among ``num_hypotheses``, a random ``num_good``-subset of the
    ``num_tasks`` sources as good, samples ``n`` points per task and ``n_val`` target validation
    points, and scores the estimators of :func:`lowrank_jax.analysis.multitask.threshold_estimates`
    (in :data:`lowrank_jax.analysis.ESTIMATORS` order), then ``bayes_floor`` (the Bayes decision
    with the good set unknown, target validation samples included: the floor) and ``bayes_oracle``
    (good set known). ``num_good`` may be traced.

    Args:
      key: PRNG key; num_tasks: ``N`` sources; n: samples per task; num_good: ``k``; beta:
        Bernstein exponent; c: the separation constant (:func:`packing_separation`);
        num_hypotheses: ``M``; num_draws: Monte Carlo draws; n_val: target validation samples;
        agreement_z, lepski_c: the heuristics' constants; batch_size: draws per vmapped batch.

    Returns:
      float32 ``(num_draws, len(PACKING_ESTIMATORS))`` excess target risks.

    Raises:
      ValueError: ``num_tasks < 1``, ``n < 2``, ``num_draws < 1``, ``n_val < 1`` or a bad β.
    """
    if num_tasks < 1 or n < 2 or num_draws < 1 or n_val < 1:
        raise ValueError(
            f"need num_tasks >= 1, n >= 2, num_draws >= 1, n_val >= 1; got {num_tasks}, {n}, "
            f"{num_draws}, {n_val}"
        )
    half = (num_hypotheses - 1) / 2 + 1  # the window is ``half`` separations wide
    delta = jnp.minimum(packing_separation(n, num_good, c=c, beta=beta), 0.25 / half)
    centers, window = packing_centers(delta, num_hypotheses)  # window <= 1/4

    def one(k):
        kj, kp, ks, kv = jax.random.split(k, 4)
        j = jax.random.randint(kj, (), 0, num_hypotheses)
        perm = jax.random.permutation(kp, num_tasks)
        good = jnp.concatenate([jnp.ones((1,), bool), perm < num_good])
        x, y = sample_packing_tasks(ks, centers[j], good, n=n, beta=beta, window=window)
        xv, yv = sample_packing_tasks(
            kv, centers[j], jnp.ones((1,), bool), n=n_val, beta=beta, window=window
        )
        t = multitask.threshold_estimates(
            x, y, xv[0], yv[0], good, beta=beta, agreement_z=agreement_z, lepski_c=lepski_c
        )
        # The Bayes decisions see the same samples as validation_prefix: the target's n + n_val.
        pad = jnp.full((num_tasks + 1, n_val), 0.5)  # x = ½ ... masked out below
        xa = jnp.concatenate([x, pad.at[0].set(xv[0])], axis=1)
        ya = jnp.concatenate([y, jnp.zeros_like(pad).at[0].set(yv[0])], axis=1)
        mask = jnp.zeros((num_tasks + 1, n + n_val), bool).at[:, :n].set(True).at[0].set(True)
        xa = jnp.where(mask, xa, 2.0)  # outside the window: no likelihood contribution
        post = packing_posterior(xa, ya, centers, beta=beta, window=window, num_good=num_good)
        post_o = packing_posterior(xa, ya, centers, beta=beta, window=window, good=good)
        tb = jnp.stack([bayes_threshold(lp, centers, beta=beta) for lp in (post, post_o)])
        ts = jnp.concatenate([t, tb])
        return packing_excess_risk(ts, centers[j], beta=beta, window=window)

    keys = jax.random.split(key, num_draws)
    return jax.lax.map(one, keys, batch_size=min(batch_size, num_draws))
