"""P12 real-signal instances: calendar-aligned weekly windows and their instance sampler."""

import jax
import numpy as np
import pytest

from lowrank_jax.tuning.signal_banks import weekly_windows
from lowrank_jax.tuning.synthetic import sample_signal_instances


def test_weekly_windows_equal_a_loop_over_years_and_series():
    dates = np.arange(np.datetime64("2003-02-10"), np.datetime64("2005-12-31"))
    rng = np.random.default_rng(0)
    daily = rng.gamma(2.0, 1.0, (len(dates), 3))
    daily[:, 2] = 5.0  # constant series: dropped (zero spread)
    w = weekly_windows(dates, daily, num_weeks=6, start="03-01")
    assert list(w.year) == [2003, 2003, 2004, 2004, 2005, 2005] and list(w.series) == [0, 1] * 3
    for k, year in enumerate(w.year):
        day = np.datetime64(f"{year}-03-01")
        while (day.astype(np.int64) - 4) % 7:  # the next Monday
            day += 1
        assert w.start[k] == day
        i = int((day - dates[0]).astype(int))
        weeks = np.array([daily[i + 7 * j : i + 7 * j + 7, w.series[k]].mean() for j in range(6)])
        np.testing.assert_allclose(w.signals[k], (weeks - weeks.mean()) / weeks.std(), atol=1e-5)
    with pytest.raises(ValueError, match="consecutive"):
        weekly_windows(dates[::2], daily[::2])
    with pytest.raises(ValueError, match="no 200-week window"):
        weekly_windows(dates, daily, num_weeks=200)


def test_signal_instances_draw_bank_rows_with_the_gaussian_design():
    bank = np.arange(12, dtype=np.float32).reshape(4, 3)
    inst = sample_signal_instances(jax.random.key(0), 20, bank, n_train=6, n_val=5, noise=0.0)
    beta = np.asarray(inst.beta)
    assert all(any(np.array_equal(b, r) for r in bank) for b in beta)
    assert len({tuple(b) for b in beta}) > 1
    np.testing.assert_allclose(
        inst.yt, np.einsum("knd,kd->kn", inst.xt, beta), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        inst.yv, np.einsum("knd,kd->kn", inst.xv, beta), rtol=1e-5, atol=1e-5
    )
    assert inst.xt.shape == (20, 6, 3) and inst.xv.shape == (20, 5, 3)
    with pytest.raises(ValueError, match="finite"):
        sample_signal_instances(jax.random.key(0), 2, np.full((2, 3), np.nan))
