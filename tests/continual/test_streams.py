"""The synthetic long stream of specs §2, the benchmark builders and TaskStream helpers."""

import numpy as np
import pytest

from lowrank_jax import continual, data
from lowrank_jax.continual.streams import class_incremental_stream, training_arrays


def test_long_stream_shapes_and_shared_subspace():
    tasks, task_of_class = continual.long_stream(
        seed=0,
        num_tasks=4,
        classes_per_task=3,
        dim=16,
        subspace_dim=4,
        train_per_class=20,
        test_per_class=5,
    )
    assert len(tasks) == 4
    train, test = tasks[1]
    assert train.x.shape == (60, 16) and test.x.shape == (15, 16)
    assert sorted(set(train.y.tolist())) == [3, 4, 5]
    np.testing.assert_array_equal(task_of_class, np.repeat(np.arange(4), 3))
    # class means of all tasks lie in one 4-d subspace
    means = np.stack([t[0].x[t[0].y == c].mean(0) for t in tasks for c in np.unique(t[0].y)])
    s = np.linalg.svd(means, compute_uv=False)
    assert s[4] < 0.25 * s[3]
    with pytest.raises(ValueError, match="subspace_dim"):
        continual.long_stream(dim=4, subspace_dim=5)


def _pool(num_classes=10, per_class=12, shape=(4, 4, 1), seed=0):
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(num_classes), per_class)
    rng.shuffle(y)
    x = rng.normal(size=(len(y), *shape)).astype(np.float32)
    return data.Dataset(x, y.astype(np.int32), tuple(str(c) for c in range(num_classes)))


def test_split_digits_tasks_are_permutations_of_the_same_data():
    train, test = _pool(seed=0), _pool(per_class=3, seed=1)
    stream = continual.split_digits(train, test, num_tasks=4, seed=3)
    flat = train.x.reshape(len(train.y), -1)
    assert stream.protocol == "til" and stream.num_classes == 40 and stream.base_classes == 5
    np.testing.assert_array_equal(stream.tasks[0]["train"]["x"], flat)
    np.testing.assert_array_equal(stream.tasks[0]["train"]["y"], train.y)
    # task 1: the same rows with permuted pixels (sorted pixels per row unchanged), labels + 10
    t1 = stream.tasks[1]["train"]
    np.testing.assert_array_equal(np.sort(t1["x"], 1), np.sort(flat, 1))
    assert not np.array_equal(t1["x"], flat)
    np.testing.assert_array_equal(t1["y"], train.y + 10)
    # task 2: pixels kept, labels permuted inside the block 20..29 (a bijection of the classes)
    t2 = stream.tasks[2]["test"]
    np.testing.assert_array_equal(t2["x"], test.x.reshape(len(test.y), -1))
    pairs = set(zip(test.y.tolist(), t2["y"].tolist(), strict=True))
    assert len(pairs) == 10 and {b for _, b in pairs} == set(range(20, 30))
    for t, cls in enumerate(stream.task_classes):
        np.testing.assert_array_equal(cls, np.arange(10 * t, 10 * t + 10))
    assert set(stream.base["y"].tolist()) == set(range(5))
    # the same generator state gives the same stream (the draws are the generator's)
    again = continual.split_digits(train, test, num_tasks=4, seed=np.random.default_rng(3))
    np.testing.assert_array_equal(again.tasks[3]["train"]["x"], stream.tasks[3]["train"]["x"])


def test_class_incremental_builders_partition_the_classes():
    train, test = _pool(), _pool(per_class=3, seed=1)
    cil = continual.digits_cil(train, test, num_tasks=5, seed=0)
    mnist = continual.mnist_cil(train, test, _pool(4), num_tasks=3, train_per_class=5, seed=0)
    split = continual.split_mnist(train, test, num_tasks=3, train_per_class=5, seed=0)
    for stream in (cil, mnist, split):
        assert sorted(np.concatenate(stream.task_classes).tolist()) == list(range(10))
        for task, cls in zip(stream.tasks, stream.task_classes, strict=True):
            assert set(task["train"]["y"].tolist()) == set(cls.tolist())
            # every test row of the task's classes, in dataset order
            np.testing.assert_array_equal(task["test"]["y"], test.y[np.isin(test.y, cls)])
    assert cil.tasks[0]["train"]["x"].shape[1:] == (16,)  # flattened
    assert [len(c) for c in mnist.task_classes] == [4, 3, 3] and mnist.base_classes == 4
    assert not mnist.keep_base_head and mnist.tasks[0]["train"]["x"].shape[1:] == (4, 4, 1)
    np.testing.assert_array_equal(split.task_classes[0], np.arange(5))
    assert split.keep_base_head and set(split.base["y"].tolist()) == set(range(5))
    assert np.all(np.bincount(np.concatenate([t["train"]["y"] for t in split.tasks])) == 5)
    with pytest.raises(ValueError, match="divide"):
        continual.digits_cil(train, test, num_tasks=3, seed=0)
    with pytest.raises(ValueError, match="increments"):
        continual.split_mnist(train, test, num_tasks=7, train_per_class=5, seed=0)


def test_class_incremental_stream_holds_out_a_fixed_test_split():
    pool = _pool(num_classes=6, per_class=10)
    a = class_incremental_stream(
        pool.x, pool.y, num_classes=6, num_tasks=2, classes_per_task=2, test_per_class=3, seed=0
    )
    b = class_incremental_stream(
        pool.x, pool.y, num_classes=6, num_tasks=3, classes_per_task=2, test_per_class=3, seed=1
    )
    assert len(np.concatenate(a.task_classes)) == 4  # two classes left out
    # the test rows of a class are the same for every seed; train and test are disjoint
    for s in (a, b):
        for task in s.tasks:
            assert np.all(np.bincount(task["test"]["y"])[np.unique(task["test"]["y"])] == 3)
            assert np.all(np.bincount(task["train"]["y"])[np.unique(task["train"]["y"])] == 7)
    test_a = {r.tobytes() for t in a.tasks for r in t["test"]["x"]}
    test_b = {r.tobytes() for t in b.tasks for r in t["test"]["x"]}
    train_b = {r.tobytes() for t in b.tasks for r in t["train"]["x"]}
    assert test_a <= test_b and not (test_b & train_b)
    with pytest.raises(ValueError, match="test_per_class"):
        class_incremental_stream(
            pool.x, pool.y, num_classes=6, num_tasks=1, classes_per_task=2, test_per_class=10,
            seed=0,
        )  # fmt: skip


@pytest.mark.parametrize("protocol", ["cil", "til"])
def test_training_arrays_masks(protocol):
    train, test = _pool(), _pool(per_class=3, seed=1)
    stream = continual.digits_cil(train, test, num_tasks=2, seed=0)
    stream = continual.TaskStream(stream.tasks, stream.task_classes, 10, protocol, None, 0)
    one = training_arrays(stream, [1])
    np.testing.assert_array_equal(one["x"], stream.tasks[1]["train"]["x"])
    np.testing.assert_array_equal(one["mask"][0], np.isin(np.arange(10), stream.task_classes[1]))
    both = training_arrays(stream, [0, 1])
    assert len(both["y"]) == 120 and both["mask"].shape == (120, 10)
    n0 = len(stream.tasks[0]["train"]["y"])
    assert both["mask"][n0:].all() == (protocol == "cil")
    # every row's label is inside its mask
    assert both["mask"][np.arange(120), both["y"]].all()
    with pytest.raises(ValueError, match="indices"):
        training_arrays(stream, [2])
