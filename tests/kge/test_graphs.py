"""Inverse triples, query grouping and synthetic graphs."""

import numpy as np
import pytest

from lowrank_jax.kge import add_inverse_triples, build_query_targets, make_synthetic_kg
from lowrank_jax.kge.graphs import graph_stats, lookup_queries, query_label_matrix


def test_query_targets_roundtrip():
    train = np.array([[0, 0, 1], [0, 0, 2], [2, 1, 0], [0, 0, 1]], np.int32)
    both = add_inverse_triples(train, num_relations=2)
    np.testing.assert_array_equal(both[4:], [[1, 2, 0], [2, 2, 0], [0, 3, 2], [1, 2, 0]])
    t = build_query_targets(both, num_entities=3)
    np.testing.assert_array_equal(t.queries, [[0, 0], [0, 3], [1, 2], [2, 1], [2, 2]])
    np.testing.assert_array_equal(t.counts, [2, 1, 1, 1, 1])
    np.testing.assert_array_equal(t.objects[0], [1, 2])
    np.testing.assert_array_equal(t.objects[1], [2, 3])  # padded with num_entities
    labels = query_label_matrix(t, num_entities=3)
    np.testing.assert_array_equal(labels[0], [0, 1, 1])
    np.testing.assert_array_equal(lookup_queries(np.array([[2, 2], [0, 0]]), t), [4, 0])
    with pytest.raises(ValueError, match="not in the index"):
        lookup_queries(np.array([[1, 0]]), t)
    stats = graph_stats(train, num_entities=3, num_relations=2)
    assert stats["triples"] == 3 and stats["queries"] == 5
    np.testing.assert_allclose(stats["density"], 6 / 15)


def test_synthetic_graph_density_and_splits():
    g = make_synthetic_kg(num_entities=60, num_relations=3, density=0.1, seed=3)
    all_triples = np.concatenate([g.train, g.valid, g.test])
    assert len(np.unique(all_triples, axis=0)) == len(all_triples)
    np.testing.assert_allclose(len(all_triples) / (60 * 3 * 60), 0.1, atol=0.01)
    assert g.train.dtype == np.int32 and len(g.entity_names) == 60


def test_input_errors():
    with pytest.raises(ValueError, match=r"shape \(t, 3\)"):
        add_inverse_triples(np.zeros((2, 2), np.int32), num_relations=1)
    with pytest.raises(TypeError, match="integer"):
        add_inverse_triples(np.zeros((2, 3)), num_relations=1)
    with pytest.raises(ValueError, match="relation ids"):
        add_inverse_triples(np.array([[0, 1, 0]]), num_relations=1)
    with pytest.raises(ValueError, match="density"):
        make_synthetic_kg(num_entities=5, num_relations=1, density=1.5)
