r"""Threshold calibration by simulation from a fitted null model (specs §17: "calibrate C by
simulation"), and detectors run on streams simulated inside their scan.

**The model.** ``Y_t ~ Poisson(Λ e^{ε_t − σ²/2})`` independently over cells given a shared
stationary AR(1) log-factor ``ε_t = ρ ε_{t−1} + σ √(1−ρ²) z_t`` (``ε_t ~ N(0, σ²)``; ``σ = 0`` is
i.i.d. Poisson): the process of :func:`~lowrank_jax.changepoint.synthetic.sample_streams`.
:func:`fit_null_model` fits it to a training stretch: ``Λ̂`` is the training mean, ``σ̂`` and
``ρ̂`` come from the moments of the totals ``X_t = Σ_ij Y_t,ij`` (``M = Σ Λ``):
``Var X = M + M² (e^{σ²} − 1)`` and ``Cov(X_t, X_{t+1}) = M² (e^{ρσ²} − 1)``.

**Why simulate.** The block bootstrap (:mod:`~lowrank_jax.changepoint.calibration`) only
recombines the ``n`` training observations, so its ``(1−α)`` quantile of a maximum over ``T``
steps is right only when the stretch holds the per-step tail near ``α/T``: ``n (1−ρ)/(1+ρ) ≳ T/α``
(180,000 observations for ``T = 3,000``, ``ρ = 0.5``). Simulating from the fitted model draws
fresh observations, so the threshold needs no such stretch; it is as right as the model (its
false-alarm rate on a process outside the model's family is not controlled by construction).

**Cost.** Streams are never materialised: every chunk of observations is drawn inside the
detectors' ``lax.scan`` (all detectors see the same draws) and ``vmap`` maps over streams, so
memory does not grow with ``T``. Counts are drawn by inversion of the Poisson CDF over a fixed
number of terms ``K`` (``P(Y > K) < 10⁻¹⁰`` at the largest cell rate times ``e^{4σ}``): about
three times faster than ``jax.random.poisson`` on CPU for rates of a few events.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.changepoint import detectors as det
from lowrank_jax.changepoint import lowrank
from lowrank_jax.changepoint.calibration import Calibration, quantile_threshold

__all__ = [
    "NullModel",
    "calibrate_by_simulation",
    "check_model",
    "fit_null_model",
    "sample_counts",
    "simulate_scores",
]


U_MAX = 1.0 - 2.0**-20  # largest uniform of the Poisson inversion (see _poisson)


class NullModel(NamedTuple):
    """``Y_t ~ Poisson(rates · e^{ε_t − σ²/2})``, ``ε`` a stationary AR(1) (``rho``, ``sigma``)."""

    rates: np.ndarray
    rho: float = 0.0
    sigma: float = 0.0


def check_model(model: NullModel) -> NullModel:
    """Validates a :class:`NullModel` on the host; returns it with float64 rates."""
    rates = np.asarray(model.rates, np.float64)
    if rates.ndim != 2 or not np.all(np.isfinite(rates)) or np.any(rates < 0):
        raise ValueError("NullModel.rates must be a finite (p, L) array of cell means >= 0")
    if not -1 < model.rho < 1:
        raise ValueError(f"NullModel.rho={model.rho} is invalid: an AR(1) coefficient in (-1, 1)")
    if not model.sigma >= 0:
        raise ValueError(f"NullModel.sigma={model.sigma} is invalid: pass a log-sd >= 0")
    return NullModel(rates, float(model.rho), float(model.sigma))


def fit_null_model(train: jax.typing.ArrayLike) -> NullModel:
    """Fits :class:`NullModel` to a training stretch ``(n, p, L)`` by moments (module docstring);
    ``σ̂ = 0`` when the totals are not over-dispersed, ``ρ̂`` clipped to ``[0, 0.99]``."""
    y = lowrank.check_counts(train, name="train")
    if y.ndim != 3 or y.shape[0] < 3:
        raise ValueError(f"train must be (n >= 3, p, L) counts, got shape {y.shape}")
    x = y.sum((1, 2)).astype(np.float64)
    m = x.mean()
    if m <= 0:
        raise ValueError("train holds no events: cannot fit a rate")
    s2 = math.log1p(max(x.var() - m, 0.0) / m**2)
    rho = 0.0
    if s2 > 0:
        cov = np.mean((x[1:] - m) * (x[:-1] - m))
        rho = float(np.clip(math.log1p(max(cov, 0.0) / m**2) / s2, 0.0, 0.99))
    return NullModel(y.mean(0), rho, math.sqrt(s2))


def _num_terms(model: NullModel, rates_after: np.ndarray | None) -> int:
    top = float(
        model.rates.max() if rates_after is None else max(model.rates.max(), rates_after.max())
    )
    lam = max(top * math.exp(4 * model.sigma), 1e-3)
    k, term, tail = 0, math.exp(-lam), 1.0 - math.exp(-lam)
    while tail > 1e-10 and k < 10_000:
        k += 1
        term *= lam / k
        tail -= term
    return k + 1


def _poisson(key, lam, num_terms):
    """Poisson draws of rates ``lam`` by inversion over ``num_terms`` terms of the CDF.

    ``u`` stays below ``1 − 2⁻²⁰``: the float32 sum of the terms falls short of 1 by up to about
    2·10⁻⁷, and a larger ``u`` would count through all ``num_terms`` terms (a count of ``K`` in
    one cell in a few percent of streams of 3,000 × 900 draws). The cost: a draw beyond its
    ``1 − 2⁻²⁰`` quantile (about one per 10⁶ draws) takes that quantile's value."""
    return _invert(jax.random.uniform(key, lam.shape, maxval=U_MAX), lam, num_terms)


def _invert(u, lam, num_terms):
    """``min(Y, num_terms)`` for the Poisson(``lam``) quantile function at ``u``."""
    p = jnp.exp(-lam)

    def body(k, s):
        count, p, cdf = s
        p = p * lam / k
        return count + (u > cdf), p, cdf + p

    zero = jnp.zeros(lam.shape, jnp.int32)
    return jax.lax.fori_loop(1, num_terms + 1, body, (zero, p, p), unroll=8)[0]


def _scan_streams(per_chunk, init, key, model, after, tau, horizon, chunk, num_terms):
    """``lax.scan`` over chunks of one simulated stream: ``per_chunk(carry, y (chunk, p, L))``."""
    n_chunks = -(-horizon // chunk)
    rho, sigma = model.rho, model.sigma
    lag = np.arange(chunk)
    decay = jnp.asarray(np.tril(rho ** (lag[:, None] - lag[None]).clip(0)), jnp.float32)
    k0, key = jax.random.split(key)
    eps0 = sigma * jax.random.normal(k0)

    def step(carry, inp):
        inner, eps = carry
        k, c = inp
        kz, ku = jax.random.split(k)
        z = jax.random.normal(kz, (chunk,))
        e = rho ** (lag + 1.0) * eps + sigma * math.sqrt(1 - rho**2) * (decay @ z)
        t = c * chunk + 1 + lag
        lam = jnp.where((t > tau)[:, None, None], after, model.rates)
        y = _poisson(ku, lam * jnp.exp(e - sigma**2 / 2)[:, None, None], num_terms)
        inner, out = per_chunk(inner, y)
        return (inner, e[-1]), out

    xs = (jax.random.split(key, n_chunks), jnp.arange(n_chunks))
    return jax.lax.scan(step, (init, eps0), xs)[1]


def _train_mean(key, model, num_train):
    """Mean of a simulated training stretch of ``num_train`` observations: given the factor path,
    each cell's total is Poisson with the summed rate (drawn exactly, no stretch materialised)."""
    kz, k0, kp = jax.random.split(key, 3)
    rho, sigma = model.rho, model.sigma

    def ar(e, z):
        e = rho * e + sigma * math.sqrt(1 - rho**2) * z
        return e, jnp.exp(e - sigma**2 / 2)

    path = jax.lax.scan(ar, sigma * jax.random.normal(k0), jax.random.normal(kz, (num_train,)))
    total = jax.random.poisson(kp, model.rates * path[1].sum())
    return total.astype(jnp.float32) / num_train


@functools.partial(jax.jit, static_argnums=tuple(range(9)))
def _simulate(names, dets, refit, horizon, chunk, num_terms, num_train, rho, sigma, *arrays):
    rates, after, tau, keys = arrays
    model = NullModel(rates, rho, sigma)

    def one(key):
        kt, ks = jax.random.split(key)
        mean = _train_mean(kt, model, num_train) if refit else None
        ds = [refit[n](mean) if n in refit else d for n, d in zip(names, dets, strict=True)]

        def per_chunk(states, y):
            out = [d.update(s, y) for d, s in zip(ds, states, strict=True)]
            return tuple(o[0] for o in out), jnp.stack([o[1] for o in out])

        init = tuple(d.init() for d in ds)
        scores = _scan_streams(per_chunk, init, ks, model, after, tau, horizon, chunk, num_terms)
        return scores.transpose(1, 0, 2).reshape(len(ds), -1)[:, :horizon]

    return jax.vmap(one)(keys)


def simulate_scores(
    detectors: Mapping[str, det.Detector],
    model: NullModel,
    *,
    key: jax.Array,
    num_streams: int,
    horizon: int,
    tau: int | None = None,
    rates_after: jax.typing.ArrayLike | None = None,
    chunk: int = 16,
    batch: int = 50,
    refit: Mapping[str, Callable[[jax.Array], det.Detector]] | None = None,
    num_train: int | None = None,
) -> dict[str, np.ndarray]:
    """Scores ``(B, T)`` of every detector on the same ``B`` streams simulated from ``model``.

    Args:
      detectors: ``{name: Detector}``.
      model: the :class:`NullModel` of the streams.
      key: PRNG key (stream ``b`` of batch ``i`` uses its own fold of it).
      num_streams, horizon: ``B`` streams of ``T`` observations.
      tau, rates_after: a change: rates ``rates_after`` from time ``tau + 1`` on (None: no change).
      chunk: observations per scan step; batch: streams run at once.
      refit: ``{name: factory}``: stream ``b`` is monitored by ``factory(mean_b)``, ``mean_b`` the
        ``(p, L)`` mean of its own simulated training stretch of ``num_train`` observations
        (``jnp`` only: it is traced), so plug-in rates carry their estimation error.
      num_train: ``n`` of those stretches (required with ``refit``).
    """
    model = check_model(model)
    if num_streams < 1 or horizon < 1 or chunk < 1 or batch < 1:
        raise ValueError("num_streams, horizon, chunk and batch must be positive integers")
    after = model.rates if rates_after is None else np.asarray(rates_after, np.float64)
    if after.shape != model.rates.shape or np.any(after < 0):
        raise ValueError(f"rates_after must be a {model.rates.shape} array of rates >= 0")
    refit = dict(refit or {})
    if refit and not (isinstance(num_train, int) and num_train > 0):
        raise ValueError("refit needs num_train, the length of the simulated training stretches")
    names = tuple(detectors)
    num_terms = _num_terms(model, None if rates_after is None else after)
    change = horizon + 1 if tau is None else int(tau)
    static = (names, tuple(detectors.values()), _Frozen(refit), horizon, chunk, num_terms)
    static += (num_train or 0, model.rho, model.sigma)
    rates, after = jnp.asarray(model.rates, jnp.float32), jnp.asarray(after, jnp.float32)
    out = []
    for i in range(0, num_streams, batch):
        keys = jax.random.split(jax.random.fold_in(key, i), min(batch, num_streams - i))
        scores = _simulate(*static, rates, after, change, keys)
        out.append(np.asarray(scores))
    scores = np.concatenate(out)
    return {n: scores[:, j] for j, n in enumerate(names)}


def sample_counts(
    model: NullModel, *, key: jax.Array, num_streams: int, length: int, chunk: int = 16
) -> np.ndarray:
    """Count streams ``(B, T, p, L)`` drawn as :func:`simulate_scores` draws them (for checks)."""
    model = check_model(model)
    jmodel = NullModel(jnp.asarray(model.rates, jnp.float32), model.rho, model.sigma)
    num_terms = _num_terms(model, None)

    def one(k):
        ys = _scan_streams(
            lambda c, y: (c, y), (), k, jmodel, jmodel.rates, length + 1, length, chunk, num_terms
        )
        return ys.reshape(-1, *model.rates.shape)[:length]

    return np.asarray(jax.vmap(one)(jax.random.split(key, num_streams)))


def calibrate_by_simulation(
    detectors: Mapping[str, det.Detector],
    model: NullModel,
    *,
    key: jax.Array,
    alpha: float,
    horizon: int,
    num_streams: int = 500,
    **kw,
) -> dict[str, Calibration]:
    """Each detector's threshold: the ``(1−α)`` quantile of ``max_{t≤T} score_t`` over
    ``num_streams`` null streams simulated from ``model`` (fitted by :func:`fit_null_model`).
    Keywords ``chunk``, ``batch``, ``refit``, ``num_train``: as :func:`simulate_scores`."""
    scores = simulate_scores(
        detectors, model, key=key, num_streams=num_streams, horizon=horizon, **kw
    )
    return {
        n: Calibration(quantile_threshold(s.max(1), alpha), s.max(1)) for n, s in scores.items()
    }


class _Frozen(dict):
    """A hashable ``{name: factory}`` (a static argument of ``jit``)."""

    def __hash__(self):
        return hash(tuple(sorted((k, id(v)) for k, v in self.items())))

    def __eq__(self, other):
        return isinstance(other, _Frozen) and hash(self) == hash(other)
