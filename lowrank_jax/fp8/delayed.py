"""Activation-based FP8 scaling: delayed scaling (the baseline) and the current-scaling oracle.

Delayed scaling (Transformer Engine) keeps a rolling history of past ``amax = max|x|`` values and
quantises step ``t`` with ``s = R / max(history) / 2^margin`` computed from steps ``< t``: cheap,
but blind to a jump of the present tensor (a spike of the weights, a learning-rate spike, a
checkpoint load). Current ("just-in-time") scaling uses ``s = R / amax`` of the present tensor, which
needs an extra pass over it before the cast. Both are pure state machines over explicit states.

References:
    NVIDIA Transformer Engine, ``DelayedScaling`` recipe (``amax_history_len``,
    ``amax_compute_algo``, ``margin``); specs.md §14 [S-docs].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.emulation import fp8_max

__all__ = [
    "DelayedScalingState",
    "current_scale",
    "init_delayed_scaling",
    "update_delayed_scaling",
]


class DelayedScalingState(NamedTuple):
    """Delayed-scaling (Transformer Engine) state.

    Attributes:
        count: scalar int32, number of updates.
        amax_history: ``(history_len, *shape)``; row 0 is the most recent ``amax``.
        scale: ``(*shape)`` the scale to use at the next step.
    """

    count: jax.Array
    amax_history: jax.Array
    scale: jax.Array


def init_delayed_scaling(
    shape: tuple[int, ...] = (), *, history_len: int = 1024, init_scale: float = 1.0
) -> DelayedScalingState:
    """Fresh delayed-scaling state: zero history and scale ``init_scale`` (TE default 1).

    Args:
        shape: shape of the scales (``()`` per tensor, ``(L, H)`` per layer and head).
        history_len: length of the ``amax`` history (TE: 1024 now, 1 in old releases).
        init_scale: scale used before any ``amax`` has been recorded.

    Returns:
        ``DelayedScalingState``.

    Raises:
        ValueError: if ``history_len < 1`` or ``init_scale <= 0``.
    """
    if int(history_len) < 1:
        raise ValueError(f"history_len must be >= 1, got {history_len}.")
    if not init_scale > 0:
        raise ValueError(f"init_scale must be positive, got {init_scale}.")
    shape = tuple(int(s) for s in shape)
    return DelayedScalingState(
        count=jnp.zeros((), jnp.int32),
        amax_history=jnp.zeros((int(history_len), *shape), jnp.float32),
        scale=jnp.full(shape, init_scale, jnp.float32),
    )


def update_delayed_scaling(
    state: DelayedScalingState,
    amax: jax.typing.ArrayLike,
    *,
    fmt: str = "e4m3",
    margin: float = 0.0,
    algo: str = "max",
) -> DelayedScalingState:
    """Record this step's ``amax`` and compute the scale for the next step.

    ``history ← [amax, history[:-1]]``; ``a = max(history)`` (``algo="max"``) or ``history[0]``
    (``"most_recent"``); ``scale ← R / a / 2^margin`` where ``a`` is positive and finite, else the
    previous scale (Transformer Engine's rule). The scale *used* at step ``t`` is the one in the
    state before the update with step ``t``'s ``amax``: it never sees the current activations.

    Args:
        state: current state.
        amax: ``(*shape)`` observed ``max|x|`` at this step (unscaled).
        fmt: FP8 format giving ``R``.
        margin: safety exponent (``2^margin`` head-room).
        algo: ``"max"`` or ``"most_recent"``.

    Returns:
        New ``DelayedScalingState``.

    Raises:
        ValueError: on an unknown ``algo`` or an ``amax`` of the wrong shape.

    References:
        NVIDIA Transformer Engine, ``DelayedScaling`` recipe; specs.md §14 [S-docs].

    Example:
        >>> st = init_delayed_scaling((2,), history_len=16)
        >>> st = update_delayed_scaling(st, jnp.array([3.0, 40.0]))  # st.scale = 448 / amax
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}.")
    amax = jnp.asarray(amax, jnp.float32)
    if amax.shape != state.scale.shape:
        raise ValueError(f"amax must have the scale's shape {state.scale.shape}, got {amax.shape}.")
    history = jnp.concatenate([amax[None], state.amax_history[:-1]], axis=0)
    a = jnp.max(history, axis=0) if algo == "max" else history[0]
    new = fp8_max(fmt) / a / 2.0**margin
    ok = (a > 0) & jnp.isfinite(a)
    scale = jnp.where(ok, new, state.scale)
    return DelayedScalingState(count=state.count + 1, amax_history=history, scale=scale)


def current_scale(
    amax: jax.typing.ArrayLike, *, fmt: str = "e4m3", margin: float = 0.0
) -> jax.Array:
    """Just-in-time ("current") scaling oracle: ``s = R / amax / 2^margin`` from this step's amax.

    Needs the activations of the current step before quantising them (an extra pass over the
    logits in a fused kernel); ``amax = 0`` gives scale 1.
    """
    amax = jnp.asarray(amax, jnp.float32)
    return jnp.where(amax > 0, fp8_max(fmt) / jnp.where(amax > 0, amax, 1.0) / 2.0**margin, 1.0)
