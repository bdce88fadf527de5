"""P9 threshold-class simulator: ERM against brute force, closed forms, estimator identities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import analysis
from lowrank_jax.analysis import multitask as mt


def _errors(xs, ys, ws, t):
    return np.sum(ws * np.where(xs >= t, 1 - ys, ys))


def test_weighted_erm_matches_brute_force():
    rng = np.random.default_rng(0)
    erm = jax.jit(mt.weighted_threshold_erm)
    for _ in range(20):
        m = 40
        xs = np.sort(rng.uniform(size=m))
        ys = (rng.uniform(size=m) < xs).astype(np.float64)
        ws = rng.uniform(size=m) * (rng.uniform(size=m) < 0.6)  # many zero weights
        t = float(erm(jnp.asarray(xs), jnp.asarray(ys), jnp.asarray(ws)))
        cands = np.concatenate([[0.0], (xs[1:] + xs[:-1]) / 2, [1.0]])
        best = min(_errors(xs, ys, ws, c) for c in cands)
        np.testing.assert_allclose(_errors(xs, ys, ws, t), best, rtol=1e-5, atol=1e-6)
        # The threshold is the midpoint of the positive-weight points around it.
        act = xs[ws > 0]
        lo = act[act < t].max() if (act < t).any() else 0.0
        hi = act[act >= t].min() if (act >= t).any() else 1.0
        np.testing.assert_allclose(t, (lo + hi) / 2, atol=1e-6)


def test_excess_risk_closed_form_matches_integral():
    for beta in (0.5, 0.7, 1.0):
        for t in (0.1, 0.45, 0.8):
            grid = np.linspace(min(t, 0.5), max(t, 0.5), 20001)
            eta = np.asarray(mt.target_eta(grid, beta=beta), np.float64)
            integral = np.trapezoid(np.abs(2 * eta - 1), grid)
            np.testing.assert_allclose(
                float(mt.threshold_excess_risk(t, beta=beta)), integral, rtol=1e-3, atol=1e-7
            )


def test_pooled_is_erm_of_concatenated_data_and_oracle_finds_clean_threshold():
    key = jax.random.key(0)
    good = jnp.array([True, True, False, True, False])
    x, y = mt.sample_threshold_tasks(key, good, n=30, beta=1.0, width=0.3)  # good: noiseless
    xv, yv = x[0, :5], y[0, :5]
    estimates = jax.jit(lambda *a: mt.threshold_estimates(*a, beta=1.0))
    t = np.asarray(estimates(x, y, xv, yv, good))
    est = dict(zip(analysis.ESTIMATORS, t, strict=True))
    xa, ya = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    order = np.argsort(xa)
    xs, ys = xa[order], ya[order]
    cands = np.concatenate([[0.0], (xs[1:] + xs[:-1]) / 2, [1.0]])
    best = min(_errors(xs, ys, 1.0, c) for c in cands)
    assert _errors(xs, ys, 1.0, est["pooled"]) == best
    # Good tasks are noiseless (beta = 1): the oracle separates their samples exactly.
    xg = np.asarray(x)[np.asarray(good)].ravel()
    assert xg[xg < 0.5].max() < est["oracle"] <= xg[xg >= 0.5].min()
    # Target-only uses row 0 alone.
    x0 = np.asarray(x[0])
    assert x0[x0 < 0.5].max() < est["target_only"] <= x0[x0 >= 0.5].min()


def test_decoys_are_flat_in_their_zone():
    good = jnp.array([True] + [False] * 200)
    x, y = mt.sample_threshold_tasks(jax.random.key(1), good, n=200, beta=0.5, width=0.2)
    x, y = np.asarray(x[1:]), np.asarray(y[1:])
    zone = np.abs(x - 0.5) <= 0.2
    frac = y[zone].mean()
    se = 0.5 / np.sqrt(zone.sum())
    assert abs(frac - 0.5) < 4 * se
    outside = ~zone & (x > 0.5)
    np.testing.assert_allclose(
        y[outside].mean(), x[outside].mean(), atol=4 * 0.5 / np.sqrt(outside.sum())
    )


def test_without_decoys_pooled_equals_oracle():
    r = np.asarray(
        mt.simulate_threshold_family(
            jax.random.key(2), num_tasks=4, n=20, num_good=4, c=1.0, num_draws=6, batch_size=3
        )
    )
    i, j = analysis.ESTIMATORS.index("pooled"), analysis.ESTIMATORS.index("oracle")
    np.testing.assert_array_equal(r[:, i], r[:, j])
    assert r.shape == (6, len(analysis.ESTIMATORS)) and np.all(r >= 0)


def test_a_fixed_width_is_used_as_given_at_every_n():
    # width=w is the n-scaled family with c = w n^{β/(2−β)}: the same draws, not rescaled again.
    kw = dict(num_tasks=3, num_good=1, num_draws=4, n_val=5, batch_size=4)
    for n in (20, 200):
        fixed = mt.simulate_threshold_family(jax.random.key(4), n=n, width=0.1, **kw)
        scaled = mt.simulate_threshold_family(jax.random.key(4), n=n, c=0.1 * n ** (1 / 3), **kw)
        np.testing.assert_array_equal(np.asarray(fixed), np.asarray(scaled))
    # ... and differs from c = w, which shrinks the zone to w n^{−1/3}.
    other = mt.simulate_threshold_family(jax.random.key(4), n=200, c=0.1, **kw)
    assert not np.array_equal(np.asarray(fixed), np.asarray(other))
    with pytest.raises(ValueError, match="exactly one of c"):
        mt.simulate_threshold_family(jax.random.key(0), n=20, c=1.0, width=0.1, **kw)
    with pytest.raises(ValueError, match="exactly one of c"):
        mt.simulate_threshold_family(jax.random.key(0), n=20, **kw)


def test_empirical_excess_risk_matches_brute_force():
    rng = np.random.default_rng(3)
    s = rng.uniform(size=300)
    y = (rng.uniform(size=300) < s).astype(np.float64)
    ts = np.array([0.2, 0.5, 0.77])
    errs = [np.mean((s >= t) != y) for t in np.concatenate([np.sort(s), [1.1]])]
    got = np.asarray(mt.empirical_excess_risk(ts, s, y))
    want = np.array([np.mean((s >= t) != y) for t in ts]) - min(errs)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="beta"):
        mt.threshold_excess_risk(0.3, beta=0.0)
    with pytest.raises(ValueError, match="num_tasks"):
        mt.simulate_threshold_family(jax.random.key(0), num_tasks=0, n=10, num_good=1, c=1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        mt.decoy_width(0, c=1.0)


def test_rank_scores_is_the_mid_rank_ecdf():
    v = np.array([3.0, 1.0, 3.0, 2.0, 3.0, 0.5])
    want = [(np.sum(v < a) + 0.5 * np.sum(v == a)) / len(v) for a in v]
    np.testing.assert_allclose(mt.rank_scores(v), want, rtol=0, atol=1e-12)


def _toy_groups():
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(12), rng.integers(3, 9, size=12))
    rng.shuffle(groups)
    scores = rng.uniform(size=len(groups))
    labels = (rng.uniform(size=len(groups)) < scores).astype(np.float64)
    return scores, labels, groups


def test_group_pool_partitions_groups_and_finds_best_threshold():
    scores, labels, groups = _toy_groups()
    pool = mt.group_pool(scores, labels, groups, num_target_groups=3, seed=1)
    # Each source segment holds exactly the members of one group (recovered via the scores).
    member = {float(s): int(g) for s, g in zip(scores.astype(np.float32), groups, strict=True)}
    seen = []
    for a, m in zip(pool["group_starts"], pool["group_sizes"], strict=True):
        gs = {member[float(s)] for s in pool["scores"][a : a + m]}
        assert len(gs) == 1 and m == np.sum(groups == next(iter(gs)))
        seen += gs
    assert len(set(seen)) == 9 and pool["target_start"] == sum(pool["group_sizes"])
    t0 = pool["target_start"]
    train = {member[float(s)] for s in pool["scores"][t0 : t0 + pool["target_size"]]}
    test = {member[float(np.float32(s))] for s in pool["test"][0]}
    assert train | test == set(range(12)) - set(seen)  # the target is the held-out groups
    assert pool["target_size"] + len(pool["test"][0]) == np.sum(~np.isin(groups, seen))
    src = np.isin(groups, seen)
    err = lambda t: np.mean((scores[src] >= t) != labels[src])  # noqa: E731
    assert err(pool["center"]) == pytest.approx(pool["pool_error"])
    assert pool["pool_error"] <= min(err(t) for t in np.linspace(0, 1, 1001)) + 1e-12


def test_sample_pool_tasks_draws_from_each_task_segment():
    p = 50
    scores = jnp.arange(p, dtype=jnp.float32) / p  # the score encodes the pool index
    labels = jnp.zeros(p)
    starts, sizes = jnp.array([0, 10, 45]), jnp.array([10, 35, 5])
    good = jnp.array([True, True, False])
    x, _ = mt.sample_pool_tasks(
        jax.random.key(0), scores, labels, good, n=400, center=0.5, width=0.0, starts=starts,
        sizes=sizes,
    )  # fmt: skip
    idx = np.rint(np.asarray(x) * p).astype(int)
    for i in range(3):
        assert set(idx[i]) == set(range(int(starts[i]), int(starts[i] + sizes[i])))
    with pytest.raises(ValueError, match="both starts and sizes"):
        mt.sample_pool_tasks(
            jax.random.key(0), scores, labels, good, n=4, center=0.5, width=0.1, starts=starts
        )
    with pytest.raises(ValueError, match="num_target_groups"):
        mt.group_pool(*_toy_groups(), num_target_groups=12)
