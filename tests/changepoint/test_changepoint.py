"""P17 online low-rank Poisson change points: definitions, calibration, errors, peers."""

from __future__ import annotations

import importlib.util
import math

import jax
import numpy as np
import pytest

from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import lowrank, peers
from lowrank_jax.changepoint.calibration import block_bootstrap_indices, quantile_threshold
from lowrank_jax.changepoint.detectors import (
    bonferroni_cusum_threshold,
    entrywise_cusum,
    totals_cusum,
)
from lowrank_jax.changepoint.lowrank import (
    check_counts,
    check_svt,
    init_lowrank_scan,
    initial_basis,
    lowrank_statistics,
    svt_threshold,
    update_lowrank_scan,
)

P, L, J, R = 6, 5, 3, 2


def _intensity(seed=0, scale=20.0):
    rng = np.random.default_rng(seed)
    lam = rng.gamma(2.0, 1.0, (P, R)) @ rng.gamma(2.0, 1.0, (R, L))
    return lam * scale / lam.mean()


def _brute_force(ys, rank, num_scales, svt=None, ranks=None):
    """D_{t,w} from its definition: float64 means of the raw slices, SVD truncation; with
    ``svt``, hard thresholding at ``τ_S = c (√(λ̄ max(p, L) ℓ_t / |S|) + ℓ_t / |S|)`` (of the
    first ``rank`` singular values), the chosen ranks appended to ``ranks``."""
    ys = np.asarray(ys, np.float64)

    def estimate(m, t, size):
        u, s, vt = np.linalg.svd(m)
        if rank is None:
            return m
        keep = np.arange(len(s)) < rank
        if svt is not None:
            ell = math.log(t**2 * (num_scales + 1) / svt.alpha)
            tau = svt.scale * (math.sqrt(svt.rate_bound * max(m.shape) * ell / size) + ell / size)
            keep &= s > tau
            if ranks is not None:
                ranks.append(int(keep.sum()))
        return (u[:, : len(s)] * (s * keep)) @ vt

    out = np.zeros((len(ys), num_scales + 1))
    for t in range(1, len(ys) + 1):
        for j, w in enumerate(2 ** np.arange(num_scales + 1)):
            if w < t:
                recent = estimate(ys[t - w : t].mean(0), t, w)
                diff = recent - estimate(ys[: t - w].mean(0), t, t - w)
                out[t - 1, j] = math.sqrt(w * (t - w) / t) * np.linalg.norm(diff)
    return out


@pytest.fixture(scope="module")
def stream():
    return np.random.default_rng(1).poisson(_intensity(), (40, P, L))


@pytest.mark.parametrize("chunk", [1, 7])
def test_statistic_equals_brute_force_definition(stream, chunk):
    basis = initial_basis(_intensity(), rank=R)
    ref = _brute_force(stream, R, J)
    got = lowrank_statistics(stream, basis, rank=R, num_scales=J, method="svd", chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-3)
    # Warm-started subspace iteration converges to the SVD truncation...
    sub = lowrank_statistics(stream, basis, rank=R, num_scales=J, power_iters=200, chunk=chunk)
    np.testing.assert_allclose(np.asarray(sub), ref, rtol=2e-3, atol=1e-2)
    # ...and one step per observation tracks it (median relative error ~1% here; the worst
    # entries are short windows whose 2nd and 3rd singular values nearly tie).
    one = np.asarray(lowrank_statistics(stream, basis, rank=R, num_scales=J, power_iters=1))
    pos = ref > 0
    assert np.median(np.abs(one[pos] - ref[pos]) / ref[pos]) < 0.03


SVT = lowrank.SVT(rate_bound=float(_intensity().max()), alpha=0.1, scale=0.3)


@pytest.mark.parametrize("chunk", [1, 7])
def test_svt_statistic_equals_brute_force_definition(stream, chunk):
    """Adaptive SVT: each window keeps the singular values above its own τ_S."""
    ranks = []
    ref = _brute_force(stream, min(P, L), J, svt=SVT, ranks=ranks)
    assert len(set(ranks)) >= 3  # the rank is chosen per window (here 1, 2 and 3 all occur)
    full = initial_basis(_intensity(), rank=min(P, L))
    got = lowrank_statistics(
        stream, full, rank=min(P, L), svt=SVT, num_scales=J, method="svd", chunk=chunk
    )
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-3)
    # the subspace iteration tracking k = 4 >= every chosen rank converges to it, and one step
    # per observation follows it closely
    basis = initial_basis(_intensity(), rank=4)
    kw = dict(rank=4, svt=SVT, num_scales=J, chunk=chunk)
    sub = lowrank_statistics(stream, basis, power_iters=200, **kw)
    np.testing.assert_allclose(np.asarray(sub), ref, rtol=2e-3, atol=1e-2)
    one = np.asarray(lowrank_statistics(stream, basis, **kw))
    pos = ref > 0
    assert np.median(np.abs(one[pos] - ref[pos]) / ref[pos]) < 0.03


def test_svt_keeps_a_change_outside_the_pre_change_span_that_a_fixed_rank_drops():
    """Noise-free stream: Y_t = Λ (rank 2) up to τ, Λ + Δ after (Δ rank 1, outside Λ's span).
    With every nonzero singular value above τ_S, a window after the change gives exactly
    D = √(w(t-w)/t) (1 - c) ‖Δ‖_F, with c = (4 - w)/(t - w) the changed share of the past
    window; the rank-2 truncation of Λ + Δ keeps Λ and drops Δ; with τ_S above every
    singular value both estimates are 0, D = 0."""
    lam = np.zeros((P, L), np.int64)
    lam[:2, :2] = [[40, 0], [0, 30]]
    delta = np.zeros((P, L), np.int64)
    delta[3:5, 2:4] = 10  # rank 1, singular value 20, orthogonal to Λ's rows and columns
    tau, t_end = 20, 24
    ys = np.concatenate([np.repeat(lam[None], tau, 0), np.repeat((lam + delta)[None], 4, 0)])
    basis = initial_basis(lam + delta, rank=4)
    small = lowrank.SVT(rate_bound=1e-6, alpha=0.5, scale=1e-3)
    d = np.asarray(lowrank_statistics(ys, basis, rank=4, svt=small, num_scales=2, method="svd"))
    for j, w in enumerate((1, 2, 4)):  # windows inside (τ, t_end]
        share = (t_end - tau - w) / (t_end - w)
        want = math.sqrt(w * (t_end - w) / t_end) * (1 - share) * np.linalg.norm(delta)
        np.testing.assert_allclose(d[-1, j], want, rtol=1e-5)
    fixed = np.asarray(lowrank_statistics(ys, basis[:, :2], rank=2, num_scales=2, method="svd"))
    assert np.all(fixed[-1] < 1e-3 * d[-1])  # the rank-2 truncation keeps Λ (40, 30), drops Δ (20)
    huge = lowrank.SVT(rate_bound=1e6, alpha=0.5)
    zero = lowrank_statistics(ys, basis, rank=4, svt=huge, num_scales=2, power_iters=3)
    np.testing.assert_array_equal(np.asarray(zero), 0.0)


def test_svt_threshold_formula_and_errors():
    svt = lowrank.SVT(rate_bound=3.0, alpha=0.05, scale=0.5)
    tau = svt_threshold(10, np.array([1.0, 8.0]), svt, p=6, num_cells=9, num_scales=3)
    ell = math.log(100 * 4 / 0.05)
    want = [0.5 * (math.sqrt(3 * 9 * ell / n) + ell / n) for n in (1, 8)]
    np.testing.assert_allclose(np.asarray(tau), want, rtol=1e-6)
    with pytest.raises(ValueError, match="alpha"):
        check_svt(lowrank.SVT(rate_bound=1.0, alpha=1.5))
    with pytest.raises(ValueError, match="rate_bound"):
        check_svt(lowrank.SVT(rate_bound=0.0, alpha=0.1))
    with pytest.raises(TypeError, match="SVT"):
        check_svt((1.0, 0.1, 1.0))
    with pytest.raises(ValueError, match="estimator"):
        cp.lowrank_scan(_intensity(), rank=R, estimator="soft")
    with pytest.raises(ValueError, match="max_rank"):
        cp.lowrank_scan(_intensity(), rank=R, estimator="rank", max_rank=4)
    with pytest.raises(ValueError, match="exceeds min"):
        cp.lowrank_scan(_intensity(), rank=R, max_rank=6)


def test_frobenius_scan_is_untruncated_definition(stream):
    ref = _brute_force(stream, None, J)
    got = lowrank_statistics(stream, np.zeros((L, 0)), rank=None, num_scales=J)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-3)


def test_state_size_does_not_grow_with_t(stream):
    basis = initial_basis(_intensity(), rank=R)
    state = init_lowrank_scan(basis, p=P, num_cells=L, num_scales=J)
    shapes = jax.tree.map(np.shape, state)
    for i in range(0, 40, 8):
        state, _ = update_lowrank_scan(state, stream[i : i + 8], rank=R)
    assert jax.tree.map(np.shape, state) == shapes
    np.testing.assert_array_equal(np.asarray(state.total), stream.sum(0))
    ring = np.roll(np.asarray(state.recent), -(40 % 2**J), axis=0)  # Y_u in slot (u-1) mod 2^J
    np.testing.assert_array_equal(ring, stream[-(2**J) :])
    w = 2 ** np.arange(J + 1)
    np.testing.assert_array_equal(np.asarray(state.sums), [stream[-k:].sum(0) for k in w])


def test_detector_score_is_max_ratio_to_threshold(stream):
    lam = _intensity()
    t = np.arange(1, 41)
    ell = np.log(t[:, None] ** 2 * (J + 1) / 0.1)
    w = 2.0 ** np.arange(J + 1)
    b = np.sqrt(lam.max() * R * max(P, L) * ell) + ell / np.sqrt(w)
    kw = dict(rank=R, num_scales=J, alpha=0.1, method="svd")
    fixed = cp.lowrank_scan(lam, estimator="rank", **kw)
    scores = np.asarray(cp.run_detector(fixed, stream, chunk=4))
    np.testing.assert_allclose(scores, (_brute_force(stream, R, J) / b).max(1), rtol=1e-4)
    # the default: SVT at τ_S with λ̄ = max Λ, the level α of b, c_τ = 0.3; no rank cap (svd)
    svt = cp.lowrank_scan(lam, svt_scale=0.3, **kw)
    scores = np.asarray(cp.run_detector(svt, stream, chunk=4))
    ref = _brute_force(stream, min(P, L), J, svt=SVT)
    np.testing.assert_allclose(scores, (ref / b).max(1), rtol=1e-4)


def _cusum_ref(x, rate, delta):
    up = down = 0.0 * rate
    out = []
    for v in x:
        up = np.maximum(0.0, up + v * np.log1p(delta) - rate * delta)
        down = np.maximum(0.0, down + v * np.log1p(-delta) + rate * delta)
        out.append(max(np.max(up), np.max(down)))
    return np.array(out)


def test_cusum_baselines_equal_their_recursions(stream):
    lam = _intensity()
    tot = cp.run_detector(totals_cusum(lam.sum(), rel_change=0.05), stream, chunk=3)
    np.testing.assert_allclose(
        np.asarray(tot), _cusum_ref(stream.sum((1, 2)), lam.sum(), 0.05), rtol=1e-4, atol=1e-3
    )
    ent = cp.run_detector(entrywise_cusum(lam, rel_change=0.3), stream)
    np.testing.assert_allclose(np.asarray(ent), _cusum_ref(stream, lam, 0.3), rtol=1e-4, atol=1e-3)
    assert bonferroni_cusum_threshold(0.05, num_cells=30, horizon=100) == pytest.approx(
        math.log(2 * 30 * 100 / 0.05)
    )


def test_block_bootstrap_indices_are_contiguous_blocks():
    idx = np.asarray(
        block_bootstrap_indices(jax.random.key(0), 50, horizon=23, block_len=5, num_streams=4)
    )
    assert idx.shape == (4, 23) and idx.min() >= 0 and idx.max() < 50
    blocks = idx[:, :20].reshape(4, 4, 5)
    np.testing.assert_array_equal(np.diff(blocks, axis=-1), 1)


def test_calibrated_threshold_gives_nominal_false_alarm_rate():
    """Threshold from a bootstrap of one training stretch; false alarms on fresh null streams."""
    alpha, horizon, n_test = 0.1, 100, 400
    lam = _intensity(scale=2.0)
    rng = np.random.default_rng(2)
    train = rng.poisson(lam, (1500, P, L))
    det = cp.lowrank_scan(train.mean(0), rank=R, num_scales=J, alpha=alpha)
    cal = cp.calibrate_threshold(
        det,
        train,
        key=jax.random.key(3),
        alpha=alpha,
        horizon=horizon,
        num_streams=400,
        batch=200,
        chunk=10,
    )
    null = rng.poisson(lam, (n_test * horizon, P, L))
    scores = cp.run_detector(
        det, null, index=np.arange(n_test * horizon).reshape(n_test, -1), chunk=10
    )
    rate = np.mean(cp.first_alarm(scores, cal.threshold) > 0)
    se = math.sqrt(alpha * (1 - alpha) / n_test) + math.sqrt(alpha * (1 - alpha) / 400)
    assert abs(rate - alpha) <= 3 * se, (rate, cal.threshold)
    assert quantile_threshold(np.arange(1, 101), 0.1) == 91


def test_refit_bootstrap_gives_nominal_rate_with_estimated_cusum_rate():
    """Totals CUSUM (total rate 6) with its rate estimated on n = 100 i.i.d. Poisson
    observations: the re-estimating bootstrap gives α on average over training stretches
    (measured 0.113 ± 0.020; the in-sample bootstrap gives 0.237 ± 0.027 on the same stretches,
    it never sees the rate's estimation error)."""
    alpha, delta, n, horizon, reps, n_fresh = 0.1, 0.1, 100, 100, 20, 200
    lam = _intensity(scale=0.2)
    rng = np.random.default_rng(4)

    def refit(stretch):
        return totals_cusum(stretch.sum((1, 2)).mean(), rel_change=delta)

    def cusum_max(x, rate):  # the two-sided recursion, NumPy (tested above against the library)
        up = down = top = np.zeros(x.shape[0])
        for t in range(x.shape[1]):
            up = np.maximum(0.0, up + x[:, t] * math.log1p(delta) - rate * delta)
            down = np.maximum(0.0, down + x[:, t] * math.log1p(-delta) + rate * delta)
            top = np.maximum(top, np.maximum(up, down))
        return top

    rates = []
    for r in range(reps):
        train = rng.poisson(lam, (n, P, L))
        det = refit(train)  # the detector actually used: rate from the whole stretch
        cal = cp.calibrate_threshold(
            det, train, key=jax.random.key(r), alpha=alpha, horizon=horizon, chunk=10, refit=refit
        )
        totals = rng.poisson(lam.sum(), (n_fresh, horizon)).astype(np.float64)
        rates.append(np.mean(cusum_max(totals, train.sum((1, 2)).mean()) > cal.threshold))
    se = np.std(rates) / math.sqrt(reps) + math.sqrt(alpha * (1 - alpha) / (reps * n_fresh))
    assert abs(np.mean(rates) - alpha) <= 3 * se, (np.mean(rates), se)
    with pytest.raises(TypeError, match="jnp"):
        cp.calibrate_threshold(
            det,
            train,
            key=jax.random.key(0),
            alpha=alpha,
            horizon=horizon,
            num_streams=4,
            refit=lambda s: cp.lowrank_scan(s.mean(0), rank=R),
        )


def test_bad_inputs_raise_clear_errors(stream):
    basis = initial_basis(_intensity(), rank=R)
    with pytest.raises(ValueError, match="negative"):
        lowrank_statistics(stream - 100, basis, rank=R, num_scales=J)
    with pytest.raises(ValueError, match="non-integer"):
        lowrank_statistics(stream + 0.5, basis, rank=R, num_scales=J)
    with pytest.raises(ValueError, match="exceeds min"):
        lowrank_statistics(stream, basis, rank=6, num_scales=J)
    with pytest.raises(ValueError, match="exceeds min"):
        cp.lowrank_scan(_intensity(), rank=9)
    with pytest.raises(TypeError, match="numeric"):
        check_counts(np.array(["a"]))
    with pytest.raises(ValueError, match="NaN"):
        check_counts(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="block_len"):
        block_bootstrap_indices(jax.random.key(0), 10, horizon=5, block_len=11, num_streams=1)
    with pytest.raises(ValueError, match="rel_change"):
        totals_cusum(10.0, rel_change=1.5)
    with pytest.raises(ValueError, match="negative"):
        cp.run_detector(totals_cusum(10.0), -stream)


_HAVE_FOCUS = importlib.util.find_spec("changepoint_online") is not None
_HAVE_RUPTURES = importlib.util.find_spec("ruptures") is not None


@pytest.mark.skipif(not _HAVE_FOCUS, reason="changepoint-online not installed (peers extra)")
def test_page_cusum_and_focus_detect_a_clear_change_alike():
    rng = np.random.default_rng(4)
    lam = _intensity(scale=2.0)
    tau = 200
    ys = np.concatenate([rng.poisson(lam, (tau, P, L)), rng.poisson(1.3 * lam, (100, P, L))])
    ours = cp.first_alarm(cp.run_detector(totals_cusum(lam.sum(), rel_change=0.3), ys), 12.0)
    focus = cp.first_alarm(peers.focus_scores(ys.sum((1, 2)), rate=lam.sum(), side="right"), 12.0)
    assert tau < ours <= tau + 10 and tau < focus <= tau + 10, (ours, focus)
    assert abs(int(ours) - int(focus)) <= 3


@pytest.mark.skipif(not _HAVE_RUPTURES, reason="ruptures not installed (peers extra)")
def test_ruptures_poisson_cost_finds_a_clear_change():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.poisson(2.0, (60, 4)), rng.poisson(6.0, (40, 4))])
    cost = peers.ruptures_poisson_cost()().fit(x)
    seg = x[10:30].sum(0)
    assert cost.error(10, 30) == pytest.approx(-np.sum(seg * np.log(seg / 20)) + seg.sum())
    import ruptures

    bkps = ruptures.Pelt(custom_cost=peers.ruptures_poisson_cost()(), min_size=2).fit(x)
    assert bkps.predict(pen=20.0) == [60, 100]
