r"""Extra-Merge (P5): extrapolate the window-merged trajectory along its rank-1 direction.

Streamed over checkpoints θ₁ … θ_N (:mod:`~lowrank_jax.merging.streaming`): pass 1 sketches
the trajectory (:func:`~lowrank_jax.merging.sketch.sketch_trajectory`), :func:`trajectory_pca`
does the N×N algebra (no parameter-sized arrays), pass 2 forms the result as weighted sums
(:func:`extra_merge_line`, then :func:`line_search`), or all of it in :func:`extra_merge`.

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
norms. Pass 2 (:func:`~lowrank_jax.merging.streaming.weighted_sums`) forms M_N and v u (or θ(α) directly) exactly as weighted
sums of the checkpoints. Peak memory: pass 1 holds θ₁, the current checkpoint and the signs
(packed bits for NumPy checkpoints, ≈ 2.03 parameter copies; int8 on the device for JAX ones,
≈ 2.25); pass 2 the accumulators and the current checkpoint (2 copies for
θ(α) with a fixed α, 3 for the line form M_N, v u); plus N·k floats of sketch and N² of Gram.

References:
  P5 Extra-Merge: W. Zhou, B. Wang, H. Zhang, C. Jia, W. Chen, X. Cheng, ICML 2026 ("merged
  checkpoints lie in a rank-1 subspace; extrapolate along it"). Formulas not public: the
  direction, rate, default α and line search here are the reconstruction of specs §5.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from lowrank_jax.merging import averaging, streaming
from lowrank_jax.merging import sketch as sketch_lib

__all__ = [
    "ExtraMerge",
    "ExtraMergeLine",
    "LineSearch",
    "TrajectoryPCA",
    "default_alpha",
    "extra_merge",
    "extra_merge_line",
    "extrapolation_weights",
    "line_search",
    "theil_sen_slope",
    "trajectory_pca",
]

PyTree = Any


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
      gram: (N, N) symmetric Gram matrix, or a :class:`~lowrank_jax.merging.sketch.TrajectorySketch`.
      window: W (1 analyses the raw checkpoints).
      window_weights: ω (W,), newest first; uniform by default.
      sign_lag: Δ (default min(W, K − 1)).

    Returns:
      A :class:`TrajectoryPCA`.

    Raises:
      ValueError: a non-square Gram, or fewer than 2 window merges (W > N − 1).
    """
    if isinstance(gram, sketch_lib.TrajectorySketch):
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
    a = averaging.window_matrix(n, window=window, window_weights=window_weights)
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
    sketch: sketch_lib.TrajectorySketch,
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


class ExtraMergeLine(NamedTuple):
    """The extrapolation line θ(α) = base + α·step (base = M_N, step = v u, per tensor or not).

    Attributes:
      base: M_N, the newest window merge (pytree).
      step: v u (pytree); ``at(alpha)`` is θ(α).
      pca: the :class:`TrajectoryPCA` (or ``{path: TrajectoryPCA}`` per tensor).
      sketch: the pass-1 :class:`~lowrank_jax.merging.sketch.TrajectorySketch`.
    """

    base: PyTree
    step: PyTree
    pca: Any
    sketch: sketch_lib.TrajectorySketch

    def at(self, alpha: float) -> PyTree:
        """θ(α) = base + α·step, in the checkpoints' dtypes."""

        def one(b, s):
            d = streaming.accumulator_dtype(b.dtype)
            return (b.astype(d) + alpha * s.astype(d)).astype(b.dtype)

        return jax.tree.map(one, self.base, self.step)


class LineSearch(NamedTuple):
    """Held-out losses along the line: ``alphas`` (A,), ``losses`` (A,), the best α and loss."""

    alphas: np.ndarray
    losses: np.ndarray
    best_alpha: float
    best_loss: float


def extra_merge_line(
    checkpoints: streaming.Checkpoints,
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
    source = streaming.reiterable(checkpoints, "extra_merge_line")
    sketch = sketch_lib.sketch_trajectory(
        source(), key=key, sketch_dim=sketch_dim, per_tensor=per_tensor
    )
    pca = _analyse(sketch, per_tensor, window, window_weights)
    if per_tensor:
        base_w = {p: q.last_weights for p, q in pca.items()}
        step_w = {p: q.rate * q.direction_weights for p, q in pca.items()}
    else:
        base_w, step_w = pca.last_weights, pca.rate * pca.direction_weights
    base, step = streaming.weighted_sums(source(), [base_w, step_w])
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
    checkpoints: streaming.Checkpoints,
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
    source = streaming.reiterable(checkpoints, "extra_merge")
    sketch = sketch_lib.sketch_trajectory(
        source(), key=key, sketch_dim=sketch_dim, per_tensor=per_tensor
    )
    pca = _analyse(sketch, per_tensor, window, window_weights)
    a = default_alpha(window) if alpha is None else float(alpha)
    params = streaming.weighted_sum(source(), extrapolation_weights(pca, a))
    return ExtraMerge(params, a, pca, None)
