r"""Tail-aware objectives for fine-tuning a generative model (P16, TFFT): CVaR and its KL dual.

For a reward ``r(x)``, a tail level ``β ∈ (0, 1)`` and a KL weight ``α > 0``, TFFT maximises
``CVaR_β(r) − α·KL(p‖p_pre)`` over models ``p`` in two stages (specs.md §16):

1. **Threshold** (one dimension, convex): by the Rockafellar–Uryasev dual and the closed form of a
   KL tilt, the problem's value is ``Φ(η*)`` with

   * right tail (discovery):   ``Φ_R(η) = η + α·log E_pre[exp((r − η)₊ / (αβ))]``, ``η* = argmin``;
   * left tail (reliability):  ``Φ_L(η) = η + α·log E_pre[exp(−(η − r)₊ / (αβ))]``, ``η* = argmax``,

   estimated from samples of the pre-trained model (:func:`cvar_threshold`, bisection on the
   monotone derivative).
2. **One KL-regularised fine-tune** towards ``p* ∝ p_pre · exp(r̃/α)`` with the pseudo-reward
   ``r̃_R = (r − η*)₊/β`` or ``r̃_L = −(η* − r)₊/β`` (:func:`pseudo_reward`). Expected-reward
   fine-tuning is the same tilt with ``r̃ = r``.

:func:`tilt_weights` gives the self-normalised importance weights of ``p*`` on pre-trained samples
(what resampling-based fine-tuning trains on) and :func:`tilt_kl` the KL of that target, so the
KL weight of every method can be chosen to reach the same KL (:func:`alpha_for_kl`; with the
pseudo-reward at that weight: :func:`tilt_for_kl`) before anything is trained. :func:`cvar` is the
exact (weighted) empirical CVaR.

Reference: Wang, De Santi, Mo, Zavlanos, Krause, Johansson, "Efficient Tail-Aware Generative
Optimization via Flow Model Fine-Tuning", arXiv 2602.16796 (2026); Rockafellar & Uryasev (2000).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

__all__ = [
    "TAILS",
    "alpha_for_kl",
    "cvar",
    "cvar_dual_objective",
    "cvar_threshold",
    "pseudo_reward",
    "quantile_pseudo_reward",
    "reward_log_tilt",
    "tilt_for_kl",
    "tilt_kl",
    "tilt_weights",
]

TAILS = ("left", "right")


def _check(beta: float, tail: str) -> None:
    if tail not in TAILS:
        raise ValueError(
            f"tail={tail!r} is invalid: use 'left' (reliability) or 'right' (discovery)"
        )
    if not 0.0 < float(beta) < 1.0:
        raise ValueError(f"beta={beta} is invalid: the tail level must lie in (0, 1), e.g. 0.1")


def _log_weights(n: int, weights: jax.Array | None, dtype) -> jax.Array:
    if weights is None:
        return jnp.full((n,), -math.log(n), dtype)
    w = jnp.asarray(weights, dtype)
    return jnp.log(w / jnp.sum(w))


def cvar(r: jax.Array, *, beta: float, tail: str, weights: jax.Array | None = None) -> jax.Array:
    r"""The conditional value at risk of the (weighted) empirical law of ``r``: the mean of its
    lowest (``tail="left"``) or highest (``"right"``) ``β`` of probability mass.

    Exact for a discrete law, atoms split at the boundary: with the values sorted into the tail
    first and ``c_i`` their cumulative probability, ``CVaR = β⁻¹ Σ_i r_i·clip(β − c_{i−1}, 0, p_i)``.
    This equals the Rockafellar–Uryasev forms ``min_η η + β⁻¹E(r−η)₊`` (right) and
    ``max_η η − β⁻¹E(η−r)₊`` (left).

    Args:
      r: ``(n,)`` rewards.
      beta: tail mass in (0, 1).
      tail: ``"left"`` or ``"right"``.
      weights: ``(n,)`` non-negative probabilities (normalised here); ``None`` = uniform.
    """
    _check(beta, tail)
    r = jnp.asarray(r)
    p = jnp.exp(_log_weights(r.shape[0], weights, r.dtype))
    order = jnp.argsort(r) if tail == "left" else jnp.argsort(-r)
    rs, ps = r[order], p[order]
    before = jnp.cumsum(ps) - ps
    take = jnp.clip(beta - before, 0.0, ps)
    return jnp.sum(rs * take) / beta


def cvar_dual_objective(
    eta: jax.Array,
    r: jax.Array,
    *,
    beta: float,
    alpha: float,
    tail: str,
    weights: jax.Array | None = None,
) -> jax.Array:
    r"""``Φ(η)``: the value of ``max_p CVaR-term(η) − α·KL(p‖p_pre)`` at a fixed threshold ``η``.

    ``Φ_R(η) = η + α·log E[exp((r − η)₊/(αβ))]`` (convex; the right-CVaR problem's value is its
    minimum) and ``Φ_L(η) = η + α·log E[exp(−(η − r)₊/(αβ))]`` (concave; the left value is its
    maximum), the expectation over the pre-trained law (samples ``r`` with ``weights``).
    """
    _check(beta, tail)
    r = jnp.asarray(r)
    logw = _log_weights(r.shape[0], weights, r.dtype)
    excess = jnp.maximum(r - eta, 0.0) if tail == "right" else -jnp.maximum(eta - r, 0.0)
    return eta + alpha * logsumexp(logw + excess / (alpha * beta))


def cvar_threshold(
    r: jax.Array,
    *,
    beta: float,
    alpha: float,
    tail: str,
    weights: jax.Array | None = None,
    iterations: int = 100,
) -> jax.Array:
    r"""``η*``, the optimal threshold of TFFT's stage 1, by bisection on ``Φ'(η)``.

    ``Φ_R'(η) = 1 − β⁻¹·P̃(r > η)`` and ``Φ_L'(η) = 1 − β⁻¹·P̃(r < η)``, with ``P̃`` the
    pre-trained law tilted by ``exp(±(·)₊/(αβ))``; ``Φ_R'`` increases and ``Φ_L'`` decreases in
    ``η``, from ``1 − 1/β < 0`` to ``1`` (right) and back (left), so the root lies in
    ``[min r, max r]``. ``iterations`` halvings of that bracket (100: float precision); jitted
    once per ``(tail, iterations)`` and shape, so a search over ``α`` does not recompile.
    """
    _check(beta, tail)
    if not float(alpha) > 0:
        raise ValueError(f"alpha={alpha} is invalid: the KL weight must be > 0")
    r = jnp.asarray(r)
    logw = _log_weights(r.shape[0], weights, r.dtype)
    return _threshold(r, logw, beta, alpha, tail=tail, iterations=iterations)


@functools.partial(jax.jit, static_argnames=("tail", "iterations"))
def _threshold(r, logw, beta, alpha, *, tail, iterations):
    def slope(eta):
        if tail == "right":
            logp = logw + jnp.maximum(r - eta, 0.0) / (alpha * beta)
            inside = r > eta
        else:
            logp = logw - jnp.maximum(eta - r, 0.0) / (alpha * beta)
            inside = r < eta
        mass = jnp.exp(logsumexp(jnp.where(inside, logp, -jnp.inf)) - logsumexp(logp))
        return 1.0 - mass / beta

    def body(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        go_up = slope(mid) < 0 if tail == "right" else slope(mid) > 0
        return jnp.where(go_up, mid, lo), jnp.where(go_up, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iterations, body, (jnp.min(r), jnp.max(r)))
    return 0.5 * (lo + hi)


def pseudo_reward(r: jax.Array, eta: jax.Array, *, beta: float, tail: str) -> jax.Array:
    r"""TFFT's pseudo-reward: ``(r − η)₊/β`` (right) or ``−(η − r)₊/β`` (left; flat above ``η``,
    so only the failures are pushed up)."""
    _check(beta, tail)
    if tail == "right":
        return jnp.maximum(r - eta, 0.0) / beta
    return -jnp.maximum(eta - r, 0.0) / beta


@dataclasses.dataclass(frozen=True)
class _LogTilt:
    reward: Callable[[jax.Array], jax.Array]
    beta: float
    tail: str | None

    def __call__(self, x: jax.Array, args: dict[str, jax.Array]) -> jax.Array:
        r = self.reward(x)
        if self.tail is not None:
            r = pseudo_reward(r, args["eta"], beta=self.beta, tail=self.tail)
        return r / args["alpha"]


def reward_log_tilt(
    reward: Callable[[jax.Array], jax.Array], *, beta: float, tail: str | None
) -> Callable[[jax.Array, dict[str, jax.Array]], jax.Array]:
    r"""The log-tilt ``f(x) = r̃(x)/α`` of a method, as
    :func:`lowrank_jax.generative.train_adjoint_matching` takes it: ``(x (b, D), {"eta", "alpha"})
    -> (b,)`` with ``r̃`` = :func:`pseudo_reward` of ``reward(x)`` at ``η`` (``tail="left"`` or
    ``"right"``, TFFT) or ``r̃ = reward(x)`` (``tail=None``, expected-reward fine-tuning; ``eta``
    is then unused). Its gradient is ``α⁻¹β⁻¹·1[r ≷ η]·∇r`` for TFFT, ``α⁻¹·∇r`` otherwise.

    The result is a value, equal for equal ``(reward, beta, tail)``, so a jitted trainer that
    takes it as a static argument compiles once per method; ``η`` and ``α`` are traced arguments.
    ``reward`` is compared by identity: pass one function, not a lambda made anew in a loop.
    """
    if tail is not None:
        if tail not in TAILS:
            raise ValueError(
                f"tail={tail!r} is invalid: use 'left' or 'right' (TFFT) or None (expected reward)"
            )
        _check(beta, tail)
    return _LogTilt(reward, beta, tail)


def quantile_pseudo_reward(r: jax.Array, *, beta: float, tail: str) -> jax.Array:
    r"""The pseudo-reward of the iterative ("flow-density-control"-style) CVaR baseline: the
    threshold is the current model's empirical ``β``-tail quantile instead of the dual ``η*``,
    re-estimated every round (specs.md §16, "prior non-linear approach")."""
    _check(beta, tail)
    q = jnp.quantile(r, 1.0 - beta if tail == "right" else beta)
    return pseudo_reward(r, q, beta=beta, tail=tail)


def tilt_weights(
    r_tilde: jax.Array, *, alpha: float, weights: jax.Array | None = None
) -> jax.Array:
    r"""Self-normalised weights of ``p* ∝ p_pre·exp(r̃/α)`` on pre-trained samples (sum 1)."""
    if not alpha > 0:
        raise ValueError(f"alpha={alpha} is invalid: the KL weight must be > 0")
    r_tilde = jnp.asarray(r_tilde)
    logp = _log_weights(r_tilde.shape[0], weights, r_tilde.dtype) + r_tilde / alpha
    return jnp.exp(logp - logsumexp(logp))


def tilt_kl(target: jax.Array, *, weights: jax.Array | None = None) -> jax.Array:
    r"""``KL(p*‖p_pre) = Σ_i p*_i·log(p*_i / p_i)`` on the sample: the KL of the tilted target
    (``target`` from :func:`tilt_weights`) from the pre-trained law (``weights``, uniform if None)."""
    target = jnp.asarray(target)
    logw = _log_weights(target.shape[0], weights, target.dtype)
    return jnp.sum(jnp.where(target > 0, target * (jnp.log(target) - logw), 0.0))


def alpha_for_kl(
    kl_of_alpha: Callable[[float], float],
    *,
    target_kl: float,
    bounds: tuple[float, float] = (1e-4, 1e4),
    iterations: int = 60,
) -> float:
    r"""The KL weight ``α`` at which ``kl_of_alpha(α) = target_kl``, by bisection in ``log α``.

    The KL of a tilt ``exp(f/α)`` decreases in ``α`` (from the KL of the argmax to 0), which is
    how every method's ``α`` is matched to one KL budget before fine-tuning (specs.md §16: "tune α
    per method to match KL"). Runs on the host (``kl_of_alpha`` returns a float). On a finite
    sample a thresholded tilt's KL is only piecewise continuous in ``α``; the result is then the
    side of the jump closest to ``target_kl``.

    Raises:
      ValueError: ``target_kl`` is not reachable inside ``bounds``.
    """
    lo, hi = (math.log(b) for b in bounds)
    kl_lo, kl_hi = float(kl_of_alpha(bounds[0])), float(kl_of_alpha(bounds[1]))
    if not kl_hi <= target_kl <= kl_lo:
        raise ValueError(
            f"target_kl={target_kl} is outside the reachable range [{kl_hi:.4g}, {kl_lo:.4g}] for "
            f"alpha in {bounds}: choose a smaller target or widen the bounds"
        )
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if float(kl_of_alpha(math.exp(mid))) > target_kl:
            lo = mid
        else:
            hi = mid
    # On a finite sample the KL of a thresholded tilt can jump where the threshold crosses a
    # sample: return the end of the final bracket whose KL is closer to the target.
    return min((math.exp(lo), math.exp(hi)), key=lambda a: abs(kl_of_alpha(a) - target_kl))


def tilt_for_kl(
    pseudo_of_alpha: Callable[[float], jax.Array],
    *,
    target_kl: float,
    weights: jax.Array | None = None,
    bounds: tuple[float, float] = (1e-4, 1e4),
    iterations: int = 60,
) -> tuple[float, jax.Array]:
    r"""The tilt ``(α, r̃(α))`` whose target ``p* ∝ p_pre·exp(r̃(α)/α)`` is ``target_kl`` from
    ``p_pre``: every method's KL weight matched to one budget before fine-tuning.

    ``α`` solves ``KL(p*_α‖p_pre) = target_kl`` on the sample (:func:`alpha_for_kl` over
    :func:`tilt_kl` of :func:`tilt_weights`); the pseudo-reward may itself depend on ``α`` (TFFT's
    threshold ``η*(α)`` does), so it is given as a function and evaluated last at the chosen
    ``α``. Runs on the host.

    Args:
      pseudo_of_alpha: ``α -> r̃`` of shape ``(b,)`` on ``b`` pre-trained samples: ``lambda a: r``
        for expected-reward fine-tuning, ``lambda a: pseudo_reward(r, cvar_threshold(r, alpha=a,
        ...), ...)`` for TFFT, a fixed quantile pseudo-reward for the iterative baseline.
      target_kl: the KL budget in nats (> 0).
      weights: ``(b,)`` weights of the samples under ``p_pre`` (uniform if None).
      bounds: the bracket of ``α`` searched (bisection in ``log α``).
      iterations: bisection steps.

    Returns:
      ``(alpha, r_tilde)``: the KL weight (a float) and ``pseudo_of_alpha(alpha)``, shape ``(b,)``.

    Raises:
      ValueError: ``target_kl`` is not reachable inside ``bounds`` (see :func:`alpha_for_kl`).

    References:
      P16 TFFT (specs.md §16: "tune α per method to match KL").

    Example::

      alpha, r_tilde = tilt_for_kl(lambda a: r, target_kl=0.2)
      train_flow(params, samples, r_tilde / alpha, key, ...)
    """

    def kl(alpha):
        return float(
            tilt_kl(
                tilt_weights(pseudo_of_alpha(alpha), alpha=alpha, weights=weights), weights=weights
            )
        )

    alpha = alpha_for_kl(kl, target_kl=target_kl, bounds=bounds, iterations=iterations)
    return alpha, pseudo_of_alpha(alpha)
