"""P17: online low-rank Poisson change points — synthetic grid of specs §17 and NYC flights 2013.

Synthetic (per AR(1) coefficient ρ): a training stretch gives every detector its reference
(mean counts / rates) and, by the same moving-block bootstrap, its threshold; false-alarm rates on
``null_reps`` fresh null streams at each α; delays on ``change_reps`` streams per change kind and
size κ. The low-rank scan is also calibrated with an i.i.d. bootstrap (block 1) to show what the
blocks buy under dependence. Flights: ``lowrank_jax.data.load_flight_counts`` (16 carriers × 19
hours per day), thresholds from a weekly-block bootstrap of January–March, monitoring of
April–December with a restart after each alarm (the restarted detector's reference is the last
``restart_ref_days`` days); FOCuS on totals (changepoint-online) and ruptures' PELT with a
Poisson cost (offline, whole period, penalty from the same bootstrap) side by side.

The methods live in ``lowrank_jax.changepoint``; this module only wires data, detectors and
reports. Finished cells are stored in ``<workdir>/cells`` and skipped on rerun.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import tqdm

from experiments import common
from lowrank_jax import changepoint as cp
from lowrank_jax import data
from lowrank_jax.changepoint import peers, synthetic
from lowrank_jax.changepoint.calibration import block_bootstrap_indices, quantile_threshold
from lowrank_jax.changepoint.detectors import entrywise_cusum, totals_cusum

METHODS = ("lowrank", "lowrank_fixed", "frobenius", "cusum_totals", "cusum_entrywise")
NULL_BATCH = 200  # null streams sampled at once (memory: 200 x T x p x L counts)


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for key in ("p", "num_cells", "rank", "block", "train_len", "horizon", "tau"):
        c.check_positive(config, f"data.{key}", integer=True)
    for key in ("null_reps", "change_reps"):
        c.check_positive(config, f"data.{key}", integer=True)
    if config.data.tau >= config.data.horizon:
        raise c.ConfigError(f"config.data.tau={config.data.tau} must be < data.horizon")
    if config.model.rank > min(config.data.p, config.data.num_cells):
        raise c.ConfigError(f"config.model.rank={config.model.rank} exceeds min(p, L)")
    if not config.model.rank <= config.model.max_rank <= min(config.data.p, config.data.num_cells):
        raise c.ConfigError("config.model.max_rank must lie in [model.rank, min(p, L)]")
    if not config.model.svt_calibrate and config.model.svt_scale <= 0:
        raise c.ConfigError("config.model.svt_scale must be positive (c_tau of the SVT level)")
    for kind in config.data.kinds:
        if kind not in ("local", "global"):
            raise c.ConfigError(f"config.data.kinds has {kind!r}: use 'local' or 'global'")
    for a in (*config.eval.alphas, config.eval.alpha):
        if not 0 < a < 1:
            raise c.ConfigError(f"config.eval.alphas holds {a}: levels lie in (0, 1)")
    if not 1 <= config.eval.block_len <= config.data.train_len:
        raise c.ConfigError("config.eval.block_len must lie in [1, data.train_len]")
    if config.flights.enabled and config.flights.max_rank < config.flights.rank:
        raise c.ConfigError("config.flights.max_rank must be >= flights.rank")
    c.check_positive(config, "eval.boot_streams", integer=True)
    c.check_positive(config, "eval.chunk", integer=True)


def make_detectors(
    reference: np.ndarray, m: Any, *, rank: int, max_rank: int, svt_scale: float, rate_bound=None
) -> dict:
    """The detectors built from a reference stretch ``(n, p, L)``: the low-rank scan with adaptive
    SVT window estimates (``lowrank``, the default) and with the fixed rank-``rank`` truncation
    (``lowrank_fixed``), the Frobenius scan and the two CUSUMs."""
    mean = reference.mean(0)
    kw = dict(num_scales=m.num_scales, alpha=m.alpha_stat, rate_bound=rate_bound)
    scan = dict(rank=rank, power_iters=m.power_iters, **kw)
    return {
        "lowrank": cp.lowrank_scan(
            mean, estimator="svt", max_rank=max_rank, svt_scale=svt_scale, **scan
        ),
        "lowrank_fixed": cp.lowrank_scan(mean, estimator="rank", **scan),
        "frobenius": cp.frobenius_scan(mean, **kw),
        "cusum_totals": totals_cusum(mean.sum(), rel_change=m.cusum_total_change),
        "cusum_entrywise": entrywise_cusum(mean, rel_change=m.cusum_cell_change),
    }


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """Each detector's online update scanned over a stream of chunks, as ``cp.run_detector``
    scans it, on abstract counts (the detectors are built from a stand-in mean of ones)."""
    del mesh  # one device
    check_config(config)
    d, m, e = config.data, config.model, config.eval
    dets = make_detectors(
        np.ones((1, d.p, d.num_cells), np.float32),
        m,
        rank=m.rank,
        max_rank=m.max_rank,
        svt_scale=m.svt_scale,
    )
    chunks = -(-d.horizon // e.chunk)
    ys = jax.ShapeDtypeStruct((chunks, e.chunk, d.p, d.num_cells), np.float32)
    return [common.Step(name, _scan_detector(det), (ys,)) for name, det in dets.items()]


def _scan_detector(det):
    """``scores(ys (n, chunk, p, L)) -> (n, chunk)``: the detector's updates over the chunks."""
    return jax.jit(lambda ys: jax.lax.scan(det.update, det.init(), ys)[1])


def cusum_totals_refit(rel_change: float):
    """Traceable factory ``stretch -> totals_cusum(mean total)`` for ``refit``."""

    def refit(stretch):
        return totals_cusum(stretch.sum((1, 2)).mean(), rel_change=rel_change)

    return refit


def _scores(det, streams: np.ndarray, chunk: int) -> np.ndarray:
    b, t = streams.shape[:2]
    flat = streams.reshape(b * t, *streams.shape[2:])
    return np.asarray(cp.run_detector(det, flat, index=np.arange(b * t).reshape(b, t), chunk=chunk))


def _cell(workdir: str, name: str, fn) -> dict:
    path = os.path.join(workdir, "cells", f"{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    out = fn()
    common.write_json(path, out)
    return out


def _svt_scale(config, train, key, *, horizon, block_len) -> float:
    """``c_τ`` of the SVT level: calibrated on the training stretch, or ``model.svt_scale``."""
    m = config.model
    if not m.svt_calibrate:
        return float(m.svt_scale)
    return cp.calibrate_svt_scale(
        train,
        key=jax.random.fold_in(key, 1),
        alpha=config.eval.alpha,
        horizon=horizon,
        num_scales=m.num_scales,
        block_len=block_len,
        num_streams=config.eval.boot_streams,
    )


def synthetic_rho(config: Any, rho: float, key: jax.Array) -> dict:
    """Calibration, false alarms and delays of every detector at one ρ."""
    d, m, e = config.data, config.model, config.eval
    keys = jax.random.split(key, 6)
    lam = synthetic.lowrank_intensity(
        keys[0], p=d.p, num_cells=d.num_cells, rank=d.rank, mean=d.mean
    )
    sample = dict(rho=rho, sigma=d.sigma)
    train = synthetic.sample_streams(keys[1], lam, num_streams=1, length=d.train_len, **sample)[0]
    svt_scale = _svt_scale(config, train, keys[2], horizon=d.horizon, block_len=e.block_len)
    dets = make_detectors(train, m, rank=m.rank, max_rank=m.max_rank, svt_scale=svt_scale)
    # The totals CUSUM's rate is a plug-in: re-estimated on each bootstrap resample (refit).
    refit = {"cusum_totals": cusum_totals_refit(m.cusum_total_change)} if e.refit_cusum else {}
    cal = {
        k: cp.calibrate_threshold(
            det,
            train,
            key=keys[2],
            alpha=e.alpha,
            horizon=d.horizon,
            block_len=e.block_len,
            num_streams=e.boot_streams,
            chunk=e.chunk,
            refit=refit.get(k),
        ).maxima
        for k, det in dets.items()
    }
    cal["lowrank_iid"] = cp.calibrate_threshold(
        dets["lowrank"],
        train,
        key=keys[2],
        alpha=e.alpha,
        horizon=d.horizon,
        block_len=1,
        num_streams=e.boot_streams,
        chunk=e.chunk,
    ).maxima
    thr = {k: {a: quantile_threshold(v, a) for a in e.alphas} for k, v in cal.items()}
    null_max = {k: [] for k in dets}
    for start in range(0, d.null_reps, NULL_BATCH):  # fresh null streams, a batch at a time
        null = synthetic.sample_streams(
            jax.random.fold_in(keys[3], start),
            lam,
            num_streams=min(NULL_BATCH, d.null_reps - start),
            length=d.horizon,
            **sample,
        )
        for k, det in dets.items():
            null_max[k].append(_scores(det, null, e.chunk).max(1))
    null_max = {k: np.concatenate(v) for k, v in null_max.items()}
    null_max["lowrank_iid"] = null_max["lowrank"]
    fa = {k: {str(a): float(np.mean(null_max[k] > thr[k][a])) for a in e.alphas} for k in thr}
    delays = {}
    for i, kind in enumerate(d.kinds):
        for j, kappa in enumerate(d.kappas):
            kk = jax.random.fold_in(keys[4], 100 * i + j)
            after = synthetic.change_intensity(
                lam, key=keys[5], kind=kind, kappa=kappa, block=d.block
            )
            ys = synthetic.sample_streams(
                kk,
                lam,
                num_streams=d.change_reps,
                length=d.horizon,
                tau=d.tau,
                lam_after=after,
                **sample,
            )
            for k, det in dets.items():
                alarm = cp.first_alarm(_scores(det, ys, e.chunk), thr[k][e.alpha])
                late = alarm > d.tau
                delay = np.where(late, alarm - d.tau, d.horizon - d.tau)  # misses censored
                delays[f"{kind}/{kappa}/{k}"] = {
                    "mean_delay": float(delay[alarm != 0].mean()) if (alarm != 0).any() else None,
                    "delay_censored": float(np.where(alarm == 0, d.horizon - d.tau, delay).mean()),
                    "detected": float(late.mean()),
                    "early_alarm": float(((alarm > 0) & (alarm <= d.tau)).mean()),
                }
    return {
        "false_alarm": fa,
        "delays": delays,
        "thresholds": {k: v[e.alpha] for k, v in thr.items()},
        "svt_scale": svt_scale,
    }


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


def flights(config: Any, key: jax.Array) -> dict:
    """Thresholds on January–March, alarms April–December, peers, carrier-level changes."""
    f, m, e = config.flights, config.model, config.eval
    fc = data.load_flight_counts()
    counts, n = fc.counts, config.flights.train_days
    train, horizon = counts[:n], len(counts) - n
    lam_bar = float(train.mean(0).max())

    svt_scale = _svt_scale(config, train, key, horizon=horizon, block_len=f.block_len)

    def det_fn(ref):
        return make_detectors(
            ref, m, rank=f.rank, max_rank=f.max_rank, svt_scale=svt_scale, rate_bound=lam_bar
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


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs the synthetic grid and the flights study; writes results.md, JSON cells, plots."""
    del options  # no trainer of experiments.common runs here
    check_config(config)
    common.write_config_json(workdir, config)
    key = jax.random.key(config.seed)
    rows, fa_rows, out = [], [], {}
    bar = tqdm.tqdm(config.data.rhos, disable=not config.log.progress, desc="rho")
    for rho in bar:
        res = _cell(
            workdir,
            f"rho={rho}",
            lambda rho=rho: synthetic_rho(config, rho, jax.random.fold_in(key, int(rho * 100))),
        )
        out[f"rho={rho}"] = res
        for k, v in res["false_alarm"].items():
            fa_rows.append({"rho": rho, "method": k, **{f"FA@{a}": x for a, x in v.items()}})
        for name, v in res["delays"].items():
            kind, kappa, meth = name.split("/")
            rows.append({"rho": rho, "change": kind, "kappa": float(kappa), "method": meth, **v})
    metrics = {}
    for r in rows:
        metrics[f"delay/rho={r['rho']}/{r['change']}/{r['kappa']}/{r['method']}"] = r[
            "delay_censored"
        ]
    for r in fa_rows:
        metrics[f"fa/rho={r['rho']}/{r['method']}"] = r[f"FA@{config.eval.alpha}"]
    for rho in config.data.rhos:
        for kind in config.data.kinds:
            curves = {
                m: (
                    [
                        r["kappa"]
                        for r in rows
                        if r["method"] == m and r["change"] == kind and r["rho"] == rho
                    ],
                    [
                        r["delay_censored"]
                        for r in rows
                        if r["method"] == m and r["change"] == kind and r["rho"] == rho
                    ],
                )
                for m in METHODS
            }
            common.plot_curves(
                os.path.join(workdir, f"delay_{kind}_rho{rho}.png"),
                curves,
                title=f"delay vs κ ({kind}, ρ={rho})",
                xlabel="κ",
                ylabel="delay",
                logy=True,
            )
    notes = "False-alarm rates on null streams (thresholds from the block bootstrap):\n\n"
    notes += common.write_results_md(
        workdir, fa_rows, title="false alarms", filename="false_alarms.md"
    )
    if config.flights.enabled:
        fl = _cell(workdir, "flights", lambda: flights(config, jax.random.fold_in(key, 7)))
        out["flights"] = fl
        notes += "\n## NYC flights 2013: alarms (April–December)\n\n"
        for k, v in fl["alarms"].items():
            notes += f"* **{k}**: {', '.join(v) or 'none'}\n"
        notes += "\nCarrier-level change around each alarm (mean daily flights, 28 days before -> after):\n\n"
        for k, v in fl["explain"].items():
            notes += f"* {k}: {v}\n"
    common.write_results_md(
        workdir, rows, title="P17 change points: delays (synthetic)", notes=notes
    )
    common.write_json(os.path.join(workdir, "results.json"), out)
    return metrics
