"""P17's NYC flights 2013 study (:mod:`experiments.changepoint`): thresholds from a weekly-block
bootstrap of January–March, monitoring of April–December with a restart after each alarm (the
restarted detector's reference is the last ``restart_ref_days`` days); FOCuS on totals
(changepoint-online) and ruptures' PELT with a Poisson cost (offline, whole period, penalty from
the same bootstrap) side by side; the carriers whose volume moved most around each alarm."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from lowrank_jax import changepoint as cp
from lowrank_jax import data
from lowrank_jax.changepoint import peers
from lowrank_jax.changepoint.calibration import block_bootstrap_indices, quantile_threshold

__all__ = ["flights"]


METHODS = ("lowrank", "lowrank_fixed", "frobenius", "cusum_totals", "cusum_entrywise")


def _restart_monitor(counts, train_days, det_fn, thresholds, ref_days, chunk):
    """Alarms (day indices) of each detector, restarting after every alarm."""
    alarms = {k: [] for k in thresholds}
    for k in thresholds:
        start, ref = train_days, counts[:train_days]
        while start < len(counts):
            det = det_fn(ref)[k]
            s = np.asarray(cp.run_detector(det, counts[start:], chunk=chunk))
            a = int(cp.first_alarm(s, thresholds[k]))
            if a == 0:
                break
            day = start + a - 1
            alarms[k].append(day)
            start, ref = day + 1, counts[max(0, day + 1 - ref_days) : day + 1]
    return alarms


def flights(config: Any, key: jax.Array, make_detectors, svt_scale_fn) -> dict:
    """Thresholds on January–March, alarms April–December, peers, carrier-level changes.

    ``make_detectors(reference, model_config, **kw)`` and ``svt_scale_fn(config, train, key, *,
    horizon, block_len, num_scales)`` are the experiment's (:mod:`experiments.changepoint`)."""
    f, m, e = config.flights, config.model, config.eval
    fc = data.load_flight_counts()
    counts, n = fc.counts, config.flights.train_days
    train, horizon = counts[:n], len(counts) - n
    lam_bar = float(train.mean(0).max())

    svt_scale = svt_scale_fn(
        config, train, key, horizon=horizon, block_len=f.block_len, num_scales=f.num_scales
    )

    def det_fn(ref):
        return make_detectors(
            ref,
            m,
            rank=f.rank,
            max_rank=f.max_rank,
            svt_scale=svt_scale,
            rate_bound=lam_bar,
            num_scales=f.num_scales,
            methods=METHODS,
        )

    dets = det_fn(train)
    thr = {
        k: cp.calibrate_threshold(
            det,
            train,
            key=key,
            alpha=e.alpha,
            horizon=horizon,
            block_len=f.block_len,
            num_streams=f.boot_streams,
            chunk=e.chunk,
        ).threshold
        for k, det in dets.items()
    }
    alarms = _restart_monitor(counts, n, det_fn, thr, f.restart_ref_days, e.chunk)
    # Peers: FOCuS on totals (known rate from the reference), same bootstrap threshold.
    idx = np.asarray(
        block_bootstrap_indices(
            key, n, horizon=horizon, block_len=f.block_len, num_streams=f.boot_streams
        )
    )
    tot = counts.sum((1, 2))
    rate0 = float(tot[:n].mean())
    thr["focus_totals"] = quantile_threshold(
        [peers.focus_scores(tot[i], rate=rate0).max() for i in idx], e.alpha
    )
    alarms["focus_totals"], start, rate = [], n, rate0
    while start < len(tot):
        a = int(cp.first_alarm(peers.focus_scores(tot[start:], rate=rate), thr["focus_totals"]))
        if a == 0:
            break
        alarms["focus_totals"].append(start + a - 1)
        start = start + a
        rate = float(tot[max(0, start - f.restart_ref_days) : start].mean())
    # ruptures PELT (offline) on carrier totals; penalty: 1-α quantile of the best single-split
    # gain on the bootstrap streams (a lower bound of the zero-change penalty).
    per_c = counts.sum(2).astype(np.float64)
    cost_cls = peers.ruptures_poisson_cost()
    gains = []
    for i in idx[:50]:
        c = cost_cls().fit(per_c[i])
        gains.append(
            c.error(0, horizon)
            - min(c.error(0, s) + c.error(s, horizon) for s in range(2, horizon - 1))
        )
    pen = quantile_threshold(gains, e.alpha)
    import ruptures

    bk = ruptures.Pelt(custom_cost=cost_cls(), min_size=7).fit(per_c[n:]).predict(pen=pen)
    alarms["ruptures_pelt_offline"] = [n + b - 1 for b in bk[:-1]]
    # Carrier-level volume change around each alarm: mean daily flights 28 days after vs before.
    explain = {}
    for k, days in alarms.items():
        for day in days:
            before = per_c[max(0, day - 27) : day + 1].mean(0)
            after = per_c[day + 1 : day + 29].mean(0) if day + 1 < len(per_c) else before
            top = np.argsort(-np.abs(after - before))[:3]
            explain[f"{k}@{day}"] = ", ".join(
                f"{fc.carriers[c]} {before[c]:.0f}->{after[c]:.0f}" for c in top
            )
    dates = {k: [str(fc.dates[d]) for d in v] for k, v in alarms.items()}
    return {
        "alarms": dates,
        "explain": explain,
        "thresholds": thr,
        "ruptures_penalty": pen,
        "svt_scale": svt_scale,
    }
