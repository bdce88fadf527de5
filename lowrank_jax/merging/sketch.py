r"""Pass 1 of Extra-Merge: one-pass sketches of a trajectory, from which its N×N Gram follows.

All pairwise inner products of N streamed vectors cannot be had in one pass with O(P) memory (a
one-pass exact Gram needs the N vectors or N passes), so :func:`sketch_trajectory` keeps an
unbiased random sketch s_i ∈ R^k of each θ_i − θ₁ (CountSketch: random signs, coordinates folded
modulo k; exact, a signed permutation, when the parameter count P ≤ k) and G ≈ S Sᵀ, with a
relative error of about 1/√k of the centred norms.

References:
  Charikar, Chen, Farach-Colton, "Finding frequent items in data streams" (CountSketch), 2002,
  with a fixed modular hash and random signs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.merging import streaming, trees

__all__ = ["TrajectorySketch", "sketch_signs", "sketch_trajectory", "unpack_signs"]

PyTree = Any


class TrajectorySketch(NamedTuple):
    """Pass 1 of Extra-Merge: sketches of the checkpoints' differences θ_i − θ₁.

    Attributes:
      sketch: (N, k) float64, s_i ≈ S(θ_i − θ₁) with ⟨s_i, s_l⟩ an unbiased estimate of
        ⟨θ_i − θ₁, θ_l − θ₁⟩; k = min(P, sketch_dim).
      exact: True when P ≤ sketch_dim (S is then a signed permutation: inner products exact).
      leaf_sketches: ``{path: (N, k_l)}`` per tensor (k_l = min(P_l, sketch_dim)), or None.
      leaf_exact: ``{path: bool}`` (P_l ≤ sketch_dim), or None.
      num_params: P.
    """

    sketch: np.ndarray
    exact: bool
    leaf_sketches: dict[str, np.ndarray] | None
    leaf_exact: dict[str, bool] | None
    num_params: int

    def gram(self) -> np.ndarray:
        """(N, N) Gram matrix of θ_i − θ₁ (exact, or sketched)."""
        return self.sketch @ self.sketch.T

    def leaf_grams(self) -> dict[str, np.ndarray]:
        """``{path: (N, N)}`` per-tensor Gram matrices (needs ``per_tensor=True``)."""
        if self.leaf_sketches is None:
            raise ValueError("this sketch has no per-tensor parts: use per_tensor=True")
        return {p: s @ s.T for p, s in self.leaf_sketches.items()}


def sketch_signs(key: jax.Array, index: int, size: int) -> np.ndarray:
    """The Rademacher signs σ of the ``index``-th leaf (``size`` entries), packed 8 to a byte.

    Random bytes from NumPy's PCG64 seeded with ``fold_in(key, index)``'s key data: P/8 bytes
    for all P parameters (1/32 of a float32 copy), drawn without temporaries. Bit j (NumPy's
    big-endian bit order of :func:`numpy.unpackbits`) set means σ_j = +1; see
    :func:`unpack_signs`.
    """
    seed = np.asarray(jax.random.key_data(jax.random.fold_in(key, index)), np.uint32)
    rng = np.random.default_rng([int(v) for v in seed.ravel()])
    return rng.integers(0, 256, (size + 7) // 8, dtype=np.uint8)


def unpack_signs(packed: np.ndarray, start: int, stop: int) -> np.ndarray:
    """σ_start … σ_{stop−1} (int8, ±1) from :func:`sketch_signs`'s packed bits (``start % 8 == 0``)."""
    if start % 8:
        raise ValueError(f"start must be a multiple of 8; got {start}")
    bits = np.unpackbits(packed[start // 8 : (stop + 7) // 8], count=stop - start)
    return (bits.view(np.int8) << 1) - 1


@functools.partial(jax.jit, static_argnames=("k",))
def _fold_device(x: jax.Array, r: jax.Array, signs: jax.Array, k: int) -> jax.Array:
    d = streaming.accumulator_dtype(x.dtype)
    y = (x.astype(d) - r.astype(d)).ravel() * signs.astype(d)
    if y.size > k:
        main = (y.size // k) * k
        folded = y[:main].reshape(-1, k).sum(0)
        y = folded.at[: y.size - main].add(y[main:]) if y.size > main else folded
    return y


def _fold(x: Any, r: Any, signs: Any, k: int) -> np.ndarray:
    """fold_k(σ ⊙ vec(x − r)) as float64 (k,) (or (size,) when size ≤ k) for one leaf.

    NumPy leaves are folded on the host in blocks of a multiple of k entries (no leaf-sized
    temporary, no device copy); JAX leaves by a jitted fold.
    """
    if not isinstance(x, np.ndarray):
        return np.asarray(_fold_device(x, r, signs, k), np.float64)
    d = streaming.accumulator_dtype(x.dtype)
    xs, rs = np.asarray(x).reshape(-1), np.asarray(r).reshape(-1)
    size = xs.size
    out = np.zeros(min(size, k))
    unit = math.lcm(k, 8)  # block starts ≡ 0 (mod k) and on a byte of the packed signs
    block = unit * max(1, (1 << 20) // unit)
    for start in range(0, size, block):
        stop = min(start + block, size)
        y = np.subtract(xs[start:stop], rs[start:stop], dtype=d)
        y *= unpack_signs(signs, start, stop)
        full = (y.size // k) * k
        if full:
            out += y[:full].reshape(-1, k).sum(0, dtype=np.float64)
        out[: y.size - full] += y[full:]
    return out


def sketch_trajectory(
    checkpoints: Iterable[PyTree],
    *,
    key: jax.Array,
    sketch_dim: int = 1 << 16,
    per_tensor: bool = False,
) -> TrajectorySketch:
    r"""Pass 1 of Extra-Merge: one pass, k-dimensional sketches of θ_i − θ₁.

    For each tensor l with P_l entries, s_{i,l} = fold_k(σ_l ⊙ vec(θ_{i,l} − θ_{1,l})) where σ_l
    are Rademacher signs drawn from ``key`` and fold_k sums coordinates with equal index modulo
    k (identity when P_l ≤ k). The global sketch places the tensors' sketches at consecutive
    offsets modulo k. E⟨s_i, s_l⟩ = ⟨θ_i − θ₁, θ_l − θ₁⟩; the estimate is exact when P ≤ k
    and otherwise has a standard deviation of about ‖·‖‖·‖/√k per entry. Differences to θ₁ are
    sketched rather than raw weights so that rounding is relative to the trajectory's spread,
    not to the weights' size.

    Memory: θ₁ (kept as loaded), the current checkpoint, the signs (packed bits, P/32 floats'
    worth, for NumPy checkpoints; int8 on the device for JAX ones) and N·k floats. NumPy
    checkpoints are folded on the host block by block (no device copy of them).

    Args:
      checkpoints: θ₁ … θ_N, any iterable of parameter pytrees (read once).
      key: PRNG key of the signs.
      sketch_dim: k.
      per_tensor: also keep one sketch per tensor (for the per-tensor variant).

    Returns:
      A :class:`TrajectorySketch`.

    Raises:
      ValueError: ``sketch_dim`` < 1, fewer than 2 checkpoints, or mismatched trees.
    """
    if not isinstance(sketch_dim, int) or sketch_dim < 1:
        raise ValueError(f"sketch_dim must be a positive integer; got {sketch_dim!r}")
    rows: list[np.ndarray] = []
    leaf_rows: dict[str, list[np.ndarray]] = {}
    ref = signs = names = dims = offsets = sizes = None
    total = k_glob = 0
    for i, tree in streaming.stream_checkpoints(checkpoints):
        leaves = jax.tree.leaves(tree)
        if ref is None:
            streaming.check_floating(tree, f"checkpoint {i}")
            ref = leaves  # θ₁ as loaded (NumPy or JAX): the one parameter copy kept
            names = [p for p, _, _ in trees.leaf_signature(tree)]
            sizes = [int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves]
            total = int(sum(sizes))
            dims = tuple(min(s, sketch_dim) for s in sizes)
            k_glob = min(total, sketch_dim)
            offsets = np.concatenate([[0], np.cumsum(dims)[:-1]]) % max(k_glob, 1)
            signs = []  # packed bits for host leaves, int8 ±1 on the device for JAX leaves
            for t, (x, z) in enumerate(zip(leaves, sizes, strict=True)):
                packed = sketch_signs(key, t, z)
                host = isinstance(x, np.ndarray)
                signs.append(packed if host else jnp.asarray(unpack_signs(packed, 0, z)))
            parts = [np.zeros(k) for k in dims]
        else:
            parts = [
                _fold(x, r, sg, k) for x, r, sg, k in zip(leaves, ref, signs, dims, strict=True)
            ]
        row = np.zeros(k_glob)
        for part, off in zip(parts, offsets, strict=True):
            first = min(len(part), k_glob - off)
            row[off : off + first] += part[:first]
            row[: len(part) - first] += part[first:]
        rows.append(row)
        if per_tensor:
            for name, part in zip(names, parts, strict=True):
                leaf_rows.setdefault(name, []).append(part)
        del tree, leaves
    if len(rows) < 2:
        raise ValueError(f"need at least 2 checkpoints for a trajectory; got {len(rows)}")
    return TrajectorySketch(
        sketch=np.stack(rows),
        exact=total <= sketch_dim,
        leaf_sketches={p: np.stack(r) for p, r in leaf_rows.items()} if per_tensor else None,
        leaf_exact={p: z <= sketch_dim for p, z in zip(names, sizes, strict=True)}
        if per_tensor
        else None,
        num_params=total,
    )
