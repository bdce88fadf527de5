"""P9 Fano-type packing: closed-form excess risk, the exact posterior over unknown good sets
against brute force, the Bayes decision, and the floor below every method."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis import multitask_lower_bound as lb


@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0])
def test_excess_risk_closed_form_matches_integral(beta):
    centers, window = lb.packing_centers(0.04, 5)
    c = float(centers[3])
    for t in (c, 0.47, 0.55, 0.8, 0.1):  # inside and outside the window
        grid = np.linspace(min(t, c), max(t, c), 40001)
        eta = np.asarray(lb.packing_eta(grid, c, beta=beta, window=float(window)), np.float64)
        want = np.trapezoid(np.abs(2 * eta - 1), grid)
        got = float(lb.packing_excess_risk(t, c, beta=beta, window=float(window)))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-7)


def _brute_posterior(lr, num_good):  # every k-subset of the sources, in float64
    terms = [
        lr[0] + lr[1:][list(s)].sum(0) for s in itertools.combinations(range(len(lr) - 1), num_good)
    ]
    logp = np.logaddexp.reduce(np.stack(terms), axis=0)
    return logp - np.logaddexp.reduce(logp)


def test_posterior_sums_over_unknown_good_sets_exactly():
    centers, window = lb.packing_centers(0.05, 4)
    good = jnp.array([True, True, False, True, False, False])
    x, y = lb.sample_packing_tasks(
        jax.random.key(3), centers[1], good, n=60, beta=0.5, window=window
    )
    # float64 reference: each task's window samples, good (hypothesis j) against decoy (η = ½).
    xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
    inside = np.abs(xs - 0.5) <= float(window)
    lr = np.zeros((len(xs), len(centers)))
    for j, c in enumerate(np.asarray(centers, np.float64)):
        eta = np.clip(
            0.5 + np.clip(xs - c, -0.5, 0.5), 1e-6, 1 - 1e-6
        )  # β = ½: η_j(x) = x − t_j + ½
        ll = ys * np.log(eta) + (1 - ys) * np.log1p(-eta) - np.log(0.5)
        lr[:, j] = np.sum(np.where(inside, ll, 0.0), axis=1)
    for k in (0, 1, 2, 5):
        got = lb.packing_posterior(x, y, centers, beta=0.5, window=window, num_good=k)
        np.testing.assert_allclose(np.asarray(got), _brute_posterior(lr, k), atol=1e-4)
    known = lb.packing_posterior(x, y, centers, beta=0.5, window=window, good=good)
    logp = lr[np.asarray(good)].sum(0)
    np.testing.assert_allclose(np.asarray(known), logp - np.logaddexp.reduce(logp), atol=1e-4)
    # Decoy samples carry no information: with every source a decoy, k = 0 is the target alone.
    target_only = lr[0] - np.logaddexp.reduce(lr[0])
    np.testing.assert_allclose(np.asarray(lb.packing_posterior(
        x, y, centers, beta=0.5, window=window, num_good=0)), target_only, atol=1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="exactly one of"):
        lb.packing_posterior(x, y, centers, beta=0.5, window=window)


@pytest.mark.parametrize("beta", [0.5, 0.75, 1.0])
def test_bayes_threshold_minimises_posterior_expected_risk(beta):
    centers, window = lb.packing_centers(0.03, 5)
    rng = np.random.default_rng(0)
    for _ in range(5):
        log_post = jnp.log(jnp.asarray(rng.dirichlet(np.ones(5)), jnp.float32))
        t = lb.bayes_threshold(log_post, centers, beta=beta)

        def risk(t, log_post=log_post):
            return jnp.sum(
                jnp.exp(log_post) * lb.packing_excess_risk(t, centers, beta=beta, window=window)
            )

        grid = jnp.linspace(0.3, 0.7, 4001)
        assert float(risk(t)) <= float(jnp.min(jax.vmap(risk)(grid))) + 1e-7


def test_floor_lies_below_every_method_and_the_oracle_floor_below_it():
    risks = jax.jit(lambda k: lb.simulate_packing_family(
        k, num_tasks=8, n=20, num_good=3, beta=0.5, c=0.5, num_draws=200))(jax.random.key(0))  # fmt: skip
    mean = dict(zip(lb.PACKING_ESTIMATORS, np.asarray(risks).mean(0), strict=True))
    assert risks.shape == (200, len(analysis.ESTIMATORS) + 2)
    for e in analysis.ESTIMATORS:
        assert mean["bayes_floor"] <= mean[e], e
    assert mean["bayes_oracle"] <= mean["bayes_floor"]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="at least 2"):
        lb.packing_centers(0.1, 1)
    with pytest.raises(ValueError, match="num_tasks >= 1"):
        lb.simulate_packing_family(jax.random.key(0), num_tasks=0, n=10, num_good=0)
    with pytest.raises(ValueError, match="beta"):
        lb.packing_separation(10, 1, c=1.0, beta=1.5)
