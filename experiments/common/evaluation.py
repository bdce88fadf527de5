"""Evaluation over a whole split in fixed-shape chunks: ``padded_batches`` and ``padded_means``.

An evaluation function is jitted once for one chunk shape; :func:`padded_batches` cuts the rows of
a split into chunks of that shape (the last one padded with weight-0 rows) and
:func:`padded_means` turns the chunks' weighted sums into per-example means, so padding counts
nowhere. ``fit``'s ``eval_fn`` is typically built from these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from experiments.common import sharding as sharding_lib

__all__ = ["padded_batches", "padded_means"]


def padded_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """``(chunk, weight)`` over all rows of ``arrays`` in order, every chunk ``batch_size`` long.

    The last chunk is padded by repeating its final row, with weight 0 on the padding (1
    elsewhere), so one compiled evaluation step sees a single shape and weighted sums count each
    example once. ``arrays`` must hold ``"y"`` (its length is the row count).
    """
    n = len(arrays["y"])
    for start in range(0, n, batch_size):
        chunk = {k: v[start : start + batch_size] for k, v in arrays.items()}
        weight = np.ones(len(chunk["y"]), np.float32)
        pad = batch_size - len(weight)
        if pad:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in chunk.items()}
            weight = np.concatenate([weight, np.zeros(pad, np.float32)])
        yield chunk, weight


def padded_means(
    sums: Callable[[Any, np.ndarray], Mapping[str, Any]],
    arrays: Mapping[str, np.ndarray],
    batch_size: int,
    *,
    mesh: Any = None,
) -> dict[str, float]:
    """Per-example means over all rows of ``arrays``, from weighted sums of padded chunks.

    ``sums(chunk, weight) -> {name: sum of the rows' values times weight}`` (a jitted
    evaluation) runs on every chunk of :func:`padded_batches`; the totals are accumulated on
    the host in float and divided by the row count, so padding rows (weight 0) count nowhere.

    Args:
      sums: the chunk evaluation; ``chunk`` holds ``(batch_size, ...)`` arrays, ``weight`` is
        ``(batch_size,)`` float32.
      arrays: ``(N, ...)`` host arrays, with ``"y"`` (its length is ``N``).
      batch_size: rows per chunk (one compiled shape).
      mesh: if given, each ``(chunk, weight)`` is put on it with :func:`shard_batch` first.

    Returns:
      ``{name: total / N}`` with the names of ``sums``'s output, in its order.
    """
    totals: dict[str, float] = {}
    for batch in padded_batches(arrays, batch_size):
        if mesh is not None:
            batch = sharding_lib.shard_batch(mesh, batch)
        for k, v in sums(*batch).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    n = len(arrays["y"])
    return {k: v / n for k, v in totals.items()}
