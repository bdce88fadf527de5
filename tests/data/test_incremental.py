"""Class-incremental streams: disjoint class groups, global labels, every example kept once."""

import numpy as np
import pytest

from lowrank_jax.data import Dataset, load_digits
from lowrank_jax.data.incremental import split_by_classes, task_classes


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _classes(tasks):
    return [sorted(set(t.y.tolist())) for t in tasks]


def test_equal_tasks_partition_the_data(digits):
    tasks = split_by_classes(digits, classes_per_task=2)
    assert _classes(tasks) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert sum(len(t) for t in tasks) == len(digits)
    for t in tasks:
        assert t.class_names == digits.class_names  # labels stay global
        np.testing.assert_array_equal(t.x, digits.x[np.isin(digits.y, t.y)])


def test_base_session_and_increments(digits):
    tasks = split_by_classes(digits, base_classes=4, increment=3)
    assert _classes(tasks) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [len(t) for t in tasks] == [
        int(np.isin(digits.y, c).sum()) for c in ([0, 1, 2, 3], [4, 5, 6], [7, 8, 9])
    ]


def test_class_order_and_seeded_order(digits):
    order = [9, 3, 5, 0, 1, 7]
    tasks = split_by_classes(digits, classes_per_task=3, class_order=order)
    assert _classes(tasks) == [[3, 5, 9], [0, 1, 7]]  # a subset of the classes is allowed
    a = split_by_classes(digits, classes_per_task=5, seed=0)
    b = split_by_classes(digits, classes_per_task=5, seed=0)
    assert _classes(a) == _classes(b)
    expected = np.random.default_rng(0).permutation(10)
    assert _classes(a) == [sorted(expected[:5].tolist()), sorted(expected[5:].tolist())]
    assert sorted(sum(_classes(a), [])) == list(range(10))


def test_works_on_any_labelled_dataset():
    ds = Dataset(np.array(list("abcdef"), dtype=object), np.array([2, 0, 1, 2, 1, 0]), tuple("xyz"))
    tasks = split_by_classes(ds, base_classes=1, increment=2)
    assert [t.x.tolist() for t in tasks] == [["b", "f"], ["a", "c", "d", "e"]]  # dataset order kept


def test_task_classes():
    assert task_classes(100, base_classes=50, increment=10) == [range(0, 50)] + [
        range(50 + 10 * i, 60 + 10 * i) for i in range(5)
    ]
    assert task_classes(6, classes_per_task=6) == [range(0, 6)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # nothing says how to group
        {"classes_per_task": 3},  # 10 classes not divisible by 3
        {"base_classes": 4},  # increment missing
        {"classes_per_task": 2, "base_classes": 4, "increment": 2},
        {"classes_per_task": 2, "class_order": [0, 1], "seed": 0},
        {"classes_per_task": 1, "class_order": [0, 0]},
        {"classes_per_task": 1, "class_order": [0, 11]},
        {"base_classes": 0, "increment": 5},
    ],
)
def test_bad_arguments(digits, kwargs):
    with pytest.raises(ValueError):
        split_by_classes(digits, **kwargs)
