"""Gaussian Johnson–Lindenstrauss projection of gradient features, generated blockwise from a key.

``x ↦ x R`` with ``R ∈ R^{D×d}``, ``R_ij ~ N(0, 1/d)`` i.i.d., so ``E[⟨xR, yR⟩] = ⟨x, y⟩`` and, for
``d ≳ ε⁻² log N``, all pairwise inner products of ``N`` vectors are kept to ``±ε‖x‖‖y‖`` with high
probability. ``R`` is never stored: its rows are drawn in blocks of ``block_size`` from
``fold_in(key, block)`` inside a ``lax.scan``, so projecting ``D``-dim gradients to ``d`` needs
``O(block_size·d)`` memory, and the same key gives the same ``R`` for the pool and the
validation set (as TRAK's/LESS's seeded projector).

References:
  Johnson & Lindenstrauss 1984; Park et al. 2023, TRAK (the projector LESS uses; its default is
  a Rademacher matrix, Gaussian here as specs §11 asks); Xia et al. 2024, LESS (d = 8192).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["jl_matrix", "jl_project"]


def _check(dim: int, block_size: int) -> None:
    for name, v in (("dim", dim), ("block_size", block_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}.")


def _block(key: jax.Array, j: jax.Array, block_size: int, dim: int, dtype) -> jax.Array:
    r = jax.random.normal(jax.random.fold_in(key, j), (block_size, dim), dtype)
    return r / jnp.sqrt(jnp.asarray(dim, dtype))


def jl_matrix(
    num_features: int, *, key: jax.Array, dim: int, block_size: int = 4096, dtype=jnp.float32
) -> jax.Array:
    """The ``(D, d)`` matrix ``R`` that :func:`jl_project` applies (for tests and small ``D``).

    Args:
      num_features: ``D``.
      key: PRNG key of the projection.
      dim: ``d``.
      block_size: rows generated per block (must equal the one given to :func:`jl_project`).
      dtype: float dtype.
    """
    _check(dim, block_size)
    nb = -(-num_features // block_size)
    blocks = [_block(key, jnp.asarray(j), block_size, dim, dtype) for j in range(nb)]
    return jnp.concatenate(blocks)[:num_features]


def jl_project(x: jax.Array, *, key: jax.Array, dim: int, block_size: int = 4096) -> jax.Array:
    """Projects rows ``x: (N, D)`` to ``(N, d)`` by a Gaussian JL matrix drawn blockwise.

    ``x R = Σ_j x[:, block_j] R_j`` with ``R_j = normal(fold_in(key, j), (block_size, d))/√d``;
    ``x`` is zero-padded to a multiple of ``block_size`` columns. Equal to
    ``x @ jl_matrix(D, key=key, dim=dim, block_size=block_size)``.

    Args:
      x: ``(N, D)`` (or ``(D,)``) float features.
      key: PRNG key (the same for every set that is compared).
      dim: target dimension ``d`` (LESS: 8192; specs' CPU study: 512).
      block_size: rows of ``R`` drawn at a time (memory ``block_size·d``).

    Returns:
      ``(N, d)`` (or ``(d,)``).

    Raises:
      ValueError: for non-positive ``dim``/``block_size`` or ``x`` not 1-D/2-D float.

    Example:
      >>> feats = jl_project(grads, key=jax.random.key(0), dim=512)  # doctest: +SKIP
    """
    _check(dim, block_size)
    x = jnp.asarray(x)
    if x.ndim not in (1, 2) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be float (N, D) or (D,); got {x.dtype} {x.shape}.")
    if x.ndim == 1:
        return jl_project(x[None], key=key, dim=dim, block_size=block_size)[0]
    n, d_in = x.shape
    nb = -(-d_in // block_size)
    x = jnp.pad(x, ((0, 0), (0, nb * block_size - d_in))).reshape(n, nb, block_size)

    def body(acc, j):
        r = _block(key, j, block_size, dim, x.dtype)
        return acc + x[:, j] @ r, None

    out, _ = jax.lax.scan(body, jnp.zeros((n, dim), x.dtype), jnp.arange(nb))
    return out
