"""Truncated SVD: the one place where the library takes top singular triplets under ``jit``.

* :func:`truncated_svd`: the exact top-``k`` triplets ``(U_k, s_k, V_kᵀ)`` (batched over leading
  axes), and :func:`lowrank_approximation`, the best rank-``k`` approximation (Eckart–Young),
  optionally hard-thresholded (SVT).
* :func:`balanced_factors`: ``(U_k √S_k, √S_k V_kᵀ)``, the LoRA-shaped factors of ``[A]_k``
  (PiSSA, merged task vectors, CASA's transported updates).
* :func:`product_svd`: the top triplets of ``A Bᵀ`` from its factors, never forming the product.
* :func:`left_singular`: left singular vectors of a very wide matrix that survive LAPACK's
  divide-and-conquer failures (the GPM memories' activations).
* :func:`randomized_svd`: the Halko–Martinsson–Tropp range finder for a large matrix.

Host-side float64 analyses on NumPy arrays (principal components of embeddings, subspace
diagnostics) call ``np.linalg.svd`` directly.

References:
    C. Eckart, G. Young, "The approximation of one matrix by another of lower rank",
    Psychometrika 1(3), 1936. N. Halko, P.-G. Martinsson, J. A. Tropp, "Finding structure with
    randomness: probabilistic algorithms for constructing approximate matrix decompositions",
    SIAM Review 53(2), 2011, Algorithms 4.4 (randomised subspace iteration) and 5.1 (direct SVD).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "balanced_factors",
    "left_singular",
    "lowrank_approximation",
    "product_svd",
    "randomized_svd",
    "truncated_svd",
]


def _check_rank(rank: int, m: int, n: int) -> int:
    if not isinstance(rank, int) or not 1 <= rank <= min(m, n):
        raise ValueError(
            f"rank must be an int in [1, {min(m, n)}] for a ({m}, {n}) matrix, got {rank!r}."
        )
    return rank


def truncated_svd(a: jax.typing.ArrayLike, *, rank: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top-``rank`` singular triplets of ``a`` (``(..., m, n)``), by an exact SVD.

    Returns:
      ``(u (..., m, k), s (..., k), vt (..., k, n))``, ``s`` descending.

    Raises:
      ValueError: ``a`` has fewer than 2 axes or ``rank`` is not in ``[1, min(m, n)]``.
    """
    a = jnp.asarray(a)
    if a.ndim < 2:
        raise ValueError(f"a must be a (..., m, n) matrix, got shape {a.shape}.")
    k = _check_rank(rank, *a.shape[-2:])
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    return u[..., :k], s[..., :k], vt[..., :k, :]


def lowrank_approximation(
    a: jax.typing.ArrayLike, *, rank: int, threshold: jax.typing.ArrayLike | None = None
) -> jax.Array:
    """``U_k S_k V_kᵀ``, the best rank-``k`` approximation of ``a`` (``(..., m, n)``).

    With ``threshold`` (broadcast to ``a``'s batch axes), the hard SVT: of the top ``k``, only the
    singular values ``> threshold`` are kept.
    """
    u, s, vt = truncated_svd(a, rank=rank)
    if threshold is not None:
        s = jnp.where(s > jnp.asarray(threshold)[..., None], s, 0.0)
    return jnp.einsum("...pr,...r,...rl->...pl", u, s, vt)


def balanced_factors(
    a: jax.typing.ArrayLike, *, rank: int, scale: jax.typing.ArrayLike = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Factors ``(U_k √(S_k/c), √(S_k/c) V_kᵀ)`` of ``a`` (``(..., m, n)``) with ``c = scale``.

    ``scale · x @ y`` is the truncated SVD ``[a]_k``, split evenly between the factors: the LoRA
    factors of a rank-``k`` update whose adapter multiplies by ``scale``.

    Returns:
      ``(x (..., m, k), y (..., k, n))``.
    """
    u, s, vt = truncated_svd(a, rank=rank)
    root = jnp.sqrt(s / scale)
    return u * root[..., None, :], root[..., :, None] * vt


def product_svd(
    a: jax.typing.ArrayLike, b: jax.typing.ArrayLike, *, rank: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top-``rank`` singular triplets of ``a @ bᵀ`` (``a: (m, q)``, ``b: (n, q)``).

    By QR of both factors and the SVD of the ``q × q`` core ``R_a R_bᵀ``: ``O((m + n) q²)``, the
    ``(m, n)`` product is never formed. ``rank`` may not exceed ``min(m, n, q)``.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a (m, q) and b (n, q) must share q, got {a.shape} and {b.shape}.")
    _check_rank(rank, min(a.shape[0], a.shape[1]), min(b.shape[0], b.shape[1]))
    qa, ra = jnp.linalg.qr(a)
    qb, rb = jnp.linalg.qr(b)
    u, s, vt = truncated_svd(ra @ rb.T, rank=rank)
    return qa @ u, s, vt @ qb.T


def left_singular(r: jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
    r"""Left singular vectors and values of ``R: (n, b)``: ``(U (n, p), σ (p,))``, ``p = min(n, b)``.

    ``jnp.linalg.svd``, except where LAPACK's divide-and-conquer SVD of a very wide float32
    matrix (``b ≫ n``: many activations of an ``n``-wide layer) fails to converge and returns
    NaNs: then the eigendecomposition of the ``n × n`` Gram matrix ``RRᵀ = U diag(σ²) Uᵀ`` is
    used (singular values below ``√ε·σ₀`` lose relative precision that way; the energy criteria
    that use them do not care). Values are sorted in decreasing order. Jittable.
    """
    r = jnp.asarray(r)
    n, b = r.shape
    u, s, _ = jnp.linalg.svd(r, full_matrices=False)
    if b <= n:
        return u, s
    evals, evecs = jnp.linalg.eigh(r @ r.T)
    ok = jnp.all(jnp.isfinite(s)) & jnp.all(jnp.isfinite(u))
    u = jnp.where(ok, u, evecs[:, ::-1])
    s = jnp.where(ok, s, jnp.sqrt(jnp.maximum(evals[::-1], 0.0)))
    return u, s


def randomized_svd(
    key: jax.Array,
    a: jax.typing.ArrayLike,
    *,
    rank: int,
    oversample: int = 10,
    num_power_iters: int = 2,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rank-``k`` truncated SVD of ``a`` by a randomised range finder with subspace iteration.

    With ``l = min(k + p, m, n)``, ``Ω ~ N(0, 1)^{n×l}``:
    ``Q₀ = qr(A Ω)``; ``Q_{i+1} = qr(A qr(Aᵀ Q_i))`` for ``i < q``; ``B = Q_qᵀ A``;
    ``B = Ũ diag(s) Vᵀ``; return ``(Q_q Ũ)[:, :k], s[:k], Vᵀ[:k]``. The expected error satisfies
    ``E‖A − U diag(s) Vᵀ‖ ≤ (1 + 4√(l) √min(m,n)/(p−1))^{1/(2q+1)} σ_{k+1}`` (HMT Cor. 10.10).

    Args:
        key: PRNG key for the Gaussian test matrix.
        a: ``(m, n)`` matrix (batch with ``jax.vmap``).
        rank: number ``k`` of singular triplets, ``1 <= k <= min(m, n)``.
        oversample: extra sketch columns ``p >= 0``.
        num_power_iters: subspace-iteration steps ``q >= 0``.

    Returns:
        ``(u, s, vt)`` with shapes ``(m, k)``, ``(k,)``, ``(k, n)``; ``s`` descending,
        ``u`` and ``vt`` with orthonormal columns / rows. Float32 unless ``a`` is wider.

    Raises:
        ValueError: if ``a`` is not 2-D, ``rank`` is out of range or a knob is negative.
        TypeError: if ``a`` is not a floating-point array.

    References:
        Halko, Martinsson, Tropp (2011), Algorithms 4.4 and 5.1.

    Example:
        >>> a = jax.random.normal(jax.random.key(0), (300, 200))
        >>> u, s, vt = randomized_svd(jax.random.key(1), a, rank=10)
    """
    a = jnp.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"a must be a 2-D matrix, got shape {a.shape}; batch with jax.vmap.")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"a must be a floating-point array, got dtype {a.dtype}.")
    m, n = a.shape
    if not 1 <= int(rank) <= min(m, n):
        raise ValueError(f"rank must be in [1, min(m, n)] = [1, {min(m, n)}], got {rank}.")
    if int(oversample) < 0 or int(num_power_iters) < 0:
        raise ValueError(
            f"oversample and num_power_iters must be >= 0, got {oversample}, {num_power_iters}."
        )
    k = int(rank)
    ell = min(k + int(oversample), m, n)
    dtype = jnp.promote_types(a.dtype, jnp.float32)
    a = a.astype(dtype)
    omega = jax.random.normal(key, (n, ell), dtype)
    q, _ = jnp.linalg.qr(a @ omega)
    for _ in range(int(num_power_iters)):
        z, _ = jnp.linalg.qr(a.T @ q)
        q, _ = jnp.linalg.qr(a @ z)
    b = q.T @ a  # (l, n)
    ub, s, vt = jnp.linalg.svd(b, full_matrices=False)
    return (q @ ub)[:, :k], s[:k], vt[:k]
