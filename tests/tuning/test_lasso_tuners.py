"""P12 tuners: same budget for all, the right argmin on known objectives, Optuna TPE as a peer."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from lowrank_jax import tuning
from lowrank_jax.tuning.lasso import prepare_instances, tie_weights
from lowrank_jax.tuning.lasso_tuners import coordinate_refine, instance_losses
from lowrank_jax.tuning.search import LogBox

TARGET = np.array([0.03, 0.3, 3.0, 0.1])


def _bowl(alphas):  # minimum 0 at TARGET, quadratic in log10
    return np.sum((np.log10(alphas) - np.log10(TARGET[: alphas.shape[1]])) ** 2, axis=1)


class Counter:
    def __init__(self):
        self.n = 0

    def __call__(self, a):
        self.n += len(a)
        return _bowl(a)


def test_grid_search_picks_the_grid_argmin():
    f = Counter()
    r = tuning.log_grid_search(f, budget=41, low=1e-3, high=10.0)
    grid = np.geomspace(1e-3, 10.0, 41)
    assert r.best_point[0] == pytest.approx(grid[np.argmin(np.abs(np.log10(grid / 0.03)))])
    assert f.n == r.num_evals == 41


def test_random_search_refine_respects_budget_and_improves():
    f = Counter()
    key = jax.random.key(0)
    rs = tuning.random_search(_bowl, LogBox(4, 1e-3, 10.0), key=key, budget=60, goal="min")
    r = tuning.random_refine_search(
        f, LogBox(4, 1e-3, 10.0), key=key, budget=80, refine_fraction=0.25
    )
    assert f.n == r.num_evals <= 80
    assert (
        r.best_value <= rs.best_value and r.best_value < 0.5 * rs.best_value
    )  # refinement helps on a bowl
    assert r.best_value == pytest.approx(_bowl(r.best_point[None])[0])
    assert np.all((r.best_point >= 1e-3) & (r.best_point <= 10.0))


def test_coordinate_refine_finds_a_separable_minimum():
    r = coordinate_refine(
        _bowl, np.ones(2), float(_bowl(np.ones((1, 2)))[0]), budget=200, low=1e-3, high=10.0
    )
    np.testing.assert_allclose(np.log10(r.best_point), np.log10(TARGET[:2]), atol=0.05)
    assert r.num_evals <= 200


def test_tpe_peer_uses_its_budget():
    pytest.importorskip("optuna")
    f = Counter()
    r = tuning.tpe_search(f, LogBox(2, 1e-3, 10.0), seed=0, budget=30, n_init=10, goal="min")
    assert f.n == r.num_evals == 30
    assert r.best_value == pytest.approx(_bowl(r.best_point[None])[0], rel=1e-9)
    assert r.best_value < 1.0


def test_bad_tuner_input_raises():
    with pytest.raises(ValueError, match="low < high"):
        tuning.log_grid_search(_bowl, budget=5, low=1.0, high=0.1)
    with pytest.raises(ValueError, match="budget"):
        tuning.random_search(
            _bowl, LogBox(2, 0.1, 1.0), key=jax.random.key(0), budget=0, goal="min"
        )
    with pytest.raises(ValueError, match="refine_fraction"):
        tuning.random_refine_search(
            _bowl, LogBox(2, 0.1, 1.0), key=jax.random.key(0), budget=5, refine_fraction=1.0
        )


def test_instance_losses_are_validation_losses_and_padding_changes_nothing():
    inst = tuning.sample_group_instances(
        jax.random.key(1), 5, group_sizes=(3,) * 4, active_probs=(0.9, 0.5, 0.2, 0.1), n_train=12,
        n_val=7,
    )  # fmt: skip
    pen = tuning.group_lasso((3,) * 4)
    alphas = np.array([[0.05, 0.5], [0.2, 0.01], [1.0, 1.0]])
    g = instance_losses(inst.train, inst.val, pen, num_iters=100)
    u = g(alphas)
    w = tie_weights(alphas.astype(np.float32), num_weights=4)
    ref = tuning.validation_losses(inst.train, inst.val, w, pen, num_iters=100)
    assert u.shape == (5, 3) and u.dtype == np.float64
    np.testing.assert_allclose(u, np.asarray(ref), rtol=1e-6)
    f = tuning.empirical_risk(inst.train, inst.val, pen, num_iters=100)
    np.testing.assert_allclose(f(alphas), u.mean(0), rtol=1e-6)
    prep = prepare_instances(inst.train, pen)  # prepared input, padded batches
    padded = instance_losses(prep, inst.val, pen, num_iters=100, pad=True)
    np.testing.assert_allclose(padded(alphas), u, rtol=1e-6)  # 3 -> 4 candidates
    for n in (1, 3, 5):  # the first n instances (3 -> 4 solved, 5 -> 8: all 5)
        np.testing.assert_allclose(padded(alphas, n), u[:n], rtol=1e-5)  # float32 sums
        np.testing.assert_allclose(g(alphas[:1], n), u[:n, :1], rtol=1e-6)
    with pytest.raises(ValueError, match="do not divide"):
        g(np.ones((2, 3)))
