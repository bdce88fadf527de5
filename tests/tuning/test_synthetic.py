"""P12 instances from a real data set: random row subsets split into training and validation."""

import jax
import numpy as np
import pytest

from lowrank_jax.tuning.synthetic import sample_row_instances


def test_row_instances_are_disjoint_row_subsets_of_the_data():
    r, d = 30, 4
    x = np.arange(r * d, dtype=np.float32).reshape(r, d)  # row i is identified by x[i, 0] / d
    y = -np.arange(r, dtype=np.float32)
    inst = sample_row_instances(jax.random.key(3), x, y, 5, n_train=8, n_val=6)
    assert inst.xt.shape == (5, 8, d) and inst.xv.shape == (5, 6, d) and inst.yv.shape == (5, 6)
    assert np.all(np.isnan(inst.beta)) and inst.beta.shape == (5, d)
    for i in range(5):
        rows_t, rows_v = inst.xt[i, :, 0] / d, inst.xv[i, :, 0] / d
        np.testing.assert_array_equal(inst.xt[i], x[rows_t.astype(int)])  # (x, y) pairs kept
        np.testing.assert_array_equal(inst.yt[i], -rows_t)
        np.testing.assert_array_equal(inst.yv[i], -rows_v)
        assert len(set(rows_t) | set(rows_v)) == 14  # distinct rows; the splits share none
    assert len({tuple(inst.xt[i, :, 0]) for i in range(5)}) == 5  # independent draws
    again = sample_row_instances(jax.random.key(3), x, y, 5, n_train=8, n_val=6)
    for a, b in zip(inst[:4], again[:4], strict=True):
        np.testing.assert_array_equal(a, b)  # the key fixes the draw


def test_row_instances_bad_input_raises():
    x, y = np.ones((10, 3)), np.ones(10)
    with pytest.raises(ValueError, match="exceeds the 10 rows"):
        sample_row_instances(jax.random.key(0), x, y, 2, n_train=6, n_val=5)
    with pytest.raises(ValueError, match=r"y \(R,\)"):
        sample_row_instances(jax.random.key(0), x, y[:9], 2, n_train=3, n_val=3)
