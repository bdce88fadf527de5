"""Online calibration of any FP8 scaling policy: a factor ``κ`` learned from the observed ``amax``.

:func:`online_calibration` wraps a :class:`~lowrank_jax.fp8.policies.ScalingPolicy` whose
``scales`` are arrays. The wrapped policy's scale ``s`` assumes the logits stay within ``R/s``;
the wrapper records the ratios ``ρ = amax · s / R`` (``R`` of the policy's ``fmt``) of the steps it saw and scales with ``s / κ``,
``κ = clip(m · max_{last h steps} ρ, floor, worst_case)`` (:func:`online_calibration_factor`),
and ``κ = worst_case`` before any observation (after ``init`` and ``reset``). Over the geometry
policy (ours; the summaries of P14 mention a burn-in "auto-α") ``worst_case = c/α``, so the first
step uses the deterministic worst case ``B_wc`` and the scale never goes below ``R / B_wc``.

References:
    P14, arXiv 2602.18851; the calibration is ours (``docs/notes/p14_fp8.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.emulation import fp8_max
from lowrank_jax.fp8.policies import ScalingPolicy

__all__ = ["OnlineCalibrationState", "online_calibration", "online_calibration_factor"]


class OnlineCalibrationState(NamedTuple):
    """State of a policy wrapped by :func:`online_calibration`.

    Attributes:
        inner: the wrapped policy's state.
        bound: ``(..., H)`` the range ``R / s`` the wrapped policy's scale ``s`` of the last
            ``scales`` call assumes (what ``observe`` divides the step's ``amax`` by).
        ratios: ``(..., H, h)`` the last ``h`` observed ratios ``ρ = amax / bound`` (newest first;
            0 where not yet observed).
        seen: scalar int32, observations since ``init`` / ``reset``.
    """

    inner: Any
    bound: jax.Array
    ratios: jax.Array
    seen: jax.Array


def online_calibration_factor(
    ratios: jax.typing.ArrayLike,
    seen: jax.typing.ArrayLike,
    *,
    margin: float,
    worst_case: float,
    floor: float,
) -> jax.Array:
    """``κ = clip(m · max_t ρ_t, floor, worst_case)``, or ``worst_case`` before any observation.

    Over the geometry policy, ``B = α(δ) B_wc`` assumes tokens isotropic with respect to
    ``M = W^Q W^{K⊤}``; trained attention aligns queries and keys with ``M``'s top singular
    directions, so ``ρ = max|S| / B`` exceeds 1 (1.4–1.7 on the fp8_attention model, see
    ``docs/notes/p14_fp8.md``). ``ρ`` is invariant to a rescaling of ``W^Q``/``W^K`` and of the
    norm gains (both sides scale alike), so a running max of it survives the weight transients
    that delayed scaling fails on; only the tokens' *alignment* has to change by less than the
    factor ``margin`` within the history for the calibrated bound ``κ B`` to hold. The cap
    ``1/α`` is the deterministic ``B_wc`` (never exceeded when ``‖x‖ ≤ g√d``), also the value
    before any observation: the first step is safe without activation statistics.

    Args:
        ratios: ``(..., h)`` recent ratios (0: empty slot).
        seen: number of observations (0: use the worst case).
        margin: ``m ≥ 1``, head-room over the largest recent ratio.
        worst_case: the cap (``≥ 1``).
        floor: lower clip of ``κ`` (``> 0``; keeps the scale finite for a head with zero logits).

    Returns:
        ``κ`` with shape ``ratios.shape[:-1]``.
    """
    ratios = jnp.asarray(ratios, jnp.float32)
    kappa = jnp.clip(margin * jnp.max(ratios, axis=-1), floor, worst_case)
    return jnp.where(jnp.asarray(seen) > 0, kappa, jnp.float32(worst_case))


def online_calibration(
    policy: ScalingPolicy,
    *,
    history: int = 16,
    margin: float = 1.25,
    floor: float = 1.0,
    worst_case: Callable[[Any], float] | float | None = None,
) -> ScalingPolicy:
    """``policy`` with its scales divided by an online factor ``κ`` learned from the ``amax``.

    ``scales`` returns ``s / κ`` with ``s`` the wrapped policy's scales and ``κ`` from the ratios
    ``amax · s / R`` of the last ``history`` steps (:func:`online_calibration_factor`);
    ``observe`` records this step's ratio (and passes ``amax`` on), ``reset`` resets the wrapped
    state and forgets the ratios, so the step after ``init``/``reset`` uses ``κ = worst_case``.

    Args:
        policy: a policy whose ``scales`` returns arrays (not ``current_scaling_policy``).
        history: ``h``, steps of ratios kept.
        margin: ``m ≥ 1``, head-room over the largest recent ratio.
        floor: smallest ``κ`` (``0 < floor ≤ 1``); the default 1 never goes below the wrapped
            policy's scale (only raises the range where the logits are observed to exceed it); a
            smaller floor also *lowers* it where the logits stay far below it (more utilisation,
            but then a fast change of the tokens' alignment can overflow).
        worst_case: the cap of ``κ`` (``≥ 1``), a number or a function of ``w_q``; None: the
            policy's own ``worst_case`` (the geometry policy's ``c/α``).

    Returns:
        A :class:`~lowrank_jax.fp8.policies.ScalingPolicy` whose state is an
        :class:`OnlineCalibrationState` and whose ``worst_case`` is the wrapped one's.

    Raises:
        ValueError: on invalid knobs, or when neither ``worst_case`` nor the policy gives a cap.

    Example:
        >>> rule = fp8.ScaleRule(seq_len=2048)
        >>> policy = fp8.online_calibration(fp8.geometry_scaling_policy(rule))
    """
    if int(history) < 1 or not margin >= 1 or not 0 < floor <= 1:
        raise ValueError(
            f"need history >= 1, margin >= 1 and 0 < floor <= 1; got {history}, {margin}, {floor}."
        )
    cap = policy.worst_case if worst_case is None else worst_case
    if cap is None:
        raise ValueError(
            "online_calibration needs a cap: pass worst_case= (a number >= 1 or a function of "
            "w_q) for a policy without one."
        )
    if policy.fmt is None:
        raise ValueError("online_calibration needs a policy that names its FP8 format (fmt).")
    r_max = fp8_max(policy.fmt)
    cap_of = cap if callable(cap) else (lambda w_q: cap)

    def init(key, w_q, w_k, norm_gain):
        inner = policy.init(key, w_q, w_k, norm_gain)
        shape = (*jnp.shape(w_q)[:-3], jnp.shape(w_q)[-2])
        return OnlineCalibrationState(
            inner=inner,
            bound=jnp.ones(shape, jnp.float32),
            ratios=jnp.zeros((*shape, int(history)), jnp.float32),
            seen=jnp.zeros((), jnp.int32),
        )

    def scales(state, w_q, w_k, norm_gain):
        base, inner = policy.scales(state.inner, w_q, w_k, norm_gain)
        if base is None:
            raise ValueError("online_calibration needs a policy whose scales are arrays.")
        kappa = online_calibration_factor(
            state.ratios, state.seen, margin=margin, worst_case=cap_of(w_q), floor=floor
        )
        state = state._replace(inner=inner, bound=r_max / base)
        return base / kappa, state

    def observe(state, amax):
        ratio = jnp.asarray(amax, jnp.float32) / state.bound
        ratios = jnp.concatenate([ratio[..., None], state.ratios[..., :-1]], axis=-1)
        inner = policy.observe(state.inner, amax)
        return state._replace(inner=inner, ratios=ratios, seen=state.seen + 1)

    def reset(state, w_q, w_k, norm_gain):
        return state._replace(
            inner=policy.reset(state.inner, w_q, w_k, norm_gain),
            ratios=jnp.zeros_like(state.ratios),
            seen=jnp.zeros_like(state.seen),
        )

    return ScalingPolicy(
        init=init,
        scales=scales,
        observe=observe,
        reset=reset,
        worst_case=policy.worst_case,
        fmt=policy.fmt,
    )
