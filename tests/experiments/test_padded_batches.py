"""padded_batches: every row once with weight 1, fixed chunk shape, zero-weight padding."""

import numpy as np

from experiments import common


def test_padded_batches_cover_every_row_once_with_fixed_shape():
    arrays = {"x": np.arange(14, dtype=np.float32).reshape(7, 2), "y": np.arange(7)}
    out = list(common.padded_batches(arrays, 3))
    assert [c["x"].shape for c, _ in out] == [(3, 2)] * 3
    weights = np.concatenate([w for _, w in out])
    np.testing.assert_array_equal(weights, [1, 1, 1, 1, 1, 1, 1, 0, 0])
    ys = np.concatenate([c["y"] for c, _ in out])
    np.testing.assert_array_equal(ys[weights > 0], arrays["y"])
    np.testing.assert_array_equal(ys[7:], [6, 6])  # padding repeats the last row
    assert len(list(common.padded_batches(arrays, 7))) == 1


def test_padded_means_are_the_means_over_real_rows():
    from experiments.common.evaluation import padded_means

    arrays = {"x": np.arange(7, dtype=np.float32), "y": np.arange(7)}
    seen = []

    def sums(chunk, weight):
        seen.append(len(weight))
        return {"x": np.sum(chunk["x"] * weight), "one": np.sum(weight)}

    out = padded_means(sums, arrays, 3)
    assert seen == [3, 3, 3] and list(out) == ["x", "one"]
    np.testing.assert_allclose(out["x"], arrays["x"].mean())  # padding repeats 6.0, weight 0
    assert out["one"] == 1.0
