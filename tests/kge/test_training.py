"""1-N training: loss bookkeeping and a perfect fit of a tiny graph at sufficient dimension."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.adapters import count_params
from lowrank_jax.kge import (
    add_inverse_triples,
    build_query_targets,
    fit_kge,
    kge_scores,
    make_synthetic_kg,
    train_fit_metrics,
)
from lowrank_jax.kge.metrics import multi_hot
from lowrank_jax.kge.outputs import output_loss
from lowrank_jax.kge.training import init_kge, make_train_epoch


def _tiny():
    g = make_synthetic_kg(num_entities=10, num_relations=2, density=0.25, seed=0)
    return g.train, 10, 2


def test_full_batch_epoch_loss_equals_mean_query_loss():
    train, e, r = _tiny()
    t = build_query_targets(add_inverse_triples(train, num_relations=r), num_entities=e)
    params = init_kge(
        jax.random.key(0),
        scorer="distmult",
        output="softmax",
        num_entities=e,
        num_relations=r,
        dim=4,
    )
    scores = kge_scores(
        params, t.queries[:, 0], t.queries[:, 1], scorer="distmult", output="softmax"
    )
    ref = jnp.mean(output_loss(scores, multi_hot(t.objects, num_entities=e), output="softmax"))
    opt = optax.sgd(0.0)
    epoch = make_train_epoch(
        opt,
        scorer="distmult",
        output="softmax",
        num_entities=e,
        num_queries=len(t.queries),
        batch_size=10**6,
    )
    copy = jax.tree.map(jnp.array, params)
    new, _, loss = epoch(copy, opt.init(copy), jax.random.key(1), t.queries, t.objects)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new, params)


def test_minibatch_padding_keeps_every_query_once():
    # with lr 0 and a batch size that does not divide q, the epoch loss is the mean over all
    # queries: every query is visited once and padded rows carry zero weight.
    train, e, r = _tiny()
    t = build_query_targets(add_inverse_triples(train, num_relations=r), num_entities=e)
    q = len(t.queries)
    params = init_kge(
        jax.random.key(0),
        scorer="complex",
        output="mos",
        num_entities=e,
        num_relations=r,
        dim=4,
        num_components=2,
    )
    opt = optax.sgd(0.0)
    epoch = make_train_epoch(
        opt, scorer="complex", output="mos", num_entities=e, num_queries=q, batch_size=q // 3 + 1
    )
    _, _, loss = epoch(
        jax.tree.map(jnp.array, params), opt.init(params), jax.random.key(1), t.queries, t.objects
    )
    scores = kge_scores(params, t.queries[:, 0], t.queries[:, 1], scorer="complex", output="mos")
    ref = jnp.mean(output_loss(scores, multi_hot(t.objects, num_entities=e), output="mos"))
    np.testing.assert_allclose(loss, ref, rtol=1e-5)


def test_tiny_graph_fits_perfectly_at_sufficient_dimension():
    train, e, r = _tiny()
    t = build_query_targets(add_inverse_triples(train, num_relations=r), num_entities=e)
    params, losses = fit_kge(
        train,
        num_entities=e,
        num_relations=r,
        scorer="complex",
        dim=16,
        epochs=300,
        batch_size=10**6,
        learning_rate=0.05,
        log_every=100,
    )
    assert losses[-1] < losses[0]
    score_fn = lambda h, r: kge_scores(params, h, r, scorer="complex", output="softmax")
    fit = train_fit_metrics(score_fn, t, num_entities=e)
    assert fit["perfect"] == 1.0
    np.testing.assert_allclose(fit["mrr"], 1.0, atol=1e-6)
    assert count_params(params) == (e + 2 * r) * 16  # entities + relations with inverses
