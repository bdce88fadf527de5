"""Filtered ranking metrics (MRR, Hits@k), training-set fit and NLL for 1-N link prediction.

Filtered rank of the true object ``o`` of a query among all entities, ignoring the other known
true objects of the same query (Bordes et al. 2013). Ties are resolved as in PyKEEN:

- optimistic rank ``1 + #{e : z_e > z_o}``, pessimistic rank ``1 + #{e != o : z_e >= z_o}``
  (``e`` ranging over non-filtered entities);
- realistic rank = their mean (PyKEEN's default, the expected rank under random tie breaking).

``MRR = mean(1 / rank)`` and ``Hits@k = mean(rank <= k)`` over both prediction sides (tail queries
``(s, r, ?)`` and head queries answered as ``(o, r^{-1}, ?)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.kge.graphs import QueryTargets, add_inverse_triples, lookup_queries

__all__ = [
    "as_partial",
    "filtered_ranks",
    "multi_hot",
    "perfect_ranking",
    "rank_metrics",
    "rank_triples",
]


def multi_hot(objects: jax.Array, *, num_entities: int) -> jax.Array:
    """``(b, m)`` padded object ids (pad ``>= num_entities``) -> ``(b, E)`` float32 0/1 labels."""
    rows = jnp.arange(objects.shape[0])[:, None]
    labels = jnp.zeros((objects.shape[0], num_entities), jnp.float32)
    return labels.at[rows, objects].set(1.0, mode="drop")


def filtered_ranks(
    scores: jax.Array, targets: jax.Array, filter_objects: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Optimistic, pessimistic and realistic filtered ranks of the targets.

    Args:
      scores: ``(b, E)`` scores, higher is better.
      targets: ``(b,)`` int true object of each row.
      filter_objects: ``(b, m)`` int known true objects of each row's query, padded with any id
        ``>= E``; the row's own target may appear in it (it is never filtered).

    Returns:
      Three ``(b,)`` float32 arrays: optimistic, pessimistic, realistic ranks (>= 1).
    """
    if scores.ndim != 2 or targets.shape != scores.shape[:1] or filter_objects.ndim != 2:
        raise ValueError(
            "expected scores (b, E), targets (b,), filter_objects (b, m); got "
            f"{scores.shape}, {targets.shape}, {filter_objects.shape}."
        )
    b, num_entities = scores.shape
    known = multi_hot(filter_objects, num_entities=num_entities) > 0
    others = jnp.arange(num_entities)[None, :] != targets[:, None]
    competitors = others & ~known
    target_scores = jnp.take_along_axis(scores, targets[:, None], axis=1)
    optimistic = 1.0 + jnp.sum(competitors & (scores > target_scores), axis=1)
    pessimistic = 1.0 + jnp.sum(competitors & (scores >= target_scores), axis=1)
    optimistic = optimistic.astype(jnp.float32)
    pessimistic = pessimistic.astype(jnp.float32)
    return optimistic, pessimistic, 0.5 * (optimistic + pessimistic)


def perfect_ranking(scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Whether every true object outranks every other entity (ties count as failures).

    Args:
      scores: ``(b, E)`` scores.
      labels: ``(b, E)`` 0/1 true objects.

    Returns:
      ``(b,)`` bool: ``min_{o true} z_o > max_{e false} z_e`` (True if a row has no false entity).
    """
    positive = labels > 0
    worst_true = jnp.min(jnp.where(positive, scores, jnp.inf), axis=1)
    best_false = jnp.max(jnp.where(positive, -jnp.inf, scores), axis=1)
    return worst_true > best_false


def rank_metrics(ranks: np.ndarray | jax.Array, *, ks: Sequence[int] = (1, 3, 10)) -> dict:
    """``{"mrr", "hits@k"...}`` from realistic ranks (means over all ranks given)."""
    ranks = np.asarray(ranks, dtype=np.float64)
    if ranks.ndim != 1 or ranks.size == 0 or np.any(ranks < 1):
        raise ValueError("ranks must be a non-empty 1-D array of values >= 1.")
    out = {"mrr": float(np.mean(1.0 / ranks)), "mean_rank": float(np.mean(ranks))}
    for k in ks:
        out[f"hits@{k}"] = float(np.mean(ranks <= k))
    return out


def as_partial(score_fn: Callable) -> jax.tree_util.Partial:
    """Wraps a score function as a ``jax.tree_util.Partial`` (a pytree that jit can take).

    A ``Partial(fn, params)`` whose ``fn`` is the same object across calls reuses compilations;
    a fresh lambda compiles anew.
    """
    if isinstance(score_fn, jax.tree_util.Partial):
        return score_fn
    return jax.tree_util.Partial(score_fn)


@jax.jit
def _rank_batch(score_fn, heads, relations, targets, filter_objects):
    scores = score_fn(heads, relations)
    log_p = jnp.take_along_axis(jax.nn.log_softmax(scores, axis=-1), targets[:, None], axis=1)
    return (*filtered_ranks(scores, targets, filter_objects), log_p[:, 0])


def rank_triples(
    score_fn: Callable[[jax.Array, jax.Array], jax.Array],
    triples: np.ndarray,
    known: QueryTargets,
    *,
    num_relations: int,
    batch_size: int = 512,
) -> dict[str, np.ndarray]:
    """Filtered ranks of both sides of every triple.

    Args:
      score_fn: ``(heads (b,), relations (b,)) -> (b, E)`` scores, relations ``2R``-indexed; traced
        under jit (batches are padded to ``batch_size``). Pass a ``jax.tree_util.Partial`` of a
        fixed function and the parameters to reuse the compilation across models.
      triples: ``(t, 3)`` int triples to rank, without inverses.
      known: index of *all* known triples (train + valid + test, inverses included) used for
        filtering, from ``build_query_targets``.
      num_relations: ``R`` (original relations).
      batch_size: rows per call of ``score_fn``.

    Returns:
      ``{"optimistic", "pessimistic", "realistic"}``: ``(2t,)`` float ranks, tail side first, and
      ``"log_prob"``: ``(2t,)`` ``log_softmax(scores)`` at the true object (unfiltered; its mean
      negated is the test NLL).
    """
    both = add_inverse_triples(triples, num_relations=num_relations)
    rows = lookup_queries(both[:, :2], known)
    filter_objects = known.objects[rows]

    score_fn = as_partial(score_fn)
    pad = (-len(both)) % batch_size
    both_p = np.concatenate([both, np.repeat(both[:1], pad, axis=0)])
    filt_p = np.concatenate([filter_objects, np.repeat(filter_objects[:1], pad, axis=0)])
    out = [[], [], [], []]
    for i in range(0, len(both_p), batch_size):
        sl = slice(i, i + batch_size)
        res = _rank_batch(score_fn, both_p[sl, 0], both_p[sl, 1], both_p[sl, 2], filt_p[sl])
        for acc, r in zip(out, res, strict=True):
            acc.append(np.asarray(r))
    names = ("optimistic", "pessimistic", "realistic", "log_prob")
    return {n: np.concatenate(a)[: len(both)] for n, a in zip(names, out, strict=True)}
