"""BatchIterator: epochs are permutations fixed by (seed, epoch); resuming repeats the stream."""

import json

import numpy as np
import pytest

from lowrank_jax.data import BatchIterator, Dataset


def _data(n=23):
    return Dataset(np.arange(n, dtype=np.float32)[:, None], np.arange(n) % 4, tuple("abcd"))


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_epochs_are_permutations_fixed_by_seed_and_epoch():
    it = BatchIterator(_data(), batch_size=5, seed=7, drop_remainder=False)
    assert len(it) == 5 and it.num_examples == 23
    epochs = []
    for _ in range(3):
        batches = _take(it, len(it))
        assert [len(b["y"]) for b in batches] == [5, 5, 5, 5, 3]
        ids = np.concatenate([b["x"][:, 0] for b in batches]).astype(int)
        assert sorted(ids.tolist()) == list(range(23))
        np.testing.assert_array_equal(ids, it.epoch_order(len(epochs)))
        epochs.append(ids)
        for b in batches:  # x and y stay paired
            np.testing.assert_array_equal(b["y"], b["x"][:, 0].astype(int) % 4)
    assert not np.array_equal(epochs[0], epochs[1])
    np.testing.assert_array_equal(
        epochs[1], np.random.default_rng([7, 1]).permutation(23)
    )  # documented order
    other = BatchIterator(_data(), batch_size=5, seed=8, drop_remainder=False)
    assert not np.array_equal(np.concatenate([b["x"] for b in _take(other, 5)])[:, 0], epochs[0])


def test_drop_remainder_and_no_shuffle():
    it = BatchIterator(_data(), batch_size=5, seed=0, shuffle=False, num_epochs=2)
    batches = list(it)
    assert len(batches) == 8 and all(len(b["x"]) == 5 for b in batches)
    np.testing.assert_array_equal(batches[0]["x"][:, 0], np.arange(5))
    np.testing.assert_array_equal(batches[4]["x"][:, 0], np.arange(5))  # epoch 2 restarts
    assert it.state() == {"epoch": 2, "position": 0}
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("stop_after", [0, 3, 4, 9])
def test_resume_gives_the_identical_remaining_batches(drop_remainder, stop_after):
    kwargs = dict(batch_size=5, seed=3, drop_remainder=drop_remainder)
    reference = _take(BatchIterator(_data(), **kwargs), 14)
    it = BatchIterator(_data(), **kwargs)
    _take(it, stop_after)
    saved = json.loads(json.dumps(it.state()))  # survives a JSON checkpoint
    assert all(type(v) is int for v in saved.values())
    for resumed in (
        BatchIterator(_data(), state=saved, **kwargs),
        BatchIterator(_data(), **kwargs).restore(saved),
        it,
    ):
        rest = _take(resumed, 14 - stop_after)
        for a, b in zip(rest, reference[stop_after:], strict=True):
            assert a.keys() == b.keys() == {"x", "y"}
            np.testing.assert_array_equal(a["x"], b["x"])
            np.testing.assert_array_equal(a["y"], b["y"])


def test_mapping_and_tuple_inputs():
    arrays = {"tokens": np.arange(12).reshape(6, 2), "mask": np.ones((6, 2), bool)}
    batch = next(BatchIterator(arrays, batch_size=4, seed=0))
    assert batch.keys() == {"tokens", "mask"} and batch["tokens"].shape == (4, 2)
    x, y = np.arange(6), np.arange(6) * 10
    batch = next(BatchIterator((x, y), batch_size=3, seed=0))
    np.testing.assert_array_equal(batch["y"], batch["x"] * 10)
    texts = Dataset(np.array(["a", "b", "c"], dtype=object), np.zeros(3, np.int32), ("z",))
    assert next(BatchIterator(texts, batch_size=2, seed=0))["x"].dtype == object


@pytest.mark.parametrize(
    "kwargs, state",
    [
        ({"batch_size": 0}, None),
        ({"batch_size": 30}, None),  # larger than the data with drop_remainder
        ({"batch_size": 4, "seed": -1}, None),
        ({"batch_size": 4}, {"epoch": 0}),
        ({"batch_size": 4}, {"epoch": 0, "position": 24}),
    ],
)
def test_bad_arguments(kwargs, state):
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(ValueError):
        BatchIterator(_data(), state=state, **kwargs)
    with pytest.raises(ValueError, match="leading"):
        BatchIterator({"a": np.zeros(3), "b": np.zeros(4)}, batch_size=1, seed=0)
    with pytest.raises(TypeError):
        BatchIterator([1, 2, 3], batch_size=1, seed=0)
