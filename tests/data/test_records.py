"""Dataset records and deterministic, disjoint, stratified splits."""

import numpy as np
import pytest

from lowrank_jax.data import Dataset, Splits, load_digits, split
from lowrank_jax.data.records import to_arrays


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def _toy(n=20, num_classes=3):
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    y = np.arange(n) % num_classes
    return Dataset(x, y, tuple("abc"[:num_classes]))


def test_dataset_record_normalises_and_takes():
    ds = _toy()
    assert ds.y.dtype == np.int32 and len(ds) == 20 and ds.num_classes == 3
    sub = ds.take([5, 1, 7])
    np.testing.assert_array_equal(sub.x, ds.x[[5, 1, 7]])
    np.testing.assert_array_equal(sub.y, [2, 1, 1])
    assert sub.class_names == ds.class_names
    mask = ds.y == 0
    assert len(ds.take(mask)) == int(mask.sum())
    assert "float32[20, 2]" in repr(ds)


@pytest.mark.parametrize(
    "x, y, names, error",
    [
        (np.zeros((3, 2)), np.zeros(4, np.int32), ("a",), ValueError),  # length mismatch
        (np.zeros((3, 2)), np.zeros((3, 1), np.int32), ("a",), ValueError),  # y not 1-D
        (np.zeros((3, 2)), np.array([0, 1, 2]), ("a", "b"), ValueError),  # label out of range
        (np.zeros((3, 2)), np.array([0.0, 1.0, 0.0]), ("a", "b"), TypeError),  # float labels
    ],
)
def test_dataset_rejects_bad_input(x, y, names, error):
    with pytest.raises(error):
        Dataset(x, y, names)


def test_split_is_deterministic_disjoint_and_complete(digits):
    a = split(digits, seed=3, valid_fraction=0.1, test_fraction=0.2)
    b = split(digits, seed=3, valid_fraction=0.1, test_fraction=0.2)
    c = split(digits, seed=4, valid_fraction=0.1, test_fraction=0.2)
    assert isinstance(a, Splits)
    for pa, pb in zip(a, b, strict=True):
        np.testing.assert_array_equal(pa.x, pb.x)
        np.testing.assert_array_equal(pa.y, pb.y)
    assert not np.array_equal(a.test.x, c.test.x)
    n = len(digits)
    assert (len(a.train), len(a.valid), len(a.test)) == (
        n - round(0.1 * n) - round(0.2 * n),
        round(0.1 * n),
        round(0.2 * n),
    )
    # Identify examples by their (unique) index, carried through the split as a feature.
    tagged = Dataset(np.arange(n), digits.y, digits.class_names)
    parts = split(tagged, seed=3, valid_fraction=0.1, test_fraction=0.2)
    ids = [set(p.x.tolist()) for p in parts]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert set.union(*ids) == set(range(n))
    for p in parts:
        np.testing.assert_array_equal(p.y, digits.y[p.x])  # labels travel with their examples
        assert np.all(np.diff(p.x) > 0)  # original order kept


def test_split_is_stratified(digits):
    parts = split(digits, seed=0, valid_fraction=0.15, test_fraction=0.25)
    counts = np.bincount(digits.y, minlength=10)
    test_counts = np.bincount(parts.test.y, minlength=10)
    valid_counts = np.bincount(parts.valid.y, minlength=10)
    # Largest-remainder rounding: each class gets floor or ceil of its quota.
    assert np.all(np.abs(test_counts - counts * 0.25) < 1.0)
    assert np.all(np.abs(valid_counts - counts * 0.15) <= 2.0)
    assert np.all(np.bincount(parts.train.y, minlength=10) > 0)


def test_split_without_stratification_and_empty_parts():
    ds = _toy(50)
    parts = split(ds, seed=1, valid_fraction=0.0, test_fraction=0.3, stratify=False)
    assert (len(parts.train), len(parts.valid), len(parts.test)) == (35, 0, 15)
    assert parts.valid.x.shape == (0, 2)


@pytest.mark.parametrize("valid, test", [(-0.1, 0.2), (0.5, 0.5), (0.2, 1.0)])
def test_split_rejects_bad_fractions(valid, test):
    with pytest.raises(ValueError, match="fraction"):
        split(_toy(), seed=0, valid_fraction=valid, test_fraction=test)


def test_to_arrays_keeps_each_part_row_for_row():
    parts = split(_toy(), seed=1, valid_fraction=0.2, test_fraction=0.2)
    arrays = to_arrays(parts)
    assert list(arrays) == ["train", "valid", "test"]
    for name, part in parts._asdict().items():
        assert arrays[name]["x"].dtype == np.float32
        np.testing.assert_array_equal(arrays[name]["x"], part.x)
        np.testing.assert_array_equal(arrays[name]["y"], part.y)
    # A custom encoding sees the part's examples; the labels stay the part's.
    encoded = to_arrays(parts, encode=lambda x: {"s": x.sum(axis=1), "first": x[:, 0]})
    np.testing.assert_array_equal(encoded["test"]["s"], parts.test.x.sum(axis=1))
    assert list(encoded["test"]) == ["s", "first", "y"]


def test_to_arrays_rejects_bad_input():
    parts = split(_toy(), seed=0, valid_fraction=0.2, test_fraction=0.2)
    with pytest.raises(TypeError, match="Splits"):
        to_arrays(parts.train)
    with pytest.raises(ValueError, match="rows"):
        to_arrays(parts, encode=lambda x: {"x": x[:1]})
    with pytest.raises(ValueError, match="'y'"):
        to_arrays(parts, encode=lambda x: {"y": x[:, 0]})
