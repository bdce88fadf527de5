"""FP8 scaling policies for attention logits as pure state machines, usable from any training loop.

A policy decides, at every training step, the per-(layer, head) scale ``s`` with which the
attention logits ``S`` are cast to FP8 (``cast(S · s)``, see :mod:`lowrank_jax.fp8.emulation`).
Every policy is one :class:`ScalingPolicy` value: a ``NamedTuple`` of pure functions over an
explicit state (a pytree, so it can be jitted, donated and checkpointed with the train state)::

    state = policy.init(key, w_q, w_k, norm_gain)             # once, from the initial weights
    scales, state = policy.scales(state, w_q, w_k, norm_gain)  # before the forward pass
    ...  # forward with the logits cast at ``scales`` (None: current scaling from amax)
    state = policy.observe(state, amax)                       # after it, with max|S| per head
    state = policy.reset(state, w_q, w_k, norm_gain)          # after the weights jump (a load)

``w_q`` ``(..., d, H, d_h)`` and ``w_k`` ``(..., d, G, d_h)`` are the query/key kernels (leading
axes: a stack of layers), ``norm_gain`` the effective gain of the norm feeding each layer
(:func:`~lowrank_jax.fp8.bounds.norm_gain_bound`, broadcastable to the leading axes), ``amax``
``(..., H)``. The policies:

* :func:`geometry_scaling_policy`: the geometry-aware scale of P14 (the knobs in a
  :class:`~lowrank_jax.fp8.scale_rule.ScaleRule`) from ``σ_max(W^Q_h W^{K⊤}_h)``, tracked by one
  warm-started power step per training step (``burn_in_iters`` steps at ``init`` and ``reset``);
  never looks at activations, so it follows a jump of the weights at once;
* :func:`delayed_scaling_policy`: Transformer Engine's delayed scaling (``amax`` history);
* :func:`current_scaling_policy`: just-in-time ``s = R/amax`` of the present logits (``scales``
  returns None: the kernel computes it, see :func:`~lowrank_jax.fp8.delayed.current_scale`).

:func:`~lowrank_jax.fp8.online.online_calibration` wraps any policy whose scales are not None
with a factor ``κ`` learned from the observed ``amax``. Offline (a checkpoint, inference), the
same rule on the exact ``σ`` is :func:`~lowrank_jax.fp8.sigma.attention_scales`.

References:
    P14, arXiv 2602.18851 (geometry-aware scales, implicit power iteration; reconstruction in
    specs.md §14); NVIDIA Transformer Engine ``DelayedScaling`` (the baseline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.delayed import init_delayed_scaling, update_delayed_scaling
from lowrank_jax.fp8.emulation import fp8_max
from lowrank_jax.fp8.scale_rule import ScaleRule
from lowrank_jax.spectral.power_iteration import (
    PowerIterationState,
    attention_power_iteration,
    init_power_iteration,
)

__all__ = [
    "GeometryScalingState",
    "ScalingPolicy",
    "current_scaling_policy",
    "delayed_scaling_policy",
    "geometry_scaling_policy",
]


class ScalingPolicy(NamedTuple):
    """An FP8 scaling policy: pure functions over an explicit state (see the module docstring).

    Attributes:
        init: ``(key, w_q, w_k, norm_gain) -> state``.
        scales: ``(state, w_q, w_k, norm_gain) -> (scales (..., H) or None, state)``; None means
            current scaling (the kernel computes ``R / amax`` of the present logits).
        observe: ``(state, amax (..., H)) -> state``, after the step's forward pass.
        reset: ``(state, w_q, w_k, norm_gain) -> state``, after the weights jumped (e.g. a
            checkpoint load): re-converges or forgets what the state tracked.
        worst_case: ``(w_q) -> float`` or None: the largest factor by which ``max|S|`` can
            exceed ``R / scales`` (the geometry policy's ``c/α``: the deterministic bound);
            None where the policy knows none. The cap of
            :func:`~lowrank_jax.fp8.online.online_calibration`.
        fmt: the FP8 format the scales target (None: scales are None, current scaling).
    """

    init: Callable[..., Any]
    scales: Callable[..., tuple[jax.Array | None, Any]]
    observe: Callable[[Any, jax.Array], Any]
    reset: Callable[..., Any]
    worst_case: Callable[[Any], float] | None = None
    fmt: str | None = None


class GeometryScalingState(NamedTuple):
    """State of :func:`geometry_scaling_policy` (leading axes ``...`` = the kernels' layers).

    Attributes:
        count: scalar int32, power steps performed so far.
        v: ``(..., H, d)`` unit right-singular-vector estimates, one per head (the warm start;
            :func:`~lowrank_jax.fp8.sigma.attention_top_singular` gives the exact one).
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


def _init_tracker(key: jax.Array, w_q) -> GeometryScalingState:
    shape = jnp.shape(w_q)
    if len(shape) < 3:
        raise ValueError(f"w_q must be (..., d, H, d_h), got shape {shape}.")
    st = init_power_iteration(key, (*shape[:-3], shape[-2]), shape[-3])
    return GeometryScalingState(count=st.count, v=st.v, sigma=st.sigma)


def _track(state, w_q, w_k, norm_gain, rule: ScaleRule, num_iters: int):
    """``num_iters`` warm-started power steps per layer and head, then ``rule``'s scales."""
    w_q, w_k = jnp.asarray(w_q), jnp.asarray(w_k)
    lead, d, h = _attention_shapes(w_q, w_k)
    if state.v.shape != (*lead, h, d):
        raise ValueError(
            f"state.v must have shape {(*lead, h, d)} for w_q of shape {w_q.shape}, got "
            f"{state.v.shape}; initialise it with the policy's init(key, w_q, w_k, norm_gain)."
        )
    gain = jnp.asarray(norm_gain, jnp.float32)
    gain = jnp.broadcast_to(gain, lead if gain.ndim <= len(lead) else (*lead, h))

    def layer(q, k, v, sigma, g):
        st = PowerIterationState(v, sigma, jnp.zeros((), jnp.int32))
        sigma, st = attention_power_iteration(q, k, st, num_iters=num_iters)
        scales = rule.scales(sigma, d=q.shape[0], head_dim=q.shape[-1], norm_gain=g)
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


def geometry_scaling_policy(
    rule: ScaleRule, *, num_iters: int = 1, burn_in_iters: int = 30
) -> ScalingPolicy:
    """P14's geometry-aware scales, ``σ`` tracked by a warm-started power iteration.

    ``init`` starts from random unit vectors and runs ``burn_in_iters`` power steps; ``scales``
    runs ``num_iters`` more on the present weights (GQA without key expansion, ``vmap``-ed over
    the leading axes) and returns ``rule.scales(σ)``; ``observe`` ignores activations; ``reset``
    runs ``burn_in_iters`` warm-started steps. Its ``worst_case`` is ``c/α``: the scale
    ``c R/(α B_wc)`` times it maps the deterministic bound ``B_wc`` onto ``R``.

    Args:
        rule: the scale rule's knobs (:class:`~lowrank_jax.fp8.scale_rule.ScaleRule`).
        num_iters: power steps per training step.
        burn_in_iters: power steps at ``init`` and ``reset`` (0: none).

    Returns:
        A :class:`ScalingPolicy` whose state is a :class:`GeometryScalingState`.

    Raises:
        ValueError: on invalid knobs; its functions on inconsistent shapes.

    References:
        P14 (arXiv 2602.18851); reconstruction in specs.md §14.

    Example:
        >>> policy = geometry_scaling_policy(ScaleRule(seq_len=2048))
        >>> state = policy.init(key, wq, wk, gains)             # wq: (L, d, H, d_h)
        >>> scales, state = policy.scales(state, wq, wk, gains)  # (L, H)
    """
    if not isinstance(rule, ScaleRule):
        raise ValueError(f"rule must be a ScaleRule, got {rule!r}.")
    if int(num_iters) < 1 or int(burn_in_iters) < 0:
        raise ValueError(
            f"need num_iters >= 1, burn_in_iters >= 0; got {num_iters}, {burn_in_iters}."
        )

    def scales(state, w_q, w_k, norm_gain):
        return _track(state, w_q, w_k, norm_gain, rule, num_iters)

    def reset(state, w_q, w_k, norm_gain):
        if not burn_in_iters:
            return state
        return _track(state, w_q, w_k, norm_gain, rule, burn_in_iters)[1]

    def init(key, w_q, w_k, norm_gain):
        return reset(_init_tracker(key, w_q), w_q, w_k, norm_gain)

    def worst_case(w_q):
        d, _, dh = jnp.shape(w_q)[-3:]
        return rule.calibration / rule.alpha(d=d, head_dim=dh)

    return ScalingPolicy(
        init=init,
        scales=scales,
        observe=lambda state, amax: state,
        reset=reset,
        worst_case=worst_case,
        fmt=rule.fmt,
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
        fmt=fmt,
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
