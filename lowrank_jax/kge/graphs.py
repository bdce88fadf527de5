"""Triple-array utilities for 1-N link prediction: inverse relations, query indices, graph statistics.

A knowledge graph here is an int array of triples ``(head, relation, tail)`` of shape ``(t, 3)`` with
entities in ``[0, num_entities)`` and relations in ``[0, num_relations)``. 1-N training and ranking
use *queries* ``(s, r)`` and the set of their true objects; the inverse-relation trick turns head
prediction ``(?, r, o)`` into tail prediction ``(o, r + num_relations, ?)``, so every triple gives two
queries.

These functions run on the host (NumPy) once per dataset; what they return is fed to jitted code.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "QueryTargets",
    "SyntheticKG",
    "add_inverse_triples",
    "build_query_targets",
    "graph_stats",
    "lookup_queries",
    "make_synthetic_kg",
    "query_label_matrix",
]


class QueryTargets(NamedTuple):
    """Queries and their true objects, padded.

    Attributes:
      queries: ``(q, 2)`` int32 ``(subject, relation)`` pairs, sorted lexicographically, unique.
      objects: ``(q, m)`` int32 true objects of each query, padded with ``num_entities`` (an
        out-of-range sentinel that scatters with ``mode="drop"`` ignore), ``m`` the largest number
        of objects of any query.
      counts: ``(q,)`` int32 number of true objects of each query.
    """

    queries: np.ndarray
    objects: np.ndarray
    counts: np.ndarray


class SyntheticKG(NamedTuple):
    """A synthetic graph with the same fields as ``lowrank_jax.data.KGData``."""

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    entity_names: tuple[str, ...]
    relation_names: tuple[str, ...]


def _check_triples(triples: np.ndarray, name: str = "triples") -> np.ndarray:
    triples = np.asarray(triples)
    if triples.ndim != 2 or triples.shape[1] != 3:
        raise ValueError(
            f"{name} must have shape (t, 3) of (head, relation, tail); got {triples.shape}."
        )
    if not np.issubdtype(triples.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array; got dtype {triples.dtype}.")
    return triples.astype(np.int64)


def add_inverse_triples(triples: np.ndarray, *, num_relations: int) -> np.ndarray:
    """Appends the inverse of every triple: ``(s, r, o) -> (o, r + num_relations, s)``.

    Args:
      triples: ``(t, 3)`` int triples with relations in ``[0, num_relations)``.
      num_relations: number of original relations ``R``; inverse relations are ``R .. 2R-1``.

    Returns:
      ``(2t, 3)`` int32 triples, the originals first.

    Raises:
      ValueError: if a relation id is outside ``[0, num_relations)``.
    """
    triples = _check_triples(triples)
    if triples.size and (triples[:, 1].min() < 0 or triples[:, 1].max() >= num_relations):
        raise ValueError(
            f"relation ids must lie in [0, {num_relations}); got range "
            f"[{triples[:, 1].min()}, {triples[:, 1].max()}]. Pass the number of original relations."
        )
    inverse = np.stack([triples[:, 2], triples[:, 1] + num_relations, triples[:, 0]], axis=1)
    return np.concatenate([triples, inverse], axis=0).astype(np.int32)


def build_query_targets(triples: np.ndarray, *, num_entities: int) -> QueryTargets:
    """Groups triples by query ``(s, r)`` and pads the object lists.

    Args:
      triples: ``(t, 3)`` int triples (usually with inverse triples already added); duplicates
        are counted once.
      num_entities: number of entities ``E``; also the padding sentinel.

    Returns:
      A :class:`QueryTargets` with ``q`` unique queries.
    """
    triples = np.unique(_check_triples(triples), axis=0)  # sorted by (s, r, o)
    if triples.size and (triples[:, [0, 2]].min() < 0 or triples[:, [0, 2]].max() >= num_entities):
        raise ValueError(
            f"entity ids must lie in [0, {num_entities}); pass the right num_entities."
        )
    queries, start, counts = np.unique(
        triples[:, :2], axis=0, return_index=True, return_counts=True
    )
    width = int(counts.max()) if counts.size else 1
    objects = np.full((len(queries), width), num_entities, dtype=np.int32)
    pos = np.arange(len(triples)) - np.repeat(start, counts)
    objects[np.repeat(np.arange(len(queries)), counts), pos] = triples[:, 2]
    return QueryTargets(queries.astype(np.int32), objects, counts.astype(np.int32))


def lookup_queries(queries: np.ndarray, index: QueryTargets) -> np.ndarray:
    """Row of each ``(s, r)`` in ``index.queries``.

    Args:
      queries: ``(b, 2)`` int ``(subject, relation)`` pairs, each present in ``index``.
      index: a :class:`QueryTargets` from :func:`build_query_targets`.

    Returns:
      ``(b,)`` int32 rows.

    Raises:
      ValueError: if a query is missing from ``index`` (build it from all known triples).
    """
    queries = np.asarray(queries, dtype=np.int64)
    base = int(max(index.queries[:, 1].max(initial=0), queries[:, 1].max(initial=0))) + 1
    keys = index.queries[:, 0].astype(np.int64) * base + index.queries[:, 1]
    wanted = queries[:, 0] * base + queries[:, 1]
    rows = np.searchsorted(keys, wanted)
    rows = np.minimum(rows, len(keys) - 1)
    if len(keys) == 0 or np.any(keys[rows] != wanted):
        raise ValueError("some queries are not in the index; build it from all known triples.")
    return rows.astype(np.int32)


def query_label_matrix(targets: QueryTargets, *, num_entities: int) -> np.ndarray:
    """Dense ``(q, E)`` 0/1 float32 matrix ``Y[q, e] = 1`` iff ``(s_q, r_q, e)`` is a triple."""
    labels = np.zeros((len(targets.queries), num_entities + 1), dtype=np.float32)
    np.put_along_axis(labels, targets.objects.astype(np.int64), 1.0, axis=1)
    return labels[:, :num_entities]


def graph_stats(train: np.ndarray, *, num_entities: int, num_relations: int) -> dict[str, float]:
    """Size and connectivity of the 1-N training problem (with inverse relations).

    ``density = |T'| / (|Q| |E|)`` where ``T'`` are the unique training triples including inverses
    and ``Q`` the queries that have at least one true object: the fraction of ones in the
    query-by-entity label matrix the output layer has to fit.

    Args:
      train: ``(t, 3)`` int training triples without inverses.
      num_entities: ``E``.
      num_relations: ``R`` (original relations).

    Returns:
      A dict with ``entities, relations, triples, queries, objects_per_query_mean,
      objects_per_query_max, density``.
    """
    targets = build_query_targets(
        add_inverse_triples(train, num_relations=num_relations), num_entities=num_entities
    )
    q = len(targets.queries)
    total = int(targets.counts.sum())
    return {
        "entities": int(num_entities),
        "relations": int(num_relations),
        "triples": len(np.unique(_check_triples(train), axis=0)),
        "queries": q,
        "objects_per_query_mean": float(total / max(q, 1)),
        "objects_per_query_max": int(targets.counts.max(initial=0)),
        "density": float(total / max(q * num_entities, 1)),
    }


def make_synthetic_kg(
    *,
    num_entities: int,
    num_relations: int,
    density: float,
    seed: int = 0,
    valid_fraction: float = 0.05,
    test_fraction: float = 0.05,
) -> SyntheticKG:
    """A random graph of controlled size and density: every triple is present independently.

    Each ``(s, r, o)`` is a triple with probability ``density``, so the query-by-entity label
    matrix (with inverse relations) is an i.i.d. Bernoulli(``density``) matrix of
    ``2 R E`` rows and ``E`` columns: a graph with no structure for an embedding to exploit,
    the hardest case for a rank-``d`` output layer at a given size and density. Queries that get
    no object are given one uniformly random object so that every query exists.

    Args:
      num_entities: ``E`` (at least 2).
      num_relations: ``R`` (at least 1).
      density: probability in ``(0, 1)`` that a triple is present.
      seed: NumPy seed.
      valid_fraction: fraction of triples held out as validation.
      test_fraction: fraction held out as test.

    Returns:
      A :class:`SyntheticKG` with int32 ``train/valid/test`` triples and generated names.
    """
    if num_entities < 2 or num_relations < 1:
        raise ValueError("need num_entities >= 2 and num_relations >= 1.")
    if not 0.0 < density < 1.0:
        raise ValueError(f"density must lie in (0, 1); got {density}.")
    if valid_fraction < 0 or test_fraction < 0 or valid_fraction + test_fraction >= 1:
        raise ValueError("valid_fraction and test_fraction must be >= 0 and sum to < 1.")
    rng = np.random.default_rng(seed)
    present = rng.random((num_entities, num_relations, num_entities)) < density
    empty = ~present.any(axis=2)
    s_idx, r_idx = np.nonzero(empty)
    present[s_idx, r_idx, rng.integers(num_entities, size=len(s_idx))] = True
    triples = np.argwhere(present).astype(np.int32)
    triples = triples[rng.permutation(len(triples))]
    n_valid = int(round(valid_fraction * len(triples)))
    n_test = int(round(test_fraction * len(triples)))
    test, valid, train = np.split(triples, [n_test, n_test + n_valid])
    return SyntheticKG(
        train=train,
        valid=valid,
        test=test,
        entity_names=tuple(f"e{i}" for i in range(num_entities)),
        relation_names=tuple(f"r{i}" for i in range(num_relations)),
    )
