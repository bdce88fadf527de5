"""1-N training with inverse relations, and training-set fit metrics.

A model is a scorer (query encoder, :mod:`lowrank_jax.kge.scorers`) plus an output layer
(:mod:`lowrank_jax.kge.outputs`). Training follows the local closed-world 1-N regime (PyKEEN's
LCWA): every training triple ``(s, r, o)`` also gives ``(o, r + R, s)``; the triples are grouped by
query ``(s, r)``; one epoch visits every query once in a random order, in mini-batches, with the
loss of :func:`~lowrank_jax.kge.outputs.output_loss` averaged over the batch's queries.

One epoch is a single jitted call: the permutation, the batching (``lax.scan``) and the optimizer
updates all run on the device, with the parameters and optimizer state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.kge.graphs import QueryTargets, add_inverse_triples, build_query_targets
from lowrank_jax.kge.metrics import as_partial, multi_hot, perfect_ranking
from lowrank_jax.kge.outputs import init_output, output_loss, output_scores
from lowrank_jax.kge.scorers import init_scorer, query_embedding

__all__ = [
    "fit_kge",
    "init_kge",
    "kge_scores",
    "make_train_epoch",
    "train_fit_metrics",
]


def init_kge(
    key: jax.Array,
    *,
    scorer: str,
    output: str,
    num_entities: int,
    num_relations: int,
    dim: int,
    num_components: int = 1,
    init_std: float | None = None,
    proj_init: str = "random",
) -> dict[str, dict[str, jax.Array]]:
    """Parameters ``{"scorer": ..., "output": ...}`` of a KGE with ``2 R`` relation ids.

    Args:
      key: PRNG key.
      scorer: ``"distmult"``, ``"complex"`` or ``"tucker"``.
      output: ``"softmax"``, ``"sigmoid"``, ``"mos"`` or ``"mol"``.
      num_entities: ``E``.
      num_relations: ``R`` original relations (the table holds ``2 R`` with the inverses).
      dim: ``d``.
      num_components: ``K`` (mixtures only).
      init_std: embedding standard deviation (see :func:`~lowrank_jax.kge.scorers.init_scorer`).
      proj_init: mixture projection init (see :func:`~lowrank_jax.kge.outputs.init_output`).

    Returns:
      The parameter pytree.
    """
    k_s, k_o = jax.random.split(key)
    return {
        "scorer": init_scorer(
            k_s,
            scorer=scorer,
            num_entities=num_entities,
            num_relations=2 * num_relations,
            dim=dim,
            init_std=init_std,
        ),
        "output": init_output(
            k_o, output=output, dim=dim, num_components=num_components, proj_init=proj_init
        ),
    }


def kge_scores(
    params: dict, heads: jax.Array, relations: jax.Array, *, scorer: str, output: str
) -> jax.Array:
    """Scores ``(b, E)`` of all objects for queries ``(heads, relations)`` (relations ``2R``-indexed)."""
    h = query_embedding(params["scorer"], heads, relations, scorer=scorer)
    return output_scores(params["output"], params["scorer"]["entity"], h, output=output)


def make_train_epoch(
    optimizer: optax.GradientTransformation,
    *,
    scorer: str,
    output: str,
    num_entities: int,
    num_queries: int,
    batch_size: int,
) -> Callable:
    """A jitted function that runs one epoch of 1-N training.

    ``epoch(params, opt_state, key, queries, objects) -> (params, opt_state, loss)`` where
    ``queries (q, 2)`` and ``objects (q, m)`` come from
    :func:`~lowrank_jax.kge.graphs.build_query_targets`, ``loss`` is the epoch's mean training
    loss per query (each batch's mean loss weighted by its number of real queries). ``params`` and ``opt_state`` are donated. The last batch is padded with
    zero-weight rows, so every query is used exactly once per epoch.

    Args:
      optimizer: an optax transformation.
      scorer: scorer kind.
      output: output-layer kind.
      num_entities: ``E``.
      num_queries: ``q``, number of training queries (fixes the scan length).
      batch_size: queries per step (``>= q`` for full batch).

    Returns:
      The jitted epoch function.
    """
    if batch_size < 1 or num_queries < 1:
        raise ValueError("batch_size and num_queries must be positive.")
    batch_size = min(batch_size, num_queries)
    num_batches = -(-num_queries // batch_size)

    def loss_fn(params, heads, rels, objects, weights):
        scores = kge_scores(params, heads, rels, scorer=scorer, output=output)
        labels = multi_hot(objects, num_entities=num_entities)
        losses = output_loss(scores, labels, output=output)
        return jnp.sum(weights * losses) / jnp.sum(weights)

    grad_fn = jax.value_and_grad(loss_fn)

    def step(carry, idx):
        params, opt_state, queries, objects = carry
        weights = (idx < num_queries).astype(jnp.float32)
        idx = jnp.minimum(idx, num_queries - 1)
        q = queries[idx]
        loss, grads = grad_fn(params, q[:, 0], q[:, 1], objects[idx], weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, queries, objects), loss * jnp.sum(weights)

    @partial(jax.jit, donate_argnums=(0, 1))
    def epoch(params, opt_state, key, queries, objects):
        perm = jax.random.permutation(key, num_queries)
        perm = jnp.concatenate(
            [perm, jnp.full((num_batches * batch_size - num_queries,), num_queries, perm.dtype)]
        ).reshape(num_batches, batch_size)
        (params, opt_state, _, _), losses = jax.lax.scan(
            step, (params, opt_state, queries, objects), perm
        )
        return params, opt_state, jnp.sum(losses) / num_queries

    return epoch


@partial(jax.jit, static_argnames=("num_entities",))
def _fit_batch(score_fn, queries, objects, valid, *, num_entities):
    scores = score_fn(queries[:, 0], queries[:, 1])
    labels = multi_hot(objects, num_entities=num_entities)
    log_p = jax.nn.log_softmax(scores, axis=-1)
    nll = -jnp.sum(labels * log_p, axis=1)
    perfect = perfect_ranking(scores, labels)
    obj = jnp.minimum(objects, num_entities - 1)
    present = (objects < num_entities) & valid[:, None]
    z_o = jnp.take_along_axis(scores, obj, axis=1)  # (b, m)
    negative = (labels == 0)[:, None, :]
    greater = jnp.sum(negative & (scores[:, None, :] > z_o[:, :, None]), axis=2)
    equal = jnp.sum(negative & (scores[:, None, :] == z_o[:, :, None]), axis=2)
    rank = 1.0 + greater + 0.5 * equal
    return (
        jnp.sum(jnp.where(valid, nll, 0.0)),
        jnp.sum(valid & perfect),
        jnp.sum(jnp.where(present, 1.0 / rank, 0.0)),
        jnp.sum(present & (rank <= 1.0)),
        jnp.sum(present & (rank <= 10.0)),
    )


def train_fit_metrics(
    score_fn: Callable[[jax.Array, jax.Array], jax.Array],
    targets: QueryTargets,
    *,
    num_entities: int,
    batch_size: int = 1024,
) -> dict[str, float]:
    """How well a model fits the training set it was trained on.

    - ``nll``: mean over training triples (both sides) of ``-log P(o | s, r)`` with
      ``log P = log_softmax(scores)``;
    - ``mrr``, ``hits@1``, ``hits@10``: realistic ranks of each true object among the entities
      that are not true objects of the same query (training-filtered);
    - ``perfect``: fraction of queries whose true objects all outrank all other entities (strictly),
      the ranking-reconstruction feasibility of P4.

    Args:
      score_fn: ``(heads (b,), relations (b,)) -> (b, E)`` scores, traced under jit; a
        ``jax.tree_util.Partial(fn, params)`` with a fixed ``fn`` reuses the compilation.
      targets: the training queries (inverses included) from ``build_query_targets``.
      num_entities: ``E``.
      batch_size: queries per evaluation call.

    Returns:
      A dict of floats.
    """

    score_fn = as_partial(score_fn)
    q = len(targets.queries)
    bs = min(batch_size, q)
    pad = (-q) % bs
    queries = np.concatenate([targets.queries, np.zeros((pad, 2), np.int32)])
    objects = np.concatenate(
        [targets.objects, np.full((pad, targets.objects.shape[1]), num_entities, np.int32)]
    )
    valid = np.arange(len(queries)) < q
    totals = np.zeros(5)
    for i in range(0, len(queries), bs):
        sl = slice(i, i + bs)
        res = _fit_batch(score_fn, queries[sl], objects[sl], valid[sl], num_entities=num_entities)
        totals += np.array([float(x) for x in res])
    n_triples = float(targets.counts.sum())
    return {
        "nll": totals[0] / n_triples,
        "perfect": totals[1] / q,
        "mrr": totals[2] / n_triples,
        "hits@1": totals[3] / n_triples,
        "hits@10": totals[4] / n_triples,
    }


def fit_kge(
    train: np.ndarray,
    *,
    num_entities: int,
    num_relations: int,
    scorer: str = "distmult",
    output: str = "softmax",
    dim: int = 32,
    num_components: int = 1,
    epochs: int = 100,
    batch_size: int = 1024,
    learning_rate: float = 1e-2,
    seed: int = 0,
    init_std: float | None = None,
    log_every: int = 0,
    callback: Callable[[int, float], None] | None = None,
) -> tuple[dict, list[float]]:
    """Trains a KGE with 1-N training, inverse relations and Adam; returns ``(params, losses)``.

    A convenience wrapper over :func:`init_kge` and :func:`make_train_epoch` (one device call per
    epoch; the loss is only brought to the host every ``log_every`` epochs and at the end).

    Args:
      train: ``(t, 3)`` int training triples without inverses.
      num_entities: ``E``.
      num_relations: ``R``.
      scorer: scorer kind.
      output: output-layer kind.
      dim: ``d``.
      num_components: ``K`` (mixtures).
      epochs: passes over the training queries.
      batch_size: queries per step.
      learning_rate: Adam learning rate.
      seed: PRNG seed for initialisation and shuffling.
      init_std: embedding init scale.
      log_every: call ``callback(epoch, loss)`` every this many epochs (0: only at the end).
      callback: optional logging hook.

    Returns:
      The trained parameters and the list of logged epoch losses.

    Example:
      >>> import numpy as np
      >>> from lowrank_jax.kge import fit_kge, make_synthetic_kg
      >>> g = make_synthetic_kg(num_entities=20, num_relations=2, density=0.1)
      >>> params, losses = fit_kge(g.train, num_entities=20, num_relations=2, dim=8, epochs=5)
    """
    targets = build_query_targets(
        add_inverse_triples(train, num_relations=num_relations), num_entities=num_entities
    )
    key = jax.random.key(seed)
    key, k_init = jax.random.split(key)
    params = init_kge(
        k_init,
        scorer=scorer,
        output=output,
        num_entities=num_entities,
        num_relations=num_relations,
        dim=dim,
        num_components=num_components,
        init_std=init_std,
    )
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    epoch_fn = make_train_epoch(
        optimizer,
        scorer=scorer,
        output=output,
        num_entities=num_entities,
        num_queries=len(targets.queries),
        batch_size=batch_size,
    )
    queries = jnp.asarray(targets.queries)
    objects = jnp.asarray(targets.objects)
    losses = []
    for epoch in range(1, epochs + 1):
        key, k_epoch = jax.random.split(key)
        params, opt_state, loss = epoch_fn(params, opt_state, k_epoch, queries, objects)
        if (log_every and epoch % log_every == 0) or epoch == epochs:
            losses.append(float(loss))
            if callback is not None:
                callback(epoch, losses[-1])
    return params, losses
