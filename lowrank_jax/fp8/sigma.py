"""Exact ``σ_max(W^Q_h W^{K⊤}_h)`` per head from the ``d_h × d_h`` core of thin QR factors.

For one head, ``A = W^Q_h`` and ``B = W^K_{g(h)}`` are ``d × d_h`` (``d_h ≪ d``). With thin QR
factorisations ``A = Q_A R_A`` and ``B = Q_B R_B`` (``Q`` with orthonormal columns, ``R``
``d_h × d_h``),

    A Bᵀ = Q_A (R_A R_Bᵀ) Q_Bᵀ,

and since ``Q_A``, ``Q_B`` are isometries, the singular values of the ``d × d`` product are those
of the ``d_h × d_h`` core ``C = R_A R_Bᵀ`` (plus zeros). So ``σ_max(A Bᵀ) = σ_max(C)`` exactly,
in ``O(d·d_h²)`` per head (the QRs) plus ``O(d_h³)`` (the core's SVD), never forming ``d × d``.
Under grouped-query attention each key head is factorised once and shared by its ``H/G`` query
heads (no key expansion). The top right singular vector is ``v = Q_B V_C[:, 0]``, an exact warm
start for the power-iteration tracker of :mod:`lowrank_jax.fp8.policies`.

QR is backward stable, so the result is accurate to a few float32 ulps relative to
``‖A‖‖B‖`` (unlike the Gram route ``σ² = λ_max(L_Bᵀ AᵀA L_B)``, which squares the condition).
This is the default for offline scales (:func:`attention_scales`: a checkpoint, inference); during
training a warm-started power step per step tracks ``σ`` at ``O(d·d_h)`` per head.

References:
    P14, arXiv 2602.18851 (σ_max of ``W^Q W^{K⊤}``); Golub & Van Loan, *Matrix Computations*,
    §5.2 (thin QR) — the core identity is standard linear algebra, not from the paper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrank_jax.fp8.scale_rule import ScaleRule

__all__ = ["attention_scales", "attention_sigma_max", "attention_top_singular", "split_heads"]


def split_heads(
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-head views ``(..., d, H, d_h)``, ``(..., d, G, d_h)`` of ordinary 2-D Q/K kernels.

    An ordinary model's query and key projections are ``Dense`` kernels ``(..., d, H·d_h)`` and
    ``(..., d, G·d_h)`` whose output columns are grouped by head (flax ``Dense``, BERT's
    ``query``/``key``, Hugging Face's ``q_proj``/``k_proj`` weights transposed): column
    ``h·d_h + j`` is entry ``j`` of head ``h``.

    Args:
      w_q: ``(..., d, H·d_h)`` query kernel (leading axes: layers).
      w_k: ``(..., d, G·d_h)`` key kernel.
      num_heads: ``H``.
      num_kv_heads: ``G`` (default ``H``; fewer for grouped-query attention).

    Returns:
      ``(w_q (..., d, H, d_h), w_k (..., d, G, d_h))``.

    Raises:
      ValueError: the widths are not ``H·d_h`` and ``G·d_h`` for one ``d_h``.
    """
    w_q, w_k = jnp.asarray(w_q), jnp.asarray(w_k)
    g = num_heads if num_kv_heads is None else num_kv_heads
    for name, n in (("num_heads", num_heads), ("num_kv_heads", g)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}.")
    if w_q.ndim < 2 or w_k.ndim != w_q.ndim or w_q.shape[-1] % num_heads:
        raise ValueError(
            f"w_q must be (..., d, H*d_h) with H={num_heads} dividing its last axis and w_k "
            f"(..., d, G*d_h) of the same rank; got {w_q.shape} and {w_k.shape}."
        )
    dh = w_q.shape[-1] // num_heads
    if w_k.shape[-1] != g * dh:
        raise ValueError(
            f"w_k's last axis must be G*d_h = {g}*{dh} = {g * dh} (num_kv_heads={g}, d_h from "
            f"w_q {w_q.shape} and num_heads={num_heads}); got {w_k.shape}."
        )
    return (
        w_q.reshape(*w_q.shape[:-1], num_heads, dh),
        w_k.reshape(*w_k.shape[:-1], g, dh),
    )


def _check(w_q, w_k) -> tuple[jax.Array, jax.Array, int, int]:
    w_q, w_k = jnp.asarray(w_q), jnp.asarray(w_k)
    if w_q.ndim < 3 or w_k.ndim != w_q.ndim or w_k.shape[:-3] != w_q.shape[:-3]:
        raise ValueError(
            "w_q must be (..., d, H, d_h) and w_k (..., d, G, d_h) with the same leading axes; got "
            f"{w_q.shape} and {w_k.shape}."
        )
    d, h, dh = w_q.shape[-3:]
    g = w_k.shape[-2]
    if w_k.shape[-3] != d or w_k.shape[-1] != dh or h % g:
        raise ValueError(
            f"w_k must be (..., d={d}, G, d_h={dh}) with H={h} a multiple of G; got {w_k.shape}."
        )
    dtype = jnp.promote_types(jnp.result_type(w_q, w_k), jnp.float32)
    return w_q.astype(dtype), w_k.astype(dtype), h, g


def _cores(w_q, w_k, h, g, *, want_q: bool):
    """``C`` ``(..., G, H/G, k, k)`` and (optionally) ``Q_B`` ``(..., G, d, k)``."""
    heads_first = lambda w: jnp.moveaxis(w, -2, -3)  # (..., H, d, d_h): one (d, d_h) per head
    r_q = jnp.linalg.qr(heads_first(w_q), mode="r")  # (..., H, k, d_h), k = min(d, d_h)
    if want_q:
        q_k, r_k = jnp.linalg.qr(
            heads_first(w_k), mode="reduced"
        )  # (..., G, d, k), (..., G, k, d_h)
    else:
        q_k, r_k = None, jnp.linalg.qr(heads_first(w_k), mode="r")
    lead = r_q.shape[:-3]
    r_q = r_q.reshape(*lead, g, h // g, *r_q.shape[-2:])
    core = r_q @ jnp.swapaxes(r_k, -1, -2)[..., None, :, :]  # R_A R_Bᵀ, keys shared in a group
    return core, q_k


def attention_sigma_max(w_q: jax.typing.ArrayLike, w_k: jax.typing.ArrayLike) -> jax.Array:
    """Exact per-head ``σ_max(W^Q_h W^{K⊤}_{g(h)})`` by the thin-QR core, GQA without key expansion.

    Args:
        w_q: ``(..., d, H, d_h)`` query kernels (leading axes: layers).
        w_k: ``(..., d, G, d_h)`` key kernels, ``H % G == 0``; query head ``h`` uses key head
            ``h // (H/G)``.

    Returns:
        ``(..., H)`` top singular values (float32, or the inputs' wider float dtype).

    Raises:
        ValueError: on inconsistent shapes.

    Example:
        >>> sigma = attention_sigma_max(wq, wk)  # wq (80, 8192, 64, 128), wk (80, 8192, 8, 128)
    """
    w_q, w_k, h, g = _check(w_q, w_k)
    core, _ = _cores(w_q, w_k, h, g, want_q=False)
    s = jnp.linalg.svd(core, compute_uv=False)[..., 0]
    return s.reshape(*s.shape[:-2], h)


def attention_top_singular(
    w_q: jax.typing.ArrayLike, w_k: jax.typing.ArrayLike
) -> tuple[jax.Array, jax.Array]:
    """Exact ``σ_max`` and unit top right singular vector ``v`` of every head's ``W^Q_h W^{K⊤}``.

    ``v = Q_B V_C[:, 0]`` lies in ``R^d``; it is the fixed point of the power iteration on
    ``MᵀM``, so it is an exact start for a
    :class:`~lowrank_jax.fp8.policies.GeometryScalingState`.

    Args:
        w_q: ``(..., d, H, d_h)`` query kernels.
        w_k: ``(..., d, G, d_h)`` key kernels.

    Returns:
        ``(sigma (..., H), v (..., H, d))``.

    Raises:
        ValueError: on inconsistent shapes.
    """
    w_q, w_k, h, g = _check(w_q, w_k)
    core, q_k = _cores(w_q, w_k, h, g, want_q=True)
    _, s, vt = jnp.linalg.svd(core, full_matrices=False)  # vt (..., G, m, k, k)
    v = jnp.einsum("...gdk,...gmk->...gmd", q_k, vt[..., 0, :])  # Q_B V_C[:, 0] per head
    lead = s.shape[:-3]
    return s[..., 0].reshape(*lead, h), v.reshape(*lead, h, v.shape[-1])


def attention_scales(
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    rule: ScaleRule,
    norm_gain: jax.typing.ArrayLike = 1.0,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> jax.Array:
    """Offline geometry-aware FP8 scales ``(..., H)`` from exact ``σ`` (the default offline route).

    ``rule.scales(σ)`` (``s = c R √d_h / (g² σ_max √(γ r log(2n²/δ)))``) with ``σ_max`` from
    :func:`attention_sigma_max`; for scales during training use a
    :func:`~lowrank_jax.fp8.policies.geometry_scaling_policy` of the same rule (one power step
    per step).

    Args:
        w_q: ``(..., d, H, d_h)`` query kernels, or an ordinary model's ``(..., d, H·d_h)`` with
            ``num_heads`` (see :func:`split_heads`).
        w_k: ``(..., d, G, d_h)`` key kernels, or ``(..., d, G·d_h)`` with ``num_heads``.
        rule: the scale rule's knobs (:class:`~lowrank_jax.fp8.scale_rule.ScaleRule`).
        norm_gain: effective gain of the norm feeding each layer, broadcastable to ``(..., 1)``
            (e.g. ``gains[:, None]`` for ``(L,)`` gains) or to ``(..., H)``.
        num_heads: ``H`` when the kernels are 2-D per layer (``Dense``/``q_proj``-style).
        num_kv_heads: ``G`` for such kernels (default ``num_heads``).

    Returns:
        float32 scales ``(..., H)``.

    Raises:
        ValueError: on inconsistent shapes.

    References:
        P14 (arXiv 2602.18851); reconstruction of the scale rule in specs.md §14.
    """
    if num_heads is not None:
        w_q, w_k = split_heads(w_q, w_k, num_heads=num_heads, num_kv_heads=num_kv_heads)
    elif num_kv_heads is not None:
        raise ValueError("num_kv_heads needs num_heads (for 2-D kernels (..., d, H*d_h)).")
    sigma = attention_sigma_max(w_q, w_k)
    d, _, dh = jnp.shape(w_q)[-3:]
    return rule.scales(sigma, d=d, head_dim=dh, norm_gain=norm_gain)
