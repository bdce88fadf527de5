"""Filtered ranking against a brute-force float64 reference (PyKEEN's tie handling)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax.kge import add_inverse_triples, build_query_targets
from lowrank_jax.kge.metrics import filtered_ranks, perfect_ranking, rank_metrics, rank_triples

# A hand-made graph: 5 entities, 2 relations.
E, R = 5, 2
TRAIN = np.array([[0, 0, 1], [0, 0, 2], [1, 1, 3], [2, 0, 4], [3, 1, 0]], np.int32)
TEST = np.array([[0, 0, 3], [1, 1, 4], [4, 0, 2]], np.int32)


def _brute_force_ranks(score_table, triples, known):
    """Loops over both sides of every triple with explicit filtering and tie counting."""
    known = {tuple(t) for t in add_inverse_triples(known, num_relations=R)}
    out = []
    for s, r, o in add_inverse_triples(triples, num_relations=R):
        z = score_table[(s, r)]
        competitors = [e for e in range(E) if e != o and (s, r, e) not in known]
        better = sum(z[e] > z[o] for e in competitors)
        equal = sum(z[e] == z[o] for e in competitors)
        out.append((1 + better, 1 + better + equal, 1 + better + 0.5 * equal))
    return np.array(out, np.float64)


def test_rank_triples_matches_brute_force_with_ties():
    rng = np.random.default_rng(0)
    # integer-valued scores produce many ties
    table = rng.integers(0, 3, size=(E, 2 * R, E)).astype(np.float32)
    score_fn = lambda h, r: jnp.asarray(table)[h, r]
    known_triples = np.concatenate([TRAIN, TEST])
    known = build_query_targets(add_inverse_triples(known_triples, num_relations=R), num_entities=E)
    ranks = rank_triples(score_fn, TEST, known, num_relations=R, batch_size=4)
    ref = _brute_force_ranks(
        {(s, r): table[s, r] for s in range(E) for r in range(2 * R)}, TEST, known_triples
    )
    np.testing.assert_allclose(ranks["optimistic"], ref[:, 0], atol=0)
    np.testing.assert_allclose(ranks["pessimistic"], ref[:, 1], atol=0)
    np.testing.assert_allclose(ranks["realistic"], ref[:, 2], atol=0)
    assert np.any(ref[:, 0] != ref[:, 1]), "the test graph should contain ties"
    metrics = rank_metrics(ranks["realistic"], ks=(1, 3))
    np.testing.assert_allclose(metrics["mrr"], np.mean(1.0 / ref[:, 2]), rtol=1e-12)
    np.testing.assert_allclose(metrics["hits@3"], np.mean(ref[:, 2] <= 3), rtol=1e-12)


def test_filtered_ranks_hand_computed():
    scores = jnp.array([[0.5, 0.9, 0.5, 0.1, 0.5]])
    # target 0 (score .5); entity 1 (.9) is a known true object -> filtered; ties with 2 and 4.
    opt, pess, real = filtered_ranks(scores, jnp.array([0]), jnp.array([[1, 0, 5]]))
    assert float(opt[0]) == 1.0 and float(pess[0]) == 3.0 and float(real[0]) == 2.0
    # unfiltered (only padding): entity 1 counts
    opt, pess, real = filtered_ranks(scores, jnp.array([0]), jnp.array([[5]]))
    assert (float(opt[0]), float(pess[0]), float(real[0])) == (2.0, 4.0, 3.0)


def test_filtered_ranks_under_jit_and_errors():
    scores = jax.random.normal(jax.random.key(0), (6, 7))
    targets = jnp.arange(6)
    ref = filtered_ranks(scores, targets, jnp.full((6, 1), 7))
    jitted = jax.jit(filtered_ranks)(scores, targets, jnp.full((6, 1), 7))
    for a, b in zip(ref, jitted, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="expected scores"):
        filtered_ranks(scores[0], targets, jnp.full((6, 1), 7))
    with pytest.raises(ValueError, match="ranks"):
        rank_metrics(np.array([0.5]))


def test_perfect_ranking():
    scores = jnp.array([[3.0, 2.0, 1.0], [3.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    labels = jnp.array([[1, 1, 0], [1, 1, 0], [1, 0, 0]], jnp.float32)
    # row 1: true object 1 ties with false 2 -> not perfect; row 2: tie with false 1.
    np.testing.assert_array_equal(perfect_ranking(scores, labels), [True, False, False])


def test_rank_triples_log_prob_and_train_fit_metrics_match_brute_force():
    from lowrank_jax.kge import train_fit_metrics

    rng = np.random.default_rng(3)
    table = rng.integers(0, 4, size=(E, 2 * R, E)).astype(np.float32)
    score_fn = lambda h, r: jnp.asarray(table)[h, r]
    both = add_inverse_triples(TRAIN, num_relations=R)
    train_index = build_query_targets(both, num_entities=E)
    ranks = rank_triples(score_fn, TRAIN, train_index, num_relations=R, batch_size=3)
    log_p = np.array([_log_softmax64(table[s, r])[o] for s, r, o in both])
    np.testing.assert_allclose(ranks["log_prob"], log_p, atol=1e-5)
    fit = train_fit_metrics(score_fn, train_index, num_entities=E, batch_size=4)
    ref = _brute_force_ranks(
        {(s, r): table[s, r] for s in range(E) for r in range(2 * R)}, TRAIN, TRAIN
    )
    np.testing.assert_allclose(fit["mrr"], np.mean(1.0 / ref[:, 2]), atol=1e-6)
    np.testing.assert_allclose(fit["hits@1"], np.mean(ref[:, 2] <= 1), atol=1e-12)
    np.testing.assert_allclose(fit["nll"], -np.mean(log_p), atol=1e-5)
    perfect = []
    for (s, r), objs in zip(train_index.queries, train_index.objects, strict=True):
        objs = [o for o in objs if o < E]
        z = table[s, r]
        others = [e for e in range(E) if e not in objs]
        perfect.append(not others or min(z[objs]) > max(z[others]))
    np.testing.assert_allclose(fit["perfect"], np.mean(perfect), atol=1e-12)


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())
