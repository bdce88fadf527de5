"""Randomised truncated SVD (Halko, Martinsson and Tropp, 2011).

``A ≈ U diag(s) Vᵀ`` of rank ``k`` from a Gaussian sketch ``Y = (A Aᵀ)^q A Ω`` with
``Ω ∈ R^{n×(k+p)}``: orthonormalise ``Q = qr(Y)``, take the exact SVD of the small matrix
``B = Qᵀ A = Ũ s Vᵀ`` and lift ``U = Q Ũ``. Each power step is re-orthonormalised (subspace
iteration), so ``q`` steps sharpen the spectrum decay to ``(σ_{k+1}/σ_k)^{2q+1}`` without losing
precision in float32. Cost ``O(mn(k+p)(2q+1))``; never forms an ``m×m`` or ``n×n`` matrix.

References:
    N. Halko, P.-G. Martinsson, J. A. Tropp, "Finding structure with randomness: probabilistic
    algorithms for constructing approximate matrix decompositions", SIAM Review 53(2), 2011,
    Algorithms 4.4 (randomised subspace iteration) and 5.1 (direct SVD).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["randomized_svd"]


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
