r"""Standard trajectory merges, streamed: LAWA, EMA, ExPO and the window merges.

* :func:`lawa`: uniform average of the last ``window`` checkpoints (one pass);
* :func:`ema`: exponential moving average e_i = β e_{i−1} + (1 − β) θ_i (one pass);
* :func:`expo`: two-point extrapolation θ_N + α (θ_N − θ_{N−1});
* :func:`window_matrix` / :func:`window_merges`: the window merges M_j = Σ_i A_{j,i} θ_i that
  Extra-Merge analyses (:mod:`~lowrank_jax.merging.extrapolation`), as a matrix or as pytrees.

References:
  LAWA: Kaddour, "Stop wasting my time! Saving days of ImageNet and BERT training with latest
  weight averaging", 2022; Sanyal et al., "Early weight averaging meets high learning rates",
  2023. ExPO: Zheng et al., "Weak-to-strong extrapolation expedites alignment", 2024.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from lowrank_jax.merging import streaming, trees

__all__ = ["ema", "expo", "lawa", "window_matrix", "window_merges"]

PyTree = Any


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
        for i, tree in streaming.stream_checkpoints(checkpoints):
            if acc is None:
                streaming.check_floating(tree, f"checkpoint {i}")
                template, acc = streaming.shape_tree(tree), streaming.new_accumulator(tree)
            leaves = jax.tree.leaves(tree)
            del tree
            streaming.accumulate(acc, leaves, 1.0, [1.0] * len(leaves))
            count += 1
            del leaves
        if acc is None:
            raise ValueError("no checkpoints to average (the iterable was empty)")
        return streaming.finish(acc, template, scale=1.0 / count)
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
    return streaming.weighted_sum(checkpoints, w)


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
    for i, tree in streaming.stream_checkpoints(checkpoints):
        leaves = jax.tree.leaves(tree)
        if acc is None:
            streaming.check_floating(tree, f"checkpoint {i}")
            template, acc = streaming.shape_tree(tree), streaming.new_accumulator(tree, copy=True)
        else:
            streaming.accumulate(acc, leaves, decay, [1.0 - decay] * len(leaves))
        del tree, leaves
    if acc is None:
        raise ValueError("no checkpoints to average (the iterable was empty)")
    return streaming.finish(acc, template)


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
    streaming.check_floating(last, "last")

    def one(p, q):
        d = streaming.accumulator_dtype(q.dtype)
        return (q.astype(d) + alpha * (q.astype(d) - p.astype(d))).astype(q.dtype)

    return jax.tree.map(one, previous, last)


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
    for _, tree in streaming.stream_checkpoints(checkpoints):
        buffer = [*buffer[-(window - 1) :], tree] if window > 1 else [tree]
        if len(buffer) == window:
            yield streaming.weighted_sum(buffer, a)
