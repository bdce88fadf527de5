r"""Trajectory merges of late checkpoints, streamed: LAWA, EMA, ExPO and Extra-Merge (P5).

Every function reads checkpoints θ₁ … θ_N (parameter pytrees of identical paths, shapes and
dtypes) one at a time, so at most a few parameter copies are alive at once, never all N:

* :func:`lawa`: uniform average of the last ``window`` checkpoints (one pass);
* :func:`ema`: exponential moving average e_i = β e_{i−1} + (1 − β) θ_i (one pass);
* :func:`expo`: two-point extrapolation θ_N + α (θ_N − θ_{N−1});
* :func:`weighted_sums`: Σ_i w_i θ_i for several weight vectors (global or per parameter) in one
  pass, the second pass of Extra-Merge;
* :func:`window_merges`: the window merges M_j themselves (for plots);
* Extra-Merge: :func:`sketch_trajectory` (pass 1), :func:`trajectory_pca` (N×N algebra, no
  parameter-sized arrays), :func:`extra_merge_line` (pass 2) and :func:`line_search`, or all of
  it in :func:`extra_merge`.

**Extra-Merge** (reconstruction of P5 from the abstract, specs §5). With window merges
M_j = Σ_{i=j−W+1}^{j} ω_{j−i} θ_i (uniform ω = 1/W by default), j = W … N (K = N − W + 1 of
them), and the centred merges X_j = M_j − M̄, the rank-1 direction u is the top right singular
vector of X (K×P), sign-aligned with M_N − M_{N−Δ}; ρ₁ = σ₁² / Σ σ_k² is its explained-variance
ratio; c_j = ⟨X_j, u⟩ are the coordinates along it and the progress rate v is their Theil–Sen
slope per checkpoint. The merge is θ(α) = M_N + α v u, with α chosen by a forward-only line search
of held-out loss, or α = (W − 1)/2 (the lag of a uniform window average) without data.

**Passes and memory.** Since X = A_c Θ for the K×N centred window matrix A_c (rows sum to 0),
everything above follows from the N×N Gram matrix G = Θ_c Θ_cᵀ of the checkpoints' differences
θ_i − θ₁: G_X = A_c G A_cᵀ = W Λ Wᵀ, u = Θᵀ A_cᵀ w₁ / √λ₁ (a weighted sum of checkpoints),
c = √λ₁ w₁. All pairwise inner products of N streamed vectors cannot be had in one pass with
O(P) memory, so pass 1 (:func:`sketch_trajectory`) keeps an unbiased random sketch s_i ∈ R^k of
each θ_i − θ₁ (random signs, coordinates folded modulo k; exact — a signed permutation — when
the parameter count P ≤ k) and G ≈ S Sᵀ; its relative error is about 1/√k of the centred
norms. Pass 2 (:func:`weighted_sums`) forms M_N and v u (or θ(α) directly) exactly as weighted
sums of the checkpoints. Peak memory: pass 1 holds θ₁, the current checkpoint and int8 signs
(≈ 2.25 parameter copies); pass 2 the accumulators and the current checkpoint (2 copies for
θ(α) with a fixed α, 3 for the line form M_N, v u); plus N·k floats of sketch and N² of Gram.

References:
  P5 Extra-Merge: W. Zhou, B. Wang, H. Zhang, C. Jia, W. Chen, X. Cheng, ICML 2026 ("merged
  checkpoints lie in a rank-1 subspace; extrapolate along it"). Formulas not public: the
  direction, rate, default α and line search here are the reconstruction of specs §5.
  LAWA: Kaddour, "Stop wasting my time! Saving days of ImageNet and BERT training with latest
  weight averaging", 2022; Sanyal et al., "Early weight averaging meets high learning rates",
  2023. ExPO: Zheng et al., "Weak-to-strong extrapolation expedites alignment", 2024.
  Sketch: Charikar, Chen, Farach-Colton, "Finding frequent items in data streams" (CountSketch),
  2002, with a fixed modular hash and random signs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.merging import trees

__all__ = [
    "ExtraMerge",
    "ExtraMergeLine",
    "LineSearch",
    "TrajectoryPCA",
    "TrajectorySketch",
    "default_alpha",
    "ema",
    "expo",
    "extra_merge",
    "extra_merge_line",
    "extrapolation_weights",
    "lawa",
    "line_search",
    "sketch_trajectory",
    "theil_sen_slope",
    "trajectory_pca",
    "weighted_sum",
    "weighted_sums",
    "window_matrix",
    "window_merges",
]

PyTree = Any
Checkpoints = Iterable[PyTree] | Callable[[], Iterable[PyTree]]


# ----------------------------------------------------------------------------------------------
# Streaming over checkpoints.


def _stream(checkpoints: Iterable[PyTree], indices: Iterable[int] | None = None):
    """Yields ``(i, tree, signature)``, checking each tree against the first one."""
    if isinstance(checkpoints, Sequence) and indices is not None:
        items = ((i, checkpoints[i]) for i in indices)
    else:
        items = enumerate(checkpoints)
    signature = None
    first = None
    for i, tree in items:
        if signature is None:
            signature, first = trees.leaf_signature(tree), i
        else:
            trees.check_same_tree(
                None,
                tree,
                what=f"checkpoint {i}",
                reference_what=f"checkpoint {first}",
                signature=signature,
            )
        yield i, tree
        del tree  # before the next one is loaded


def _reiterable(checkpoints: Checkpoints, what: str) -> Callable[[], Iterable[PyTree]]:
    """A function returning a fresh iterable over the checkpoints, for multi-pass methods."""
    if callable(checkpoints) and not isinstance(checkpoints, Sequence | Mapping):
        return checkpoints
    if isinstance(checkpoints, Sequence):
        return lambda: checkpoints
    raise TypeError(
        f"{what} reads the checkpoints more than once: pass a list, a lazy Sequence (loading "
        "each checkpoint in __getitem__), or a zero-argument function returning a fresh iterator "
        f"— not a one-shot {type(checkpoints).__name__}."
    )


def _acc_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _check_float(tree: PyTree, what: str) -> None:
    for path, _, dtype in trees.leaf_signature(tree):
        if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise TypeError(
                f"{what} has a non-floating leaf at {path!r} ({dtype}); merge only the float "
                "parameters (e.g. state['params'], not the optimizer step count)."
            )


@functools.partial(jax.jit, donate_argnums=(0,))
def _axpy(acc: PyTree, tree: PyTree, weights: PyTree) -> PyTree:
    return jax.tree.map(
        lambda a, x, w: a + w.astype(a.dtype) * x.astype(a.dtype), acc, tree, weights
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def _ema_step(acc: PyTree, tree: PyTree, decay: jax.Array) -> PyTree:
    return jax.tree.map(
        lambda a, x: decay.astype(a.dtype) * a + (1 - decay.astype(a.dtype)) * x.astype(a.dtype),
        acc,
        tree,
    )


def _cast_like(acc: PyTree, signature_tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a, x: a.astype(x.dtype), acc, signature_tree)


def _shapes(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def _zeros_like_acc(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), _acc_dtype(x.dtype)), tree)


# ----------------------------------------------------------------------------------------------
# Standard merges.


def weighted_sums(
    checkpoints: Iterable[PyTree],
    weights: Sequence[Any],
) -> list[PyTree]:
    r"""Σ_i w_i θ_i for several weight vectors in one pass over the checkpoints.

    Each entry of ``weights`` is either an array of shape (N,) (the same weights for every
    parameter) or a mapping ``{path: (N,) array}`` over all '/'-joined parameter paths (one
    weight vector per tensor, as the per-tensor Extra-Merge needs). Accumulation is in float32
    (float64 for float64 leaves); results have the checkpoints' dtypes. A checkpoint whose
    weights are all zero is not read when ``checkpoints`` is a Sequence.

    Args:
      checkpoints: θ₁ … θ_N, any iterable of parameter pytrees (read once).
      weights: R weight specifications, each (N,) or ``{path: (N,)}``.

    Returns:
      A list of R pytrees.

    Raises:
      ValueError: the number of checkpoints is not N, a per-tensor mapping misses a path, or a
        checkpoint's tree differs from the first (naming the first differing path).
    """
    if isinstance(weights, np.ndarray | jax.Array) or not isinstance(weights, Sequence):
        raise TypeError("weights must be a list of weight vectors (wrap a single one in a list)")
    if not weights:
        raise ValueError("weights is empty: pass at least one weight vector")
    specs = [w if isinstance(w, Mapping) else np.asarray(w, np.float64) for w in weights]
    lengths = {
        (len(np.asarray(v)) if isinstance(s, Mapping) else len(s))
        for s in specs
        for v in (s.values() if isinstance(s, Mapping) else [s])
    }
    if len(lengths) != 1:
        raise ValueError(
            f"all weight vectors must have one length N; got lengths {sorted(lengths)}"
        )
    (n,) = lengths
    for s in specs:
        if not isinstance(s, Mapping) and s.ndim != 1:
            raise ValueError(f"a weight vector must be 1-D (N,); got shape {s.shape}")

    def nonzero(i: int) -> bool:
        return any(
            (
                np.any(np.asarray([v[i] for v in s.values()]) != 0)
                if isinstance(s, Mapping)
                else s[i] != 0
            )
            for s in specs
        )

    indices = [i for i in range(n) if nonzero(i)] if isinstance(checkpoints, Sequence) else None
    if isinstance(checkpoints, Sequence) and len(checkpoints) != n:
        raise ValueError(f"got {len(checkpoints)} checkpoints for weight vectors of length {n}")
    accs: list[PyTree] | None = None
    template = names = treedef = None
    count = 0
    for i, tree in _stream(checkpoints, indices):
        if i >= n:
            raise ValueError(f"got more than {n} checkpoints for weight vectors of length {n}")
        if accs is None:
            _check_float(tree, f"checkpoint {i}")
            template = _shapes(tree)
            accs = [_zeros_like_acc(tree) for _ in specs]
            names = [p for p, _, _ in trees.leaf_signature(tree)]
            treedef = jax.tree.structure(tree)
            for s in specs:
                missing = [p for p in names if p not in s] if isinstance(s, Mapping) else []
                if missing:
                    raise ValueError(
                        f"per-tensor weights have no entry for {missing[0]!r} (and "
                        f"{len(missing) - 1} more paths); give one (N,) vector per path"
                    )
        # Blocking keeps one checkpoint in flight: asynchronous dispatch would otherwise let the
        # loader run ahead and hold many checkpoints at once.
        accs = jax.block_until_ready(
            [
                _axpy(a, tree, _weight_tree(s, names, treedef, i))
                for a, s in zip(accs, specs, strict=True)
            ]
        )
        count = i + 1
        del tree
    if accs is None:
        raise ValueError("no checkpoints to merge (the iterable was empty)")
    if indices is None and count != n:
        raise ValueError(f"got {count} checkpoints for weight vectors of length {n}")
    return [_cast_like(a, template) for a in accs]


def _weight_tree(spec: Any, names: list[str], treedef: Any, i: int) -> PyTree:
    if isinstance(spec, Mapping):
        return jax.tree.unflatten(treedef, [np.float64(np.asarray(spec[p])[i]) for p in names])
    return jax.tree.unflatten(treedef, [np.float64(spec[i])] * len(names))


def weighted_sum(checkpoints: Iterable[PyTree], weights: Any) -> PyTree:
    """Σ_i w_i θ_i in one pass; ``weights`` (N,) or ``{path: (N,)}`` (see :func:`weighted_sums`)."""
    return weighted_sums(checkpoints, [weights])[0]


def lawa(checkpoints: Iterable[PyTree], *, window: int | None = None) -> PyTree:
    r"""Latest weight averaging: the uniform mean of the last ``window`` checkpoints.

    LAWA(θ₁ … θ_N; W) = (1/W) Σ_{i=N−W+1}^{N} θ_i, accumulated in one pass (float32 or wider).

    Args:
      checkpoints: θ₁ … θ_N. With ``window``, a Sequence (its earlier items are not read);
        without, any iterable, all of which is averaged.
      window: W, number of latest checkpoints averaged (None: all).

    Returns:
      The averaged pytree, in the checkpoints' dtypes.

    Raises:
      TypeError: ``window`` with a one-shot iterator (slice it yourself with ``itertools.islice``).
      ValueError: W < 1 or W > N, or mismatched trees.

    References:
      Kaddour 2022; Sanyal et al. 2023 (see the module docstring).
    """
    if window is None:
        acc, template, count = None, None, 0
        for i, tree in _stream(checkpoints):
            if acc is None:
                _check_float(tree, f"checkpoint {i}")
                template, acc = _shapes(tree), _zeros_like_acc(tree)
            acc = jax.block_until_ready(
                _axpy(acc, tree, jax.tree.map(lambda _: np.float32(1.0), tree))
            )
            count += 1
            del tree
        if acc is None:
            raise ValueError("no checkpoints to average (the iterable was empty)")
        return _cast_like(jax.tree.map(lambda a: a / count, acc), template)
    if not isinstance(checkpoints, Sequence):
        raise TypeError(
            "lawa(window=...) needs a Sequence of checkpoints (list or lazy loader); for an "
            "iterator pass the last W items, e.g. lawa(itertools.islice(it, N - W, None))"
        )
    n = len(checkpoints)
    if not isinstance(window, int) or not 1 <= window <= n:
        raise ValueError(
            f"window must be an integer in [1, {n}] (the number of checkpoints); got {window!r}"
        )
    w = np.zeros(n)
    w[n - window :] = 1.0 / window
    return weighted_sum(checkpoints, w)


def ema(checkpoints: Iterable[PyTree], *, decay: float) -> PyTree:
    r"""Exponential moving average over checkpoints, in one pass.

    e₁ = θ₁, e_i = β e_{i−1} + (1 − β) θ_i, so e_N = β^{N−1} θ₁ + Σ_{i≥2} (1 − β) β^{N−i} θ_i.

    Args:
      checkpoints: θ₁ … θ_N, any iterable of parameter pytrees.
      decay: β in [0, 1) (per checkpoint, not per optimizer step).

    Returns:
      e_N in the checkpoints' dtypes.

    Raises:
      ValueError: β outside [0, 1), no checkpoints, or mismatched trees.
    """
    if not 0.0 <= float(decay) < 1.0:
        raise ValueError(f"decay must be in [0, 1); got {decay!r}")
    acc, template = None, None
    beta = jnp.asarray(decay, jnp.float32)
    for i, tree in _stream(checkpoints):
        if acc is None:
            _check_float(tree, f"checkpoint {i}")
            template = _shapes(tree)
            acc = jax.tree.map(lambda x: jnp.array(x, _acc_dtype(x.dtype), copy=True), tree)
        else:
            acc = jax.block_until_ready(_ema_step(acc, tree, beta))
        del tree
    if acc is None:
        raise ValueError("no checkpoints to average (the iterable was empty)")
    return _cast_like(acc, template)


def expo(previous: PyTree, last: PyTree, *, alpha: float) -> PyTree:
    r"""Two-point extrapolation θ_N + α (θ_N − θ_{N−1}) (ExPO; the ablation of specs §5).

    Args:
      previous: θ_{N−1} (or any earlier checkpoint).
      last: θ_N, same paths, shapes and dtypes.
      alpha: α ≥ 0 (0 returns ``last``).

    Returns:
      The extrapolated pytree in ``last``'s dtypes.

    Raises:
      ValueError: mismatched trees (naming the first differing path).

    References:
      Zheng et al., "Weak-to-strong extrapolation expedites alignment", 2024.
    """
    trees.check_same_tree(previous, last, what="last", reference_what="previous")
    _check_float(last, "last")

    def one(p, q):
        d = _acc_dtype(q.dtype)
        return (q.astype(d) + alpha * (q.astype(d) - p.astype(d))).astype(q.dtype)

    return jax.tree.map(one, previous, last)


# ----------------------------------------------------------------------------------------------
# Window merges.


def window_matrix(
    num_checkpoints: int, *, window: int, window_weights: Sequence[float] | None = None
) -> np.ndarray:
    r"""The K×N matrix A with M_j = Σ_i A_{j,i} θ_i, K = N − W + 1 window merges.

    Row r (j = r + W − 1, 0-based) holds ω_t at column j − t, t = 0 … W − 1, with ω normalised
    to sum 1 (uniform ω = 1/W by default; ω₀ weights the newest checkpoint of the window).

    Raises:
      ValueError: W < 1, W > N, or ``window_weights`` not W non-negative numbers with a positive
        sum.
    """
    n = int(num_checkpoints)
    if not isinstance(window, int | np.integer) or not 1 <= window <= n:
        raise ValueError(
            f"window must be an integer in [1, {n}] (the number of checkpoints); got {window!r}"
        )
    if window_weights is None:
        omega = np.full(window, 1.0 / window)
    else:
        omega = np.asarray(window_weights, np.float64)
        if omega.shape != (window,) or np.any(omega < 0) or omega.sum() <= 0:
            raise ValueError(
                f"window_weights must be {window} non-negative numbers with a positive sum "
                f"(newest first); got {window_weights!r}"
            )
        omega = omega / omega.sum()
    k = n - window + 1
    a = np.zeros((k, n))
    for r in range(k):
        j = r + window - 1
        a[r, j - np.arange(window)] = omega
    return a


def window_merges(
    checkpoints: Iterable[PyTree],
    *,
    window: int,
    window_weights: Sequence[float] | None = None,
) -> Iterator[PyTree]:
    """Yields the window merges M_W … M_N (for plots and checks; Extra-Merge never forms them).

    Holds the last ``window`` checkpoints (O(W·P) memory) and yields each merge as soon as its
    window is full.

    Raises:
      ValueError: bad ``window``/``window_weights`` or mismatched trees.
    """
    a = window_matrix(window, window=window, window_weights=window_weights)[0]  # (W,) oldest first
    buffer: list[PyTree] = []
    for _, tree in _stream(checkpoints):
        buffer = [*buffer[-(window - 1) :], tree] if window > 1 else [tree]
        if len(buffer) == window:
            yield weighted_sum(buffer, a)


# ----------------------------------------------------------------------------------------------
# Extra-Merge, pass 1: a sketch of the trajectory, from which the N×N Gram matrix follows.


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


@functools.partial(jax.jit, static_argnames=("dims",))
def _sketch_leaves(leaves, ref_leaves, sign_leaves, dims):
    out = []
    for x, r, s, k in zip(leaves, ref_leaves, sign_leaves, dims, strict=True):
        d = _acc_dtype(x.dtype)
        y = (x.astype(d) - r.astype(d)).ravel() * s.astype(d)
        if y.size > k:
            main = (y.size // k) * k
            folded = y[:main].reshape(-1, k).sum(0)
            y = folded.at[: y.size - main].add(y[main:]) if y.size > main else folded
        out.append(y)
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

    Memory: θ₁, the current checkpoint, int8 signs (P/4 floats' worth) and N·k floats.

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
    for i, tree in _stream(checkpoints):
        leaves = jax.tree.leaves(tree)
        if ref is None:
            _check_float(tree, f"checkpoint {i}")
            ref = [jnp.asarray(x) for x in leaves]  # kept on device: one copy, not one per call
            names = [p for p, _, _ in trees.leaf_signature(tree)]
            sizes = [int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves]
            total = int(sum(sizes))
            dims = tuple(min(s, sketch_dim) for s in sizes)
            k_glob = min(total, sketch_dim)
            offsets = np.concatenate([[0], np.cumsum(dims)[:-1]]) % max(k_glob, 1)
            signs = [
                jax.random.rademacher(jax.random.fold_in(key, t), (s,), jnp.int8)
                for t, s in enumerate(sizes)
            ]
            parts = [np.zeros(k) for k in dims]
        else:
            parts = [np.asarray(p, np.float64) for p in _sketch_leaves(leaves, ref, signs, dims)]
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


# ----------------------------------------------------------------------------------------------
# Extra-Merge, the small algebra: direction, ρ₁, progress rate.


class TrajectoryPCA(NamedTuple):
    """The rank-1 analysis of a (window-merged) trajectory, as weights on the checkpoints.

    Attributes:
      window: W (1: the raw checkpoints).
      eigenvalues: (K,) eigenvalues of the centred merges' Gram matrix, descending (σ_k²).
      explained_variance_ratio: (K,) λ_k / Σ λ.
      rho1: ρ₁ = λ₁ / Σ λ (NaN if the merges do not move).
      coords: (K,) c_j = ⟨M_j − M̄, u⟩.
      rate: v, the Theil–Sen slope of c_j per checkpoint interval.
      direction_weights: (N,) b with u = Σ_i b_i θ_i (‖u‖ = 1, Σ b = 0).
      last_weights: (N,) a with M_N = Σ_i a_i θ_i.
    """

    window: int
    eigenvalues: np.ndarray
    explained_variance_ratio: np.ndarray
    rho1: float
    coords: np.ndarray
    rate: float
    direction_weights: np.ndarray
    last_weights: np.ndarray


def theil_sen_slope(y: Any) -> float:
    """Median of the pairwise slopes (y_j − y_i)/(j − i), i < j: a robust slope per index step.

    Raises:
      ValueError: fewer than 2 values.
    """
    y = np.asarray(y, np.float64).ravel()
    if y.size < 2:
        raise ValueError(f"a slope needs at least 2 values; got {y.size}")
    i, j = np.triu_indices(y.size, k=1)
    return float(np.median((y[j] - y[i]) / (j - i)))


def trajectory_pca(
    gram: Any,
    *,
    window: int,
    window_weights: Sequence[float] | None = None,
    sign_lag: int | None = None,
) -> TrajectoryPCA:
    r"""Rank-1 direction, ρ₁ and progress rate of the window-merged trajectory, from its Gram.

    With A the K×N window matrix (:func:`window_matrix`), A_c = A − 1 (1ᵀA)/K and G the N×N Gram
    of the checkpoints (any common offset cancels, e.g. G of θ_i − θ₁), G_X = A_c G A_cᵀ =
    Σ λ_k w_k w_kᵀ; u = Θᵀ A_cᵀ w₁ / √λ₁, c = √λ₁ w₁, sign chosen so that c_K − c_{K−Δ} ≥ 0
    (u points along M_N − M_{N−Δ}), v = Theil–Sen slope of c. Costs O(N³), no parameter-sized
    arrays.

    Args:
      gram: (N, N) symmetric Gram matrix, or a :class:`TrajectorySketch`.
      window: W (1 analyses the raw checkpoints).
      window_weights: ω (W,), newest first; uniform by default.
      sign_lag: Δ (default min(W, K − 1)).

    Returns:
      A :class:`TrajectoryPCA`.

    Raises:
      ValueError: a non-square Gram, or fewer than 2 window merges (W > N − 1).
    """
    if isinstance(gram, TrajectorySketch):
        gram = gram.gram()
    g = np.asarray(gram, np.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"gram must be a square (N, N) matrix; got shape {g.shape}")
    n = g.shape[0]
    if n - window + 1 < 2:
        raise ValueError(
            f"window={window} leaves {n - window + 1} merge(s) of {n} checkpoints; a direction "
            f"needs at least 2: use window <= {n - 1}"
        )
    a = window_matrix(n, window=window, window_weights=window_weights)
    k = a.shape[0]
    a_c = a - a.mean(axis=0, keepdims=True)
    gx = a_c @ (0.5 * (g + g.T)) @ a_c.T
    lam, vecs = np.linalg.eigh(0.5 * (gx + gx.T))
    lam, vecs = np.clip(lam[::-1], 0.0, None), vecs[:, ::-1]
    total = float(lam.sum())
    if total <= 0.0 or lam[0] <= 0.0:
        zeros_k = np.zeros(k)
        return TrajectoryPCA(window, lam, zeros_k, float("nan"), zeros_k, 0.0, np.zeros(n), a[-1])
    w1 = vecs[:, 0]
    coords = np.sqrt(lam[0]) * w1
    lag = min(window, k - 1) if sign_lag is None else int(sign_lag)
    if not 1 <= lag <= k - 1:
        raise ValueError(f"sign_lag must be in [1, {k - 1}]; got {sign_lag!r}")
    flip = -1.0 if coords[-1] - coords[-1 - lag] < 0 else 1.0
    w1, coords = flip * w1, flip * coords
    return TrajectoryPCA(
        window=int(window),
        eigenvalues=lam,
        explained_variance_ratio=lam / total,
        rho1=float(lam[0] / total),
        coords=coords,
        rate=theil_sen_slope(coords),
        direction_weights=a_c.T @ w1 / np.sqrt(lam[0]),
        last_weights=a[-1],
    )


def default_alpha(window: int) -> float:
    """α = (W − 1)/2, the lag (in checkpoint intervals) of a uniform window average."""
    return (window - 1) / 2.0


def extrapolation_weights(pca: TrajectoryPCA | Mapping[str, TrajectoryPCA], alpha: float) -> Any:
    """Weights of θ(α) = M_N + α v u on the checkpoints: (N,), or ``{path: (N,)}`` per tensor."""
    if isinstance(pca, Mapping):
        return {p: extrapolation_weights(q, alpha) for p, q in pca.items()}
    return pca.last_weights + alpha * pca.rate * pca.direction_weights


def _analyse(
    sketch: TrajectorySketch,
    per_tensor: bool,
    window: int,
    window_weights: Sequence[float] | None,
) -> TrajectoryPCA | dict[str, TrajectoryPCA]:
    if per_tensor:
        return {
            p: trajectory_pca(g, window=window, window_weights=window_weights)
            for p, g in sketch.leaf_grams().items()
        }
    return trajectory_pca(sketch, window=window, window_weights=window_weights)


# ----------------------------------------------------------------------------------------------
# Extra-Merge, pass 2 and the line search.


class ExtraMergeLine(NamedTuple):
    """The extrapolation line θ(α) = base + α·step (base = M_N, step = v u, per tensor or not).

    Attributes:
      base: M_N, the newest window merge (pytree).
      step: v u (pytree); ``at(alpha)`` is θ(α).
      pca: the :class:`TrajectoryPCA` (or ``{path: TrajectoryPCA}`` per tensor).
      sketch: the pass-1 :class:`TrajectorySketch`.
    """

    base: PyTree
    step: PyTree
    pca: Any
    sketch: TrajectorySketch

    def at(self, alpha: float) -> PyTree:
        """θ(α) = base + α·step, in the checkpoints' dtypes."""

        def one(b, s):
            d = _acc_dtype(b.dtype)
            return (b.astype(d) + alpha * s.astype(d)).astype(b.dtype)

        return jax.tree.map(one, self.base, self.step)


class LineSearch(NamedTuple):
    """Held-out losses along the line: ``alphas`` (A,), ``losses`` (A,), the best α and loss."""

    alphas: np.ndarray
    losses: np.ndarray
    best_alpha: float
    best_loss: float


def extra_merge_line(
    checkpoints: Checkpoints,
    *,
    window: int,
    key: jax.Array,
    sketch_dim: int = 1 << 16,
    per_tensor: bool = False,
    window_weights: Sequence[float] | None = None,
) -> ExtraMergeLine:
    """Two passes: the sketch (pass 1), then M_N and v u as weighted sums (pass 2).

    Args:
      checkpoints: θ₁ … θ_N, oldest first: a list, a lazy Sequence, or a zero-argument function
        returning a fresh iterator (read twice).
      window: W.
      key: PRNG key of the sketch's signs.
      sketch_dim: k (exact when the parameter count, or each tensor's for ``per_tensor``, is ≤ k).
      per_tensor: one direction and rate per tensor instead of one for the whole model.
      window_weights: ω (W,), newest first; uniform by default.

    Returns:
      An :class:`ExtraMergeLine`; ``line.at(alpha)`` is θ(α).

    Raises:
      TypeError: a one-shot iterator.
      ValueError: bad ``window`` or mismatched trees (naming the first differing path).
    """
    source = _reiterable(checkpoints, "extra_merge_line")
    sketch = sketch_trajectory(source(), key=key, sketch_dim=sketch_dim, per_tensor=per_tensor)
    pca = _analyse(sketch, per_tensor, window, window_weights)
    if per_tensor:
        base_w = {p: q.last_weights for p, q in pca.items()}
        step_w = {p: q.rate * q.direction_weights for p, q in pca.items()}
    else:
        base_w, step_w = pca.last_weights, pca.rate * pca.direction_weights
    base, step = weighted_sums(source(), [base_w, step_w])
    return ExtraMergeLine(base=base, step=step, pca=pca, sketch=sketch)


def line_search(
    loss_fn: Callable[[PyTree], Any],
    line: ExtraMergeLine,
    *,
    alphas: Sequence[float] | None = None,
) -> LineSearch:
    """Forward-only 1-D search of α: evaluates ``loss_fn(line.at(α))`` on a grid, keeps the best.

    Args:
      loss_fn: params -> scalar held-out loss (forward passes only).
      line: from :func:`extra_merge_line`.
      alphas: the grid (default 0, 0.5, …, 2(W − 1), four times the default α).

    Returns:
      A :class:`LineSearch` (ties go to the smaller α).

    Raises:
      ValueError: an empty grid, or a non-finite loss at every α.
    """
    if alphas is None:
        window = (
            next(iter(line.pca.values())).window
            if isinstance(line.pca, Mapping)
            else line.pca.window
        )
        alphas = np.arange(0.0, 4.0 * default_alpha(window) + 0.25, 0.5)
    grid = np.asarray(alphas, np.float64).ravel()
    if grid.size == 0:
        raise ValueError("alphas is empty: pass a grid such as (0, 0.5, 1, ...)")
    losses = np.asarray([float(loss_fn(line.at(float(a)))) for a in grid])
    finite = np.where(np.isfinite(losses), losses, np.inf)
    if not np.isfinite(finite).any():
        raise ValueError(f"the loss is not finite at any alpha in {grid.tolist()}")
    best = int(np.argmin(finite))
    return LineSearch(grid, losses, float(grid[best]), float(losses[best]))


class ExtraMerge(NamedTuple):
    """Result of :func:`extra_merge`: ``params`` = θ(α), the α used, the analysis, the search."""

    params: PyTree
    alpha: float
    pca: Any
    search: LineSearch | None


def extra_merge(
    checkpoints: Checkpoints,
    *,
    window: int,
    key: jax.Array,
    alpha: float | None = None,
    loss_fn: Callable[[PyTree], Any] | None = None,
    alphas: Sequence[float] | None = None,
    sketch_dim: int = 1 << 16,
    per_tensor: bool = False,
    window_weights: Sequence[float] | None = None,
) -> ExtraMerge:
    r"""Extra-Merge: θ(α) = M_N + α v u, α by line search on held-out loss or the default.

    With ``loss_fn``: two passes (:func:`extra_merge_line`) and a forward-only search over
    ``alphas`` (3 parameter copies: M_N, v u and the current one). Without: α = ``alpha`` or
    (W − 1)/2 and θ(α) is accumulated directly in the second pass (2 parameter copies).

    Args:
      checkpoints: θ₁ … θ_N, oldest first: a list, a lazy Sequence, or a zero-argument function
        returning a fresh iterator.
      window: W.
      key: PRNG key of the sketch's signs.
      alpha: a fixed α (ignored with ``loss_fn``).
      loss_fn: params -> held-out loss, for the line search.
      alphas: the search grid (see :func:`line_search`).
      sketch_dim: k (see :func:`sketch_trajectory`).
      per_tensor: one direction and rate per tensor.
      window_weights: ω (W,), newest first; uniform by default.

    Returns:
      An :class:`ExtraMerge`.

    Example:
      >>> out = extra_merge(ckpts, window=10, key=jax.random.key(0), loss_fn=valid_loss)
      >>> out.alpha, out.pca.rho1, out.params  # doctest: +SKIP

    References:
      P5 Extra-Merge (reconstruction, specs §5); see the module docstring.
    """
    if loss_fn is not None:
        line = extra_merge_line(
            checkpoints,
            window=window,
            key=key,
            sketch_dim=sketch_dim,
            per_tensor=per_tensor,
            window_weights=window_weights,
        )
        search = line_search(loss_fn, line, alphas=alphas)
        return ExtraMerge(line.at(search.best_alpha), search.best_alpha, line.pca, search)
    source = _reiterable(checkpoints, "extra_merge")
    sketch = sketch_trajectory(source(), key=key, sketch_dim=sketch_dim, per_tensor=per_tensor)
    pca = _analyse(sketch, per_tensor, window, window_weights)
    a = default_alpha(window) if alpha is None else float(alpha)
    params = weighted_sum(source(), extrapolation_weights(pca, a))
    return ExtraMerge(params, a, pca, None)
