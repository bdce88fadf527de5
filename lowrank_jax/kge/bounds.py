"""Necessary embedding dimensions for linear output layers: Forster-type sign-rank bounds.

A KGE with a linear output layer scores all objects of all queries as ``Z = H E^T``, a matrix of
rank at most ``d``. Ranking every true object of every query above every other entity ("ranking
reconstruction") means ``sign(Z - tau 1^T) = Y`` for some per-query thresholds ``tau``, where
``Y in {+1, -1}^{|Q| x |E|}`` is the training label matrix; ``Z - tau 1^T`` has rank at most
``d + 1``, so

    d >= sign-rank(Y) - 1.

Forster (2002), in the form of Forster, Krause, Lokam, Mubarakzjanov, Schmitt and Simon (2001):
for any real ``M`` with ``sign(M) = Y`` (no zero entries)::

    sign-rank(Y) >= sqrt(|Q| |E|) * min_ij |M_ij| / ||M||_2.

With ``M = Y`` this is the classic ``sqrt(|Q||E|)/||Y||`` (exact, ``sqrt(n)``, for a Hadamard matrix),
but it is at most ``1 / |1 - 2p|`` for a graph of density ``p`` because the all-ones direction
dominates ``||Y||``. Re-weighting ``M`` while keeping its signs removes that direction:

- ``"plain"``: ``M = Y``;
- ``"centered"``: ``M = A - p 1 1^T`` (``A`` the 0/1 label matrix, ``p`` the density);
- ``"row_centered"``: ``M_q = (A_q - p_q 1^T) / min(p_q, 1 - p_q)`` with ``p_q`` the density of
  query ``q`` (so ``min |M_ij| = 1``).

Every weighting gives a valid lower bound; the reported bound is their maximum. For random graphs
the centered bound grows like ``sqrt(p) * sqrt(|Q||E|) / (sqrt(|Q|) + sqrt(|E|))``: with graph size
and density, the shape of the necessary bounds in P4 (whose exact statements are not public).

``||M||_2`` is computed from the ``|E| x |E|`` Gram matrix ``M^T M`` assembled from the sparse
``A`` (so ``|Q| x |E|`` is never formed densely), in float64.

References:
  P4 (necessary bounds on ``d`` for all linear-output KGEs); J. Forster, "A linear lower bound on
  the unbounded error probabilistic communication complexity", JCSS 2002; Forster et al.,
  "Relations between communication complexity, linear arrangements, and computational
  complexity", FSTTCS 2001. The choice of weightings is this library's reconstruction.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg

from lowrank_jax.kge.graphs import add_inverse_triples, build_query_targets, graph_stats

__all__ = [
    "WEIGHTINGS",
    "forster_bound",
    "linear_output_dim_bound",
    "sign_rank_lower_bound",
]

WEIGHTINGS = ("plain", "centered", "row_centered")


def forster_bound(matrix: np.ndarray) -> float:
    """Forster's lower bound ``sqrt(n m) min|M_ij| / ||M||_2`` on the sign-rank of ``sign(M)``.

    Args:
      matrix: ``(n, m)`` real matrix with no zero entries (e.g. a ``+-1`` sign matrix).

    Returns:
      The bound (a float; the sign-rank is at least its ceiling).

    Raises:
      ValueError: if the matrix is not 2-D or has a zero entry.
    """
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.size == 0:
        raise ValueError(f"matrix must be a non-empty 2-D array; got shape {matrix.shape}.")
    smallest = np.min(np.abs(matrix))
    if smallest == 0:
        raise ValueError("matrix has a zero entry, so its sign pattern is undefined.")
    n, m = matrix.shape
    return float(np.sqrt(n * m) * smallest / scipy.linalg.norm(matrix, 2))


def _top_eigenvalue(gram: np.ndarray) -> float:
    if gram.shape[0] <= 2000:
        return float(scipy.linalg.eigvalsh(gram)[-1])
    return float(scipy.sparse.linalg.eigsh(gram, k=1, which="LA", return_eigenvectors=False)[0])


def sign_rank_lower_bound(labels, *, weighting: str = "best") -> float:
    """Forster-type lower bound on the sign-rank of ``Y = 2 A - 1`` from a 0/1 label matrix ``A``.

    Args:
      labels: ``(q, E)`` 0/1 matrix (dense array or ``scipy.sparse``); rows are queries.
      weighting: ``"plain"``, ``"centered"``, ``"row_centered"`` (see the module docstring) or
        ``"best"`` (the maximum of the three).

    Returns:
      A float ``b`` with ``sign-rank(Y) >= b``.

    Raises:
      ValueError: on an unknown weighting or an all-zero/all-one matrix for ``"centered"``.
    """
    if weighting == "best":
        return max(sign_rank_lower_bound(labels, weighting=w) for w in WEIGHTINGS)
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose 'best' or one of {WEIGHTINGS}.")
    a = scipy.sparse.csr_matrix(labels, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError("labels must be a non-empty 2-D 0/1 matrix.")
    if a.nnz and not np.all(a.data == 1.0):
        raise ValueError("labels must contain only 0 and 1.")
    q, e = a.shape
    degree = np.asarray(a.sum(axis=1)).ravel()
    if weighting == "plain":
        c = np.full(q, 0.5)
        r = np.full(q, 2.0)  # M = 2 (A - 1/2) = Y
    elif weighting == "centered":
        p = degree.sum() / (q * e)
        if p in (0.0, 1.0):
            raise ValueError("the centered weighting needs both true and false entries.")
        c = np.full(q, p)
        r = np.ones(q)
    else:
        c = degree / e
        # rows that are all-true or all-false: centre at 1/2 instead (any threshold keeps signs).
        c = np.where((c == 0.0) | (c == 1.0), 0.5, c)
        r = 1.0 / np.minimum(c, 1.0 - c)
    # M = D_r (A - c 1^T);  M^T M = A^T R^2 A - u 1^T - 1 u^T + s 1 1^T, with u = A^T (r^2 c).
    r2 = r**2
    ata = (a.T @ scipy.sparse.diags(r2) @ a).toarray()
    u = np.asarray(a.T @ (r2 * c)).ravel()
    s = float(np.sum(r2 * c**2))
    gram = ata - u[:, None] - u[None, :] + s
    norm = np.sqrt(max(_top_eigenvalue(gram), 0.0))
    # smallest |M_ij| = r_q * c_q at false entries, r_q * (1 - c_q) at true entries.
    has_false = degree < e
    has_true = degree > 0
    smallest = np.min(
        np.concatenate([(r * c)[has_false], (r * (1.0 - c))[has_true]]),
    )
    return float(np.sqrt(q * e) * smallest / norm)


def linear_output_dim_bound(
    train: np.ndarray, *, num_entities: int, num_relations: int
) -> dict[str, float]:
    """Necessary ``d`` for a linear-output KGE to rank the training set perfectly, with graph stats.

    Builds the query-by-entity label matrix of the training triples with inverse relations and
    returns :func:`~lowrank_jax.kge.graphs.graph_stats` plus ``forster_plain``,
    ``forster_centered``, ``forster_row_centered`` (sign-rank bounds), ``sign_rank_bound`` (their
    maximum) and ``min_dim = max(ceil(sign_rank_bound) - 1, 1)``, the smallest ``d`` that the
    bound allows (``d >= sign-rank - 1``; ComplEx counts real dimensions).

    Args:
      train: ``(t, 3)`` int training triples (no inverses).
      num_entities: ``E``.
      num_relations: ``R``.

    Returns:
      A dict of floats/ints.
    """
    targets = build_query_targets(
        add_inverse_triples(train, num_relations=num_relations), num_entities=num_entities
    )
    rows = np.repeat(np.arange(len(targets.queries)), targets.counts)
    cols = targets.objects[targets.objects < num_entities]
    a = scipy.sparse.csr_matrix(
        (np.ones(len(rows)), (rows, cols)), shape=(len(targets.queries), num_entities)
    )
    out: dict[str, float] = dict(
        graph_stats(train, num_entities=num_entities, num_relations=num_relations)
    )
    for w in WEIGHTINGS:
        out[f"forster_{w}"] = sign_rank_lower_bound(a, weighting=w)
    out["sign_rank_bound"] = max(out[f"forster_{w}"] for w in WEIGHTINGS)
    out["min_dim"] = max(int(np.ceil(out["sign_rank_bound"] - 1e-9)) - 1, 1)
    return out
