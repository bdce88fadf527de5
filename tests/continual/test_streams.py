"""The synthetic long stream of specs §2."""

import numpy as np
import pytest

from lowrank_jax import continual


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
