"""CL metrics on a hand-made accuracy matrix."""

import numpy as np
import pytest

from lowrank_jax import continual
from lowrank_jax.continual.metrics import (
    average_incremental_accuracy,
    backward_transfer,
    final_average_accuracy,
)

# R[t, j]: accuracy on task j after task t (upper triangle unused).
R = np.array(
    [
        [0.9, np.nan, np.nan],
        [0.7, 0.8, np.nan],
        [0.6, 0.75, 0.95],
    ]
)


def test_metrics_by_hand():
    np.testing.assert_allclose(final_average_accuracy(R), (0.6 + 0.75 + 0.95) / 3)
    np.testing.assert_allclose(
        average_incremental_accuracy(R), (0.9 + 0.75 + (0.6 + 0.75 + 0.95) / 3) / 3
    )
    # forgetting: task 0 best 0.9 -> 0.6 (0.3), task 1 best 0.8 -> 0.75 (0.05)
    np.testing.assert_allclose(continual.forgetting(R), (0.3 + 0.05) / 2)
    np.testing.assert_allclose(backward_transfer(R), ((0.6 - 0.9) + (0.75 - 0.8)) / 2)
    np.testing.assert_allclose(continual.plasticity(R), [0.9, 0.8, 0.95])
    s = continual.summarize(R)
    assert set(s) == {"final_acc", "avg_inc_acc", "forgetting", "bwt", "plasticity"}
    np.testing.assert_allclose(s["plasticity"], (0.9 + 0.8 + 0.95) / 3)


def test_forgetting_uses_best_earlier_accuracy_not_diagonal():
    r = np.array([[0.5, 0, 0], [0.9, 0.8, 0], [0.7, 0.8, 1.0]])
    assert continual.forgetting(r) == pytest.approx((0.2 + 0.0) / 2)
    assert backward_transfer(r) == pytest.approx((0.2 + 0.0) / 2)


def test_single_task_and_errors():
    assert continual.forgetting(np.array([[0.5]])) == 0.0
    assert backward_transfer(np.array([[0.5]])) == 0.0
    with pytest.raises(ValueError, match="square"):
        continual.summarize(np.ones((2, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        continual.summarize(np.array([[np.nan, 0], [1, 1]]))
