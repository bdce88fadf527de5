"""FP8 scaling policies for attention logits as pure state machines, usable from any training loop.

A policy decides, at every training step, the per-(layer, head) scale ``s`` with which the
attention logits ``S`` are cast to FP8 (``cast(S · s)``, see :mod:`lowrank_jax.fp8.emulation`).
Every policy is a :class:`ScalingPolicy`: a ``NamedTuple`` of four pure functions over an explicit
state (a pytree, so it can be jitted, donated and checkpointed with the train state)::

    state = policy.init(key, w_q, w_k, norm_gain)             # once, from the initial weights
    scales, state = policy.scales(state, w_q, w_k, norm_gain)  # before the forward pass
    ...  # forward with the logits cast at ``scales`` (None: current scaling from amax)
    state = policy.observe(state, amax)                       # after it, with max|S| per head
    state = policy.reset(state, w_q, w_k, norm_gain)          # after the weights jump (a load)

``w_q`` ``(..., d, H, d_h)`` and ``w_k`` ``(..., d, G, d_h)`` are the query/key kernels (leading
axes: a stack of layers), ``norm_gain`` the effective gain of the norm feeding each layer
(:func:`~lowrank_jax.fp8.bounds.norm_gain_bound`, broadcastable to the leading axes), ``amax``
``(..., H)``. The factories:

* :func:`geometry_scaling_policy`: the geometry-aware scale of P14 from ``σ_max(W^Q_h W^{K⊤}_h)``,
  tracked by one warm-started power step per training step (``burn_in_iters`` steps at ``init``
  and ``reset``); never looks at activations, so it follows a jump of the weights at once;
  with ``online_calibration=True`` the bound is multiplied by an online factor ``κ`` learned from
  the observed ratio ``max|S| / bound`` (:func:`online_calibration_factor`), which keeps trained,
  non-isotropic attention from overflowing without a hand-set calibration;
* :func:`delayed_scaling_policy`: Transformer Engine's delayed scaling (``amax`` history);
* :func:`current_scaling_policy`: just-in-time ``s = R/amax`` of the present logits (``scales``
  returns None: the kernel computes it, see :func:`~lowrank_jax.fp8.delayed.current_scale`).

The geometry state machine is also available directly as :func:`init_geometry_scaling` /
:func:`update_geometry_scaling` over a :class:`GeometryScalingState`, and per layer as
:func:`attention_fp8_scales`.

References:
    P14, arXiv 2602.18851 (geometry-aware scales, implicit power iteration; reconstruction in
    specs.md §14); NVIDIA Transformer Engine ``DelayedScaling`` (the baseline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.bounds import (
    geometry_aware_scale,
    rank_agnostic_alpha,
    rank_agnostic_scale,
    rank_aware_alpha,
)
from lowrank_jax.fp8.delayed import init_delayed_scaling, update_delayed_scaling
from lowrank_jax.fp8.emulation import fp8_max
from lowrank_jax.spectral.power_iteration import (
    PowerIterationState,
    attention_power_iteration,
    init_power_iteration,
)

__all__ = [
    "GeometryScalingState",
    "OnlineCalibrationState",
    "ScalingPolicy",
    "attention_fp8_scales",
    "current_scaling_policy",
    "delayed_scaling_policy",
    "geometry_scaling_policy",
    "init_geometry_scaling",
    "online_calibration_factor",
    "update_geometry_scaling",
]


def attention_fp8_scales(
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    state: PowerIterationState,
    *,
    seq_len: int,
    norm_gain: jax.typing.ArrayLike = 1.0,
    delta: float = 1e-6,
    gamma: float | None = None,
    fmt: str = "e4m3",
    calibration: float = 1.0,
    num_iters: int = 1,
    method: str = "power",
    rank_aware: bool = True,
) -> tuple[jax.Array, PowerIterationState]:
    """Per-head FP8 logit scales of one attention layer from its weights (one call per step).

    Runs ``num_iters`` warm-started power steps for ``σ_max(W^Q_h W^{K⊤}_{g(h)})`` (GQA without
    key expansion) and maps them to scales with
    :func:`~lowrank_jax.fp8.bounds.geometry_aware_scale` (or ``rank_agnostic_scale``).

    Args:
        w_q: ``(d, H, d_h)`` query kernel.
        w_k: ``(d, G, d_h)`` key kernel.
        state: power-iteration state (``spectral.init_attention_power_iteration``).
        seq_len: sequence length ``n``.
        norm_gain: effective gain of the norm feeding the attention, broadcastable to ``(H,)``.
        delta: failure probability ``δ``.
        gamma: typicality ``γ`` (``None``: ``chernoff_gamma``).
        fmt: FP8 format.
        calibration: calibration factor ``c``.
        num_iters: power steps this call.
        method: ``"power"`` (warm-started tracking) or ``"lanczos"`` (cold starts).
        rank_aware: rank-aware (default) or rank-agnostic bound.

    Returns:
        ``(scales, state)``: ``(H,)`` float32 scales and the new power-iteration state (its
        ``sigma`` field holds the per-head ``σ``). A per-layer scale is ``scales.min()``.

    Raises:
        ValueError: on inconsistent shapes or invalid knobs.

    References:
        P14 (arXiv 2602.18851); reconstruction in specs.md §14.
    """
    w_q = jnp.asarray(w_q)
    sigma, state = attention_power_iteration(w_q, w_k, state, num_iters=num_iters, method=method)
    d, _, dh = w_q.shape
    kw = dict(d=d, head_dim=dh, seq_len=seq_len, norm_gain=norm_gain, delta=delta, fmt=fmt)
    if rank_aware:
        scales = geometry_aware_scale(sigma, gamma=gamma, calibration=calibration, **kw)
    else:
        scales = rank_agnostic_scale(sigma, calibration=calibration, **kw)
    return scales, state


class GeometryScalingState(NamedTuple):
    """State of :func:`update_geometry_scaling` (leading axes ``...`` = the kernels' layers).

    Attributes:
        count: scalar int32, power steps performed so far.
        v: ``(..., H, d)`` unit right-singular-vector estimates, one per head (the warm start).
        sigma: ``(..., H)`` current estimates of ``σ_max(W^Q_h W^{K⊤}_{g(h)})`` (lower bounds).
    """

    count: jax.Array
    v: jax.Array
    sigma: jax.Array


def _attention_shapes(w_q, w_k) -> tuple[tuple[int, ...], int, int]:
    if jnp.ndim(w_q) < 3 or jnp.ndim(w_k) != jnp.ndim(w_q):
        raise ValueError(
            "w_q must be (..., d, H, d_h) and w_k (..., d, G, d_h) with the same leading (layer) "
            f"axes; got shapes {jnp.shape(w_q)} and {jnp.shape(w_k)}."
        )
    shape = jnp.shape(w_q)
    if jnp.shape(w_k)[:-3] != shape[:-3]:
        raise ValueError(f"w_q and w_k leading axes differ: {shape} vs {jnp.shape(w_k)}.")
    return shape[:-3], shape[-3], shape[-2]


def init_geometry_scaling(key: jax.Array, w_q: jax.typing.ArrayLike) -> GeometryScalingState:
    """Random unit start vectors, one per head: ``v`` ``(..., H, d)``, ``sigma`` zeros.

    Args:
        key: PRNG key.
        w_q: ``(..., d, H, d_h)`` query kernel(s); only the shape is used.

    Returns:
        ``GeometryScalingState`` (run :func:`update_geometry_scaling` with ``num_iters`` ≈ 30, or
        ``method="lanczos"``, once before using its scales: a cold start needs a burn-in).

    Raises:
        ValueError: if ``w_q`` has fewer than 3 axes.
    """
    shape = jnp.shape(w_q)
    if len(shape) < 3:
        raise ValueError(f"w_q must be (..., d, H, d_h), got shape {shape}.")
    st = init_power_iteration(key, (*shape[:-3], shape[-2]), shape[-3])
    return GeometryScalingState(count=st.count, v=st.v, sigma=st.sigma)


def update_geometry_scaling(
    state: GeometryScalingState,
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    norm_gain: jax.typing.ArrayLike = 1.0,
    *,
    seq_len: int,
    delta: float = 1e-6,
    gamma: float | None = None,
    rank_aware: bool = True,
    fmt: str = "e4m3",
    calibration: float = 1.0,
    num_iters: int = 1,
    method: str = "power",
) -> tuple[jax.Array, GeometryScalingState]:
    """Geometry-aware scales ``(..., H)`` from the present weights; advances the power iteration.

    ``num_iters`` warm-started power steps per layer and head (:func:`attention_fp8_scales`,
    ``vmap``-ed over the leading axes), then ``s = c R √d_h / (g² σ √(γ r log(2n²/δ)))``.

    Args:
        state: from :func:`init_geometry_scaling` or a previous call.
        w_q: ``(..., d, H, d_h)`` query kernels.
        w_k: ``(..., d, G, d_h)`` key kernels, ``H % G == 0``.
        norm_gain: effective norm gain per layer, broadcastable to ``(...)`` (or to ``(..., H)``).
        seq_len: sequence length ``n``.
        delta: failure probability ``δ``.
        gamma: typicality ``γ`` (``None``: ``chernoff_gamma``).
        rank_aware: rank-aware (default) or rank-agnostic bound.
        fmt: FP8 format.
        calibration: calibration factor ``c``.
        num_iters: power steps this call (1 per training step; ~30 for a cold start).
        method: ``"power"`` or ``"lanczos"``.

    Returns:
        ``(scales, state)``: float32 ``(..., H)`` scales and the new state.

    Raises:
        ValueError: on inconsistent shapes or invalid knobs.

    Example:
        >>> st = init_geometry_scaling(key, wq)                      # wq: (L, d, H, d_h)
        >>> s, st = update_geometry_scaling(st, wq, wk, gains, seq_len=512, num_iters=30)
    """
    w_q, w_k = jnp.asarray(w_q), jnp.asarray(w_k)
    lead, d, h = _attention_shapes(w_q, w_k)
    if state.v.shape != (*lead, h, d):
        raise ValueError(
            f"state.v must have shape {(*lead, h, d)} for w_q of shape {w_q.shape}, got "
            f"{state.v.shape}; initialise it with init_geometry_scaling(key, w_q)."
        )
    gain = jnp.asarray(norm_gain, jnp.float32)
    gain = jnp.broadcast_to(gain, lead if gain.ndim <= len(lead) else (*lead, h))
    kw = dict(
        seq_len=seq_len,
        delta=delta,
        gamma=gamma,
        fmt=fmt,
        calibration=calibration,
        num_iters=num_iters,
        method=method,
        rank_aware=rank_aware,
    )

    def layer(q, k, v, sigma, g):
        st = PowerIterationState(v, sigma, jnp.zeros((), jnp.int32))
        scales, st = attention_fp8_scales(q, k, st, norm_gain=g, **kw)
        return scales, st.v, st.sigma

    n = 1
    for a in lead:
        n *= a
    flat = lambda x, tail: x.reshape(n, *x.shape[len(lead) :]) if tail else x.reshape(n)
    if lead:
        scales, v, sigma = jax.vmap(layer)(
            flat(w_q, 1), flat(w_k, 1), flat(state.v, 1), flat(state.sigma, 1), flat(gain, 1)
        )
        scales, v, sigma = (x.reshape(*lead, *x.shape[1:]) for x in (scales, v, sigma))
    else:
        scales, v, sigma = layer(w_q, w_k, state.v, state.sigma, gain)
    count = state.count + jnp.int32(num_iters)
    return scales, GeometryScalingState(count=count, v=v, sigma=sigma)


class OnlineCalibrationState(NamedTuple):
    """State of :func:`geometry_scaling_policy` with ``online_calibration=True``.

    Attributes:
        geometry: the power tracker's :class:`GeometryScalingState`.
        bound: ``(..., H)`` the uncalibrated logit bound ``B_t = α(δ) B_wc`` of the last
            ``scales`` call (what ``observe`` divides the step's ``amax`` by).
        ratios: ``(..., H, h)`` the last ``h`` observed ratios ``ρ = amax / B`` (newest first; 0
            where not yet observed).
        seen: scalar int32, observations since ``init`` / ``reset``.
    """

    geometry: GeometryScalingState
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
    """``κ = clip(m · max_t ρ_t, floor, 1/α)``, or ``1/α`` before any observation.

    The bound ``B = α(δ) B_wc`` assumes tokens isotropic with respect to ``M = W^Q W^{K⊤}``;
    trained attention aligns queries and keys with ``M``'s top singular directions, so
    ``ρ = max|S| / B`` exceeds 1 (1.4–1.7 on the fp8_attention model, see ``docs/notes/p14_fp8.md``).
    ``ρ`` is invariant to a rescaling of ``W^Q``/``W^K`` and of the norm gains (both sides scale
    alike), so a running max of it survives the weight transients that delayed scaling fails on;
    only the tokens' *alignment* has to change by less than the factor ``margin`` within the
    history for the calibrated bound ``κ B`` to hold. ``κ ≤ 1/α`` caps it at the deterministic
    ``B_wc`` (never exceeded when ``‖x‖ ≤ g√d``), which is also the value before any observation
    (after ``init`` and ``reset``): the first step is safe without activation statistics.

    Args:
        ratios: ``(..., h)`` recent ratios (0: empty slot).
        seen: number of observations (0: use the worst case).
        margin: ``m ≥ 1``, head-room over the largest recent ratio.
        worst_case: ``1/α`` (``≥ 1``), the cap.
        floor: lower clip of ``κ`` (``> 0``; keeps the scale finite for a head with zero logits).

    Returns:
        ``κ`` with shape ``ratios.shape[:-1]``.
    """
    ratios = jnp.asarray(ratios, jnp.float32)
    kappa = jnp.clip(margin * jnp.max(ratios, axis=-1), floor, worst_case)
    return jnp.where(jnp.asarray(seen) > 0, kappa, jnp.float32(worst_case))


class ScalingPolicy(NamedTuple):
    """An FP8 scaling policy: pure functions over an explicit state (see the module docstring).

    Attributes:
        init: ``(key, w_q, w_k, norm_gain) -> state``.
        scales: ``(state, w_q, w_k, norm_gain) -> (scales (..., H) or None, state)``; None means
            current scaling (the kernel computes ``R / amax`` of the present logits).
        observe: ``(state, amax (..., H)) -> state``, after the step's forward pass.
        reset: ``(state, w_q, w_k, norm_gain) -> state``, after the weights jumped (e.g. a
            checkpoint load): re-converges or forgets what the state tracked.
    """

    init: Callable[..., Any]
    scales: Callable[..., tuple[jax.Array | None, Any]]
    observe: Callable[[Any, jax.Array], Any]
    reset: Callable[..., Any]


def geometry_scaling_policy(
    *,
    seq_len: int,
    delta: float = 1e-6,
    gamma: float | None = None,
    rank_aware: bool = True,
    fmt: str = "e4m3",
    calibration: float = 1.0,
    num_iters: int = 1,
    burn_in_iters: int = 30,
    online_calibration: bool = False,
    online_history: int = 16,
    online_margin: float = 1.25,
    online_floor: float = 1.0,
) -> ScalingPolicy:
    """P14's geometry-aware scales, tracked by a warm-started power iteration.

    ``init`` starts from random vectors and runs ``burn_in_iters`` power steps; ``scales`` runs
    ``num_iters`` more on the present weights and returns :func:`update_geometry_scaling`'s
    scales; ``observe`` ignores activations; ``reset`` runs ``burn_in_iters`` warm-started steps.

    With ``online_calibration`` (ours; the summaries of P14 mention a burn-in "auto-α") the
    scale becomes ``s = c R / (κ_t B_t)`` with ``B_t`` the bound above and
    ``κ_t = clip(m · max_{last h steps} amax/B, floor, 1/α)``
    (:func:`online_calibration_factor`); ``observe`` records ``amax / B_t``, ``reset`` forgets
    the ratios, so the step after ``init``/``reset`` uses the deterministic worst case
    ``B_wc = B/α``. The state is then an :class:`OnlineCalibrationState`.

    Args:
        seq_len: sequence length ``n``.
        delta: failure probability ``δ``.
        gamma: typicality ``γ`` (``None``: ``chernoff_gamma``, valid for every spectrum).
        rank_aware: rank-aware (default) or rank-agnostic bound.
        fmt: FP8 format.
        calibration: calibration factor ``c``.
        num_iters: power steps per training step.
        burn_in_iters: power steps at ``init`` and ``reset`` (0: none).
        online_calibration: learn ``κ`` from the observed ``amax`` (see above).
        online_history: ``h``, steps of ratios kept.
        online_margin: ``m ≥ 1``, head-room over the largest recent ratio.
        online_floor: smallest ``κ`` (``0 < floor ≤ 1``); the default 1 never goes below the
            P14 bound (only raises it where trained attention is observed to exceed it); a
            smaller floor also *lowers* it where the logits stay far below it (more
            utilisation, but then a fast change of the tokens' alignment can overflow).

    Returns:
        A :class:`ScalingPolicy` whose state is a :class:`GeometryScalingState` (an
        :class:`OnlineCalibrationState` with ``online_calibration``).

    Raises:
        ValueError: on invalid knobs.

    References:
        P14 (arXiv 2602.18851); reconstruction in specs.md §14.
    """
    fp8_max(fmt)  # validates the format
    if int(num_iters) < 1 or int(burn_in_iters) < 0:
        raise ValueError(
            f"need num_iters >= 1, burn_in_iters >= 0; got {num_iters}, {burn_in_iters}."
        )
    if not (0 < delta < 1) or not calibration > 0 or int(seq_len) < 1:
        raise ValueError(
            f"need seq_len >= 1, 0 < delta < 1, calibration > 0; got {seq_len}, {delta}, "
            f"{calibration}."
        )
    kw = dict(
        seq_len=seq_len,
        delta=delta,
        gamma=gamma,
        rank_aware=rank_aware,
        fmt=fmt,
        calibration=calibration,
    )

    def scales(state, w_q, w_k, norm_gain):
        return update_geometry_scaling(state, w_q, w_k, norm_gain, num_iters=num_iters, **kw)

    def reset(state, w_q, w_k, norm_gain):
        if not burn_in_iters:
            return state
        return update_geometry_scaling(state, w_q, w_k, norm_gain, num_iters=burn_in_iters, **kw)[1]

    def init(key, w_q, w_k, norm_gain):
        return reset(init_geometry_scaling(key, w_q), w_q, w_k, norm_gain)

    if not online_calibration:
        return ScalingPolicy(
            init=init, scales=scales, observe=lambda state, amax: state, reset=reset
        )
    if int(online_history) < 1 or not online_margin >= 1 or not 0 < online_floor <= 1:
        raise ValueError(
            "need online_history >= 1, online_margin >= 1 and 0 < online_floor <= 1; got "
            f"{online_history}, {online_margin}, {online_floor}."
        )
    r_max = fp8_max(fmt)

    def worst_case(w_q):
        d, _, dh = jnp.shape(w_q)[-3:]
        if rank_aware:
            a = rank_aware_alpha(d=d, rank=dh, seq_len=seq_len, delta=delta, gamma=gamma)
        else:
            a = rank_agnostic_alpha(d=d, seq_len=seq_len, delta=delta)
        return 1.0 / min(a, 1.0)

    def online_scales(state, w_q, w_k, norm_gain):
        kw1 = dict(kw, calibration=1.0)
        base, geo = update_geometry_scaling(
            state.geometry, w_q, w_k, norm_gain, num_iters=num_iters, **kw1
        )
        kappa = online_calibration_factor(
            state.ratios,
            state.seen,
            margin=online_margin,
            worst_case=worst_case(w_q),
            floor=online_floor,
        )
        state = state._replace(geometry=geo, bound=r_max / base)
        return calibration * base / kappa, state

    def online_observe(state, amax):
        ratio = jnp.asarray(amax, jnp.float32) / state.bound
        ratios = jnp.concatenate([ratio[..., None], state.ratios[..., :-1]], axis=-1)
        return state._replace(ratios=ratios, seen=state.seen + 1)

    def online_reset(state, w_q, w_k, norm_gain):
        geo = reset(state.geometry, w_q, w_k, norm_gain)
        return state._replace(
            geometry=geo, ratios=jnp.zeros_like(state.ratios), seen=jnp.zeros_like(state.seen)
        )

    def online_init(key, w_q, w_k, norm_gain):
        geo = init(key, w_q, w_k, norm_gain)
        shape = jnp.shape(geo.sigma)
        return OnlineCalibrationState(
            geometry=geo,
            bound=jnp.ones(shape, jnp.float32),
            ratios=jnp.zeros((*shape, int(online_history)), jnp.float32),
            seen=jnp.zeros((), jnp.int32),
        )

    return ScalingPolicy(
        init=online_init, scales=online_scales, observe=online_observe, reset=online_reset
    )


def delayed_scaling_policy(
    *,
    history_len: int = 1024,
    margin: float = 0.0,
    algo: str = "max",
    fmt: str = "e4m3",
    init_scale: float = 1.0,
    reset_history: bool = True,
) -> ScalingPolicy:
    """Transformer Engine's delayed scaling: scales from the ``amax`` history of earlier steps.

    ``scales`` returns the state's scale (computed from steps before this one); ``observe``
    records this step's ``amax`` (:func:`~lowrank_jax.fp8.delayed.update_delayed_scaling`);
    ``reset`` forgets the history when ``reset_history`` (else keeps it).

    Args:
        history_len: length of the ``amax`` history.
        margin: safety exponent (scale ``/ 2^margin``).
        algo: ``"max"`` or ``"most_recent"``.
        fmt: FP8 format.
        init_scale: scale before any ``amax`` was seen.
        reset_history: whether ``reset`` clears the history.

    Returns:
        A :class:`ScalingPolicy` whose state is a ``DelayedScalingState`` of shape ``(..., H)``.

    Raises:
        ValueError: on invalid knobs.
    """
    fp8_max(fmt)
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}.")
    init_delayed_scaling((), history_len=history_len, init_scale=init_scale)  # validates

    def init(key, w_q, w_k, norm_gain):
        del key, w_k, norm_gain
        shape = jnp.shape(w_q)
        return init_delayed_scaling(
            (*shape[:-3], shape[-2]), history_len=history_len, init_scale=init_scale
        )

    def reset(state, w_q, w_k, norm_gain):
        return init(None, w_q, w_k, norm_gain) if reset_history else state

    return ScalingPolicy(
        init=init,
        scales=lambda state, w_q, w_k, norm_gain: (state.scale, state),
        observe=lambda state, amax: update_delayed_scaling(
            state, amax, fmt=fmt, margin=margin, algo=algo
        ),
        reset=reset,
    )


def current_scaling_policy() -> ScalingPolicy:
    """Just-in-time scaling: no state; ``scales`` returns None (use ``current_scale(amax)``).

    The oracle that needs the present logits' ``amax`` before the cast (an extra pass over them
    in a fused kernel); the reference the other policies are measured against.
    """
    return ScalingPolicy(
        init=lambda key, w_q, w_k, norm_gain: (),
        scales=lambda state, w_q, w_k, norm_gain: (None, state),
        observe=lambda state, amax: state,
        reset=lambda state, w_q, w_k, norm_gain: state,
    )
