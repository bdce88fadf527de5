"""Implicit power iteration for the top singular value of a product of factors.

For a matrix given as a product of thin factors, ``M = A Bᵀ`` with ``A ∈ R^{m×r}``, ``B ∈ R^{n×r}``
(attention: ``M = W^Q W^{K⊤}``, ``m = n = d``, ``r = d_h``), the power iteration on ``MᵀM``

    v ← B (Aᵀ (A (Bᵀ v))),   σ ≈ √‖B Aᵀ A Bᵀ v‖,   v ← v / ‖v‖

costs ``O((m + n)·r)`` per step and never forms the ``m×n`` matrix. The state (the current right
singular vector estimate) is explicit so it can be carried across training steps: weights move
little per step, so one warm-started iteration per step tracks σ.

The attention front end works per head and handles grouped-query attention (GQA) without
repeating keys: the ``H`` query heads are viewed as ``(G, H/G)`` and each group shares its key
head through ``vmap(..., in_axes=None)``, which batches the query side only.

References:
    P14, "Rank-Aware Spectral Bounds on Attention Logits for Stable Low-Precision Training"
    (Emadi, arXiv 2602.18851), implicit power iteration and GQA formulation; specs.md §14.
    The exact iteration of the paper is not public; this is the reconstruction of specs.md §14.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "PowerIterationState",
    "attention_group_power_iteration",
    "attention_power_iteration",
    "init_attention_power_iteration",
    "init_power_iteration",
    "product_power_iteration",
]

_TINY = 1e-30


class PowerIterationState(NamedTuple):
    """State of a (batched) implicit power iteration.

    Attributes:
        v: ``(..., n)`` unit right-singular-vector estimates, one per matrix in the batch.
        sigma: ``(...)`` current estimates of the top singular value (lower bounds, see
            :func:`product_power_iteration`).
        count: scalar int32, number of iterations performed so far.
    """

    v: jax.Array
    sigma: jax.Array
    count: jax.Array


def init_power_iteration(
    key: jax.Array, batch_shape: tuple[int, ...], n: int
) -> PowerIterationState:
    """Random unit start vectors for ``prod(batch_shape)`` power iterations in ``R^n``.

    Args:
        key: PRNG key.
        batch_shape: leading shape of the batch of matrices (``()`` for one matrix).
        n: dimension of the right singular vectors (the number of columns of ``M``).

    Returns:
        ``PowerIterationState`` with ``v`` of shape ``(*batch_shape, n)``, ``sigma`` zeros and
        ``count`` 0.

    Raises:
        ValueError: if ``n < 1``.
    """
    if int(n) < 1:
        raise ValueError(f"n must be a positive dimension, got {n}.")
    batch_shape = tuple(int(b) for b in batch_shape)
    v = jax.random.normal(key, (*batch_shape, int(n)), jnp.float32)
    v = v / jnp.linalg.norm(v, axis=-1, keepdims=True)
    return PowerIterationState(
        v=v, sigma=jnp.zeros(batch_shape, jnp.float32), count=jnp.zeros((), jnp.int32)
    )


def _step(a: jax.Array, b: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One power step on ``MᵀM`` for ``M = a bᵀ``; returns ``(v_new, sigma)``."""
    w = b @ (a.T @ (a @ (b.T @ v)))  # MᵀM v, O((m + n) r)
    norm = jnp.linalg.norm(w)
    # A zero product (e.g. zero weights) keeps the previous direction instead of producing NaN.
    v_new = jnp.where(norm > _TINY, w / jnp.maximum(norm, _TINY), v)
    return v_new, jnp.sqrt(norm)


def _lanczos(a: jax.Array, b: jax.Array, v: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """Golub–Kahan–Lanczos bidiagonalisation of ``M = a bᵀ`` from ``v``; ``(σ̂, Ritz vector)``."""
    m, n = a.shape[0], b.shape[0]
    dtype = v.dtype
    vs = jnp.zeros((steps + 1, n), dtype).at[0].set(v / jnp.maximum(jnp.linalg.norm(v), _TINY))
    us = jnp.zeros((steps, m), dtype)
    alphas = jnp.zeros((steps,), dtype)
    betas = jnp.zeros((steps + 1,), dtype)

    eps = 1e3 * jnp.finfo(dtype).eps  # below eps·max(α) a new direction is rounding noise

    def body(j, carry):
        vs, us, alphas, betas = carry
        u = a @ (b.T @ vs[j]) - betas[j] * us[j - 1]  # us[-1] is zero while j = 0
        u = u - us.T @ (us @ u)  # full re-orthogonalisation (rows >= j are still zero)
        alpha = jnp.linalg.norm(u)
        scale = jnp.maximum(jnp.max(alphas), alpha)
        # Breakdown (the Krylov space is exhausted, e.g. after rank(M) steps): zero vectors and
        # coefficients from here on, so the bidiagonal keeps the exact singular values.
        alpha = jnp.where(alpha > eps * scale, alpha, 0.0)
        u = jnp.where(alpha > 0, u / jnp.maximum(alpha, _TINY), 0.0)
        w = b @ (a.T @ u) - alpha * vs[j]
        w = w - vs.T @ (vs @ w)
        beta = jnp.linalg.norm(w)
        beta = jnp.where(beta > eps * scale, beta, 0.0)
        vs = vs.at[j + 1].set(jnp.where(beta > 0, w / jnp.maximum(beta, _TINY), 0.0))
        return vs, us.at[j].set(u), alphas.at[j].set(alpha), betas.at[j + 1].set(beta)

    vs, us, alphas, betas = jax.lax.fori_loop(0, steps, body, (vs, us, alphas, betas))
    # U_kᵀ M V_{k+1} = B: upper bidiagonal k×(k+1), diagonal α_j, super-diagonal β_{j+1}.
    bidiag = jnp.zeros((steps, steps + 1), dtype)
    idx = jnp.arange(steps)
    bidiag = bidiag.at[idx, idx].set(alphas).at[idx, idx + 1].set(betas[1:])
    _, s, vt = jnp.linalg.svd(bidiag, full_matrices=False)
    ritz = vt[0] @ vs
    norm = jnp.linalg.norm(ritz)
    return s[0], jnp.where(norm > _TINY, ritz / jnp.maximum(norm, _TINY), v)


def _check_factors(a: jax.Array, b: jax.Array) -> None:
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(
            f"a and b must be 2-D factors of M = a @ b.T, got shapes {a.shape} and {b.shape}; "
            "batch with jax.vmap."
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a and b must share their inner dimension r, got {a.shape} and {b.shape}."
        )


def product_power_iteration(
    a: jax.typing.ArrayLike,
    b: jax.typing.ArrayLike,
    v: jax.typing.ArrayLike,
    *,
    num_iters: int = 1,
    method: str = "power",
) -> tuple[jax.Array, jax.Array]:
    """Top singular value of ``M = a @ b.T`` by implicit power iteration (or Lanczos).

    Iterates ``v ← MᵀM v / ‖MᵀM v‖`` with ``MᵀM v = b (aᵀ (a (bᵀ v)))`` and returns
    ``σ̂ = √‖MᵀM v‖`` of the last step. For unit ``v``, ``σ̂ ≤ σ_max(M)`` (a lower bound that
    increases monotonically to ``σ_max`` when ``v`` is not orthogonal to the top right singular
    vector); the relative error after ``k`` steps decays like ``(σ₂/σ₁)^{4k}`` weighted by the
    start vector's components.

    ``method="lanczos"`` runs ``num_iters`` steps of Golub–Kahan–Lanczos bidiagonalisation with
    full re-orthogonalisation instead, from the same start vector and at the same 4 products per
    step, and returns ``σ_max`` of the ``k×(k+1)`` bidiagonal ``U_kᵀ M V_{k+1}`` (also a lower
    bound) and its Ritz vector. It converges much faster when the top singular values cluster
    (random-like weights: roughly ``exp(−2k√gap)`` instead of ``exp(−2k·gap)``); use it for cold
    starts and the plain power step for the warm-started one-step-per-training-step tracking.
    Its workspace is ``O(k (m + n))``.

    Args:
        a: ``(m, r)`` left factor (e.g. ``W^Q`` of one head, ``(d, d_h)``).
        b: ``(n, r)`` right factor (e.g. ``W^K`` of one head).
        v: ``(n,)`` start vector (unit norm; a warm start from the previous call).
        num_iters: number of power (or Lanczos) steps (``>= 1``).
        method: ``"power"`` or ``"lanczos"``.

    Returns:
        ``(sigma, v)``: scalar estimate of ``σ_max(a bᵀ)`` and the ``(n,)`` unit vector after the
        last step (pass it back as the warm start). Computed in float32 (or the inputs' wider
        float dtype).

    Raises:
        ValueError: on non-2-D factors, mismatched shapes or ``num_iters < 1``.

    References:
        P14 (arXiv 2602.18851), implicit power iteration; reconstruction in specs.md §14.

    Example:
        >>> a = jax.random.normal(jax.random.key(0), (256, 16))
        >>> b = jax.random.normal(jax.random.key(1), (256, 16))
        >>> v0 = jnp.ones(256) / 16.0
        >>> sigma, v = product_power_iteration(a, b, v0, num_iters=50)
    """
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    v = jnp.asarray(v)
    _check_factors(a, b)
    if v.shape != (b.shape[0],):
        raise ValueError(f"v must have shape ({b.shape[0]},) = (b.shape[0],), got {v.shape}.")
    if int(num_iters) < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}.")
    if method not in ("power", "lanczos"):
        raise ValueError(f"method must be 'power' or 'lanczos', got {method!r}.")
    dtype = jnp.promote_types(jnp.result_type(a, b, v), jnp.float32)
    a, b, v = a.astype(dtype), b.astype(dtype), v.astype(dtype)
    if method == "lanczos":
        return _lanczos(a, b, v, int(num_iters))

    def body(carry, _):
        v, _ = carry
        return _step(a, b, v), None

    (v, sigma), _ = jax.lax.scan(body, (v, jnp.zeros((), dtype)), None, length=int(num_iters))
    return sigma, v


def _check_attention(w_q: jax.Array, w_k: jax.Array) -> tuple[int, int, int, int]:
    if w_q.ndim != 3 or w_k.ndim != 3:
        raise ValueError(
            "w_q must be (d, H, d_h) and w_k (d, G, d_h) (per-head projection kernels); got "
            f"shapes {w_q.shape} and {w_k.shape}. Reshape a (d, H*d_h) kernel with "
            "w.reshape(d, H, d_h); batch layers with jax.vmap."
        )
    d, h, dh = w_q.shape
    if w_k.shape[0] != d or w_k.shape[2] != dh:
        raise ValueError(f"w_k must be (d={d}, G, d_h={dh}), got {w_k.shape}.")
    g = w_k.shape[1]
    if g < 1 or h % g:
        raise ValueError(
            f"The number of query heads H={h} must be a multiple of the number of key/value "
            f"heads G={g} (GQA)."
        )
    return d, h, g, dh


def init_attention_power_iteration(
    key: jax.Array, w_q: jax.typing.ArrayLike
) -> PowerIterationState:
    """Start state for :func:`attention_power_iteration`: one unit vector in ``R^d`` per head.

    Args:
        key: PRNG key.
        w_q: ``(d, H, d_h)`` query kernel (only its shape is used).

    Returns:
        ``PowerIterationState`` with ``v`` ``(H, d)`` and ``sigma`` ``(H,)``.

    Raises:
        ValueError: if ``w_q`` is not 3-D.
    """
    shape = jnp.shape(w_q)
    if len(shape) != 3:
        raise ValueError(f"w_q must be (d, H, d_h), got shape {shape}.")
    d, h, _ = shape
    return init_power_iteration(key, (h,), d)


def attention_power_iteration(
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    state: PowerIterationState,
    *,
    num_iters: int = 1,
    method: str = "power",
) -> tuple[jax.Array, PowerIterationState]:
    """Per-head ``σ_max(W^Q_h W^{K⊤}_{g(h)})`` for (grouped-query) attention, warm-started.

    Query head ``h`` attends with key head ``g(h) = h // (H/G)`` (the GQA grouping of
    Llama/Mistral: consecutive query heads share a key head). The keys are not repeated: the
    query heads are reshaped to ``(G, H/G)`` and ``vmap`` over the inner axis passes the
    group's ``(d, d_h)`` key kernel unbatched. Memory is ``O(d·d_h)`` per head.

    Args:
        w_q: ``(d, H, d_h)`` query kernel of one layer.
        w_k: ``(d, G, d_h)`` key kernel of the same layer, ``H % G == 0`` (``G = H`` for MHA).
        state: state from :func:`init_attention_power_iteration` or a previous call
            (``v`` ``(H, d)``).
        num_iters: power steps this call (1 per training step suffices when warm-started).
        method: ``"power"`` or ``"lanczos"`` (for cold starts, see
            :func:`product_power_iteration`).

    Returns:
        ``(sigma, state)``: ``(H,)`` float32 estimates (lower bounds converging to the true top
        singular values) and the new state. For a stack of layers use
        ``jax.vmap(attention_power_iteration)`` over ``(L, d, H, d_h)`` kernels and states.

    Raises:
        ValueError: on inconsistent shapes.

    References:
        P14 (arXiv 2602.18851), GQA formulation without key expansion; reconstruction in
        specs.md §14.

    Example:
        >>> wq = jax.random.normal(jax.random.key(0), (512, 8, 64)) / 512**0.5
        >>> wk = jax.random.normal(jax.random.key(1), (512, 2, 64)) / 512**0.5
        >>> st = init_attention_power_iteration(jax.random.key(2), wq)
        >>> sigma, st = attention_power_iteration(wq, wk, st, num_iters=30)  # sigma: (8,)
    """
    w_q = jnp.asarray(w_q)
    w_k = jnp.asarray(w_k)
    d, h, g, dh = _check_attention(w_q, w_k)
    if state.v.shape != (h, d):
        raise ValueError(
            f"state.v must have shape (H, d) = ({h}, {d}), got {state.v.shape}; initialise it "
            "with init_attention_power_iteration(key, w_q)."
        )
    m = h // g
    wq_groups = w_q.reshape(d, g, m, dh)  # a free reshape: no copy, no transpose of the weights
    v = state.v.reshape(g, m, d)

    def per_head(a, b, v):
        return product_power_iteration(a, b, v, num_iters=num_iters, method=method)

    # Inner vmap: query heads of a group share the group's key kernel (in_axes=None: no repeat).
    per_group = jax.vmap(per_head, in_axes=(1, None, 0))
    sigma, v = jax.vmap(per_group, in_axes=(1, 1, 0))(wq_groups, w_k, v)
    sigma = sigma.reshape(h)
    new_state = PowerIterationState(
        v=v.reshape(state.v.shape), sigma=sigma, count=state.count + jnp.int32(num_iters)
    )
    return sigma, new_state


def attention_group_power_iteration(
    w_q: jax.typing.ArrayLike,
    w_k: jax.typing.ArrayLike,
    state: PowerIterationState,
    *,
    num_iters: int = 1,
) -> tuple[jax.Array, PowerIterationState]:
    """One ``σ`` per GQA group: the stacked-heads bound ``σ_max([M_h]_{h∈g})``.

    For KV group ``g`` with query heads ``h ∈ g``, stacks ``M_h = W^Q_h W^{K⊤}_g`` vertically,
    ``M_g = [M_{h₁}; …; M_{h_m}] ∈ R^{md×d}``, and returns ``σ_max(M_g)``, which satisfies
    ``max_h σ(M_h) ≤ σ_max(M_g) ≤ √m · max_h σ(M_h)``. ``M_gᵀM_g v = W^K_g Σ_h W^{Q⊤}_h W^Q_h
    W^{K⊤}_g v``, i.e. a product of factors with left factor the group's query heads concatenated
    along ``d_h`` and right factor ``W^K_g`` tiled — evaluated without tiling or repeating keys.
    One vector per group: ``H/G`` times less state than :func:`attention_power_iteration`.

    Args:
        w_q: ``(d, H, d_h)`` query kernel.
        w_k: ``(d, G, d_h)`` key kernel, ``H % G == 0``.
        state: ``v`` ``(G, d)`` (``init_power_iteration(key, (G,), d)``).
        num_iters: power steps this call.

    Returns:
        ``(sigma, state)`` with ``sigma`` ``(G,)``, a conservative (larger) per-group value.

    Raises:
        ValueError: on inconsistent shapes.

    References:
        P14 (arXiv 2602.18851); the "stack the group's query heads" option of specs.md §14
        (reconstruction).
    """
    w_q = jnp.asarray(w_q)
    w_k = jnp.asarray(w_k)
    d, h, g, dh = _check_attention(w_q, w_k)
    if state.v.shape != (g, d):
        raise ValueError(
            f"state.v must have shape (G, d) = ({g}, {d}), got {state.v.shape}; initialise it "
            "with init_power_iteration(key, (G,), d)."
        )
    if int(num_iters) < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}.")
    m = h // g
    dtype = jnp.promote_types(jnp.result_type(w_q, w_k), jnp.float32)
    wq = jnp.moveaxis(w_q.reshape(d, g, m, dh), 1, 0).astype(dtype)  # (G, d, m, d_h)
    wk = jnp.moveaxis(w_k, 1, 0).astype(dtype)  # (G, d, d_h)

    def group_step(wq_g, wk_g, v):
        t = wk_g.T @ v  # (d_h,)
        u = jnp.einsum("dmk,k->md", wq_g, t)  # M_h v for each head, (m, d)
        w = wk_g @ jnp.einsum("dmk,md->k", wq_g, u)  # Σ_h M_hᵀ M_h v
        norm = jnp.linalg.norm(w)
        return jnp.where(norm > _TINY, w / jnp.maximum(norm, _TINY), v), jnp.sqrt(norm)

    def body(carry, _):
        v, _ = carry
        return jax.vmap(group_step)(wq, wk, v), None

    init = (state.v.astype(dtype), jnp.zeros((g,), dtype))
    (v, sigma), _ = jax.lax.scan(body, init, None, length=int(num_iters))
    return sigma, PowerIterationState(v=v, sigma=sigma, count=state.count + jnp.int32(num_iters))
