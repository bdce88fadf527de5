"""Tests of ``lowrank_jax.continual.evaluation.evaluate_tasks`` (one row of the accuracy matrix)."""

import math

import numpy as np
import pytest

from lowrank_jax import continual
from lowrank_jax.continual.evaluation import evaluate_tasks

C = 6
CLASSES = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]


def _method(select: bool, seen_task_ids: list):
    """A method whose inputs are its logits; it 'selects' module 0 for every example if asked."""

    def predict(state, x, task_id=None):
        seen_task_ids.append(task_id)
        return x, (np.zeros(len(x), np.int32) if select else None)

    return continual.ContinualMethod(*([None] * 5), predict, None, None)


def _tests(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for j, cls in enumerate(CLASSES):
        n = 7 + j
        out.append({"x": rng.normal(size=(n, C)).astype(np.float32), "y": rng.choice(cls, n)})
    return out


def _reference(tests, masks):
    return [
        float(np.mean(np.argmax(np.where(m, t["x"], -np.inf), -1) == t["y"]))
        for t, m in zip(tests, masks, strict=True)
    ]


@pytest.mark.parametrize("batch_size", [1, 3, 100])
def test_accuracies_equal_the_masked_argmax_reference(batch_size):
    tests, ids = _tests(), []
    seen = np.isin(np.arange(C), np.concatenate(CLASSES))
    accs, selection = evaluate_tasks(
        _method(False, ids), None, tests, CLASSES, num_classes=C, batch_size=batch_size
    )
    np.testing.assert_allclose(accs, _reference(tests, [seen] * 3), rtol=0, atol=1e-12)
    assert math.isnan(selection) and set(ids) == {None}
    ids.clear()
    til, _ = evaluate_tasks(
        _method(False, ids), None, tests, CLASSES, num_classes=C, task_incremental=True,
        batch_size=batch_size,
    )  # fmt: skip
    masks = [np.isin(np.arange(C), cls) for cls in CLASSES]
    np.testing.assert_allclose(til, _reference(tests, masks), rtol=0, atol=1e-12)
    assert sorted(set(ids)) == [0, 1, 2]


def test_selection_accuracy_counts_examples_routed_to_their_task():
    tests = _tests(1)
    _, selection = evaluate_tasks(_method(True, []), None, tests, CLASSES, num_classes=C)
    n = [len(t["y"]) for t in tests]
    assert selection == pytest.approx(n[0] / sum(n), abs=1e-12)  # module 0 is right on task 0


def test_bad_input_raises():
    method, tests = _method(False, []), _tests()
    with pytest.raises(ValueError, match="one entry per task"):
        evaluate_tasks(method, None, tests, CLASSES[:2], num_classes=C)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate_tasks(method, None, tests, CLASSES, num_classes=C, batch_size=0)
    empty = [*tests[:2], {"x": np.zeros((0, C)), "y": np.zeros(0, int)}]
    with pytest.raises(ValueError, match="task 2 is empty"):
        evaluate_tasks(method, None, empty, CLASSES, num_classes=C)


@pytest.mark.parametrize("protocol", ["cil", "til"])
def test_evaluate_stream_is_evaluate_tasks_on_the_streams_test_splits(protocol):
    tests, ids = _tests(), []
    tasks = [{"train": t, "test": t} for t in tests]
    stream = continual.TaskStream(tasks, CLASSES, C, protocol, None, 0)
    got = continual.evaluate_stream(_method(False, ids), None, stream, 1, batch_size=4)
    want = evaluate_tasks(
        _method(False, []), None, tests[:2], CLASSES[:2], num_classes=C,
        task_incremental=protocol == "til", batch_size=4,
    )  # fmt: skip
    np.testing.assert_array_equal(got[0], want[0])
    assert len(got[0]) == 2 and set(ids) == ({0, 1} if protocol == "til" else {None})
    with pytest.raises(ValueError, match="task index"):
        continual.evaluate_stream(_method(False, []), None, stream, 3)
