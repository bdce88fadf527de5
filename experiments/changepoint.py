"""P17: online low-rank Poisson change points — synthetic grid of specs §17 and NYC flights 2013.

Synthetic, per AR(1) coefficient ρ and number of window scales ``J`` (windows ``1..2^J``): a
training stretch gives every detector its reference (mean counts / rates) and a fitted null model
(:func:`lowrank_jax.changepoint.simulate.fit_null_model`); each threshold is the ``(1−α)``
quantile of the detector's maximum over ``cal_streams`` null streams of the spec's horizon ``T``
simulated from that fitted model (the totals CUSUM's rate re-estimated on a simulated training
stretch per stream). False-alarm rates on ``null_reps`` fresh null streams of length ``T`` from
the true model at each α (with their Monte Carlo s.e.); detection and delays on ``change_reps``
streams per change kind and size κ (change at ``τ``, monitored to ``τ + post_change``). The
flights study is :mod:`experiments.common.changepoint_flights`.

The methods live in ``lowrank_jax.changepoint``; this module only wires data, detectors and
reports. Finished cells are stored by :class:`experiments.common.sweep.CellStore` in
``<workdir>/cells`` and read back on rerun.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from experiments import common
from experiments.common import changepoint_flights, sweep
from lowrank_jax import changepoint as cp
from lowrank_jax.changepoint import simulate, synthetic
from lowrank_jax.changepoint.calibration import quantile_threshold
from lowrank_jax.changepoint.detectors import entrywise_cusum, totals_cusum

METHODS = ("lowrank", "lowrank_fixed", "frobenius", "cusum_totals", "cusum_entrywise")


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for key in ("p", "num_cells", "rank", "block", "train_len", "horizon", "tau"):
        c.check_positive(config, f"data.{key}", integer=True)
    for key in ("null_reps", "change_reps", "post_change"):
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
    for k in config.model.methods:
        if k not in METHODS:
            raise c.ConfigError(f"config.model.methods has {k!r}: use some of {METHODS}")
    for j in config.model.num_scales_grid:
        if not isinstance(j, int) or not 0 <= j <= 12:
            raise c.ConfigError(f"config.model.num_scales_grid has {j!r}: use integers in [0, 12]")
    c.check_positive(config, "eval.cal_streams", integer=True)
    c.check_positive(config, "eval.boot_streams", integer=True)
    c.check_positive(config, "eval.chunk", integer=True)


def make_detectors(
    reference: np.ndarray,
    m: Any,
    *,
    rank: int,
    max_rank: int,
    svt_scale: float,
    num_scales: int,
    methods=METHODS,
    rate_bound=None,
) -> dict:
    """The detectors ``methods`` built from a reference stretch ``(n, p, L)``: the low-rank scan
    with adaptive SVT window estimates (``lowrank``) and with the fixed rank-``rank`` truncation
    (``lowrank_fixed``), the Frobenius scan (windows ``1..2^num_scales``) and the two CUSUMs."""
    mean = reference.mean(0)
    kw = dict(num_scales=num_scales, alpha=m.alpha_stat, rate_bound=rate_bound)
    scan = dict(rank=rank, power_iters=m.power_iters, **kw)
    build = {
        "lowrank": lambda: cp.lowrank_scan(
            mean, estimator="svt", max_rank=max_rank, svt_scale=svt_scale, **scan
        ),
        "lowrank_fixed": lambda: cp.lowrank_scan(mean, estimator="rank", **scan),
        "frobenius": lambda: cp.frobenius_scan(mean, **kw),
        "cusum_totals": lambda: totals_cusum(mean.sum(), rel_change=m.cusum_total_change),
        "cusum_entrywise": lambda: entrywise_cusum(mean, rel_change=m.cusum_cell_change),
    }
    return {k: build[k]() for k in methods}


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
        num_scales=m.num_scales,
    )
    chunks = -(-d.horizon // e.chunk)
    ys = jax.ShapeDtypeStruct((chunks, e.chunk, d.p, d.num_cells), np.float32)
    return [common.Step(name, _scan_detector(det), (ys,)) for name, det in dets.items()]


def _scan_detector(det):
    """``scores(ys (n, chunk, p, L)) -> (n, chunk)``: the detector's updates over the chunks."""
    return jax.jit(lambda ys: jax.lax.scan(det.update, det.init(), ys)[1])


def cusum_totals_refit(rel_change: float):
    """Traceable factory ``training mean (p, L) -> totals_cusum(its total)`` for ``refit``."""

    def refit(mean):
        return totals_cusum(mean.sum(), rel_change=rel_change)

    return refit


def svt_scale(config, train, key, *, horizon, block_len, num_scales) -> float:
    """``c_τ`` of the SVT level: calibrated on the training stretch, or ``model.svt_scale``."""
    m = config.model
    if not m.svt_calibrate:
        return float(m.svt_scale)
    return cp.calibrate_svt_scale(
        train,
        key=jax.random.fold_in(key, 1),
        alpha=config.eval.alpha,
        horizon=horizon,
        num_scales=num_scales,
        block_len=block_len,
        num_streams=config.eval.boot_streams,
    )


class _Setting:
    """One (ρ, J) setting: the true intensity, a training stretch, the fitted null model, the
    detectors built from the stretch (lazily, on first use)."""

    def __init__(self, config, rho, num_scales, key):
        d = config.data
        self.config, self.rho, self.num_scales = config, rho, num_scales
        self.keys = jax.random.split(key, 6)
        self.lam = synthetic.lowrank_intensity(
            self.keys[0], p=d.p, num_cells=d.num_cells, rank=d.rank, mean=d.mean
        )
        self.truth = simulate.NullModel(self.lam, rho, d.sigma)
        self._dets = None

    def detectors(self):
        if self._dets is None:
            d, m, e = self.config.data, self.config.model, self.config.eval
            train = synthetic.sample_streams(
                self.keys[1],
                self.lam,
                num_streams=1,
                length=d.train_len,
                rho=self.rho,
                sigma=d.sigma,
            )[0]
            self.fit = simulate.fit_null_model(train)
            self.svt_scale = svt_scale(
                self.config,
                train,
                self.keys[2],
                horizon=d.horizon,
                block_len=e.block_len,
                num_scales=self.num_scales,
            )
            self._dets = make_detectors(
                train,
                m,
                rank=m.rank,
                max_rank=m.max_rank,
                svt_scale=self.svt_scale,
                num_scales=self.num_scales,
                methods=m.methods,
            )
        return self._dets

    def thresholds(self) -> dict:
        d, m, e = self.config.data, self.config.model, self.config.eval
        dets = self.detectors()
        refit = {}
        if e.refit_cusum and "cusum_totals" in dets:
            refit["cusum_totals"] = cusum_totals_refit(m.cusum_total_change)
        cal = simulate.calibrate_by_simulation(
            dets,
            self.fit,
            key=self.keys[3],
            alpha=e.alpha,
            horizon=d.horizon,
            num_streams=e.cal_streams,
            chunk=e.chunk,
            refit=refit,
            num_train=d.train_len if refit else None,
        )
        thr = {
            k: {str(a): quantile_threshold(c.maxima, a) for a in e.alphas} for k, c in cal.items()
        }
        fit = {"rho": self.fit.rho, "sigma": self.fit.sigma}
        return {"thresholds": thr, "svt_scale": self.svt_scale, "fitted": fit}

    def false_alarms(self, thr) -> dict:
        d, e = self.config.data, self.config.eval
        scores = simulate.simulate_scores(
            self.detectors(),
            self.truth,
            key=self.keys[4],
            num_streams=d.null_reps,
            horizon=d.horizon,
            chunk=e.chunk,
        )
        fa = {
            k: {a: float(np.mean(s.max(1) > thr[k][a])) for a in thr[k]} for k, s in scores.items()
        }
        se = {str(a): math.sqrt(a * (1 - a) / d.null_reps) for a in e.alphas}
        return {"false_alarm": fa, "mc_se": se, "null_reps": d.null_reps}

    def delays(self, thr, kind, kappa) -> dict:
        d, e = self.config.data, self.config.eval
        after = synthetic.change_intensity(
            self.lam, key=self.keys[5], kind=kind, kappa=kappa, block=d.block
        )
        scores = simulate.simulate_scores(
            self.detectors(),
            self.truth,
            key=jax.random.fold_in(self.keys[5], int(kappa * 10)),
            num_streams=d.change_reps,
            horizon=d.tau + d.post_change,
            tau=d.tau,
            rates_after=after,
            chunk=e.chunk,
        )
        out = {}
        for k, s in scores.items():
            alarm = cp.first_alarm(s, thr[k][str(e.alpha)])
            late = alarm > d.tau
            delay = np.where(late, alarm - d.tau, d.post_change)  # misses, early alarms censored
            out[k] = {
                "detected": float(late.mean()),
                "early_alarm": float(((alarm > 0) & (alarm <= d.tau)).mean()),
                "mean_delay": float((alarm[late] - d.tau).mean()) if late.any() else None,
                "delay_censored": float(delay.mean()),
            }
        return {"delays": out, "change_reps": d.change_reps}


def synthetic_cells(config: Any, store: sweep.CellStore, key: jax.Array) -> dict:
    """Every (J, ρ) setting's thresholds, false alarms and delays, cell by cell (the main J
    first, then the other window scales)."""
    d, m = config.data, config.model
    grid = [m.num_scales] + [j for j in m.num_scales_grid if j != m.num_scales]
    out = {}
    for j in grid:
        for rho in d.rhos:
            s = _Setting(config, rho, j, jax.random.fold_in(key, int(rho * 100)))
            name = f"J={j}/rho={rho}"
            cal = store.get(f"{name}/thresholds", s.thresholds)
            out[f"{name}/thresholds"] = cal
            thr = cal["thresholds"]
            out[f"{name}/null"] = store.get(
                f"{name}/null", lambda s=s, thr=thr: s.false_alarms(thr)
            )
            if j != m.num_scales and not m.scales_delays:
                continue
            for kind in d.kinds:
                kappas = d.kappas if j == m.num_scales else m.scales_kappas
                for kappa in kappas:
                    cell = f"{name}/{kind}/{kappa}"
                    out[cell] = store.get(
                        cell, lambda s=s, t=thr, k=kind, x=kappa: s.delays(t, k, x)
                    )
    return out


def _rows(config, out):
    """False-alarm rows and delay rows of the synthetic cells."""
    fa_rows, rows = [], []
    for name, cell in out.items():
        j, rho, *rest = name.split("/")
        head = {"J": int(j[2:]), "rho": float(rho[4:])}
        if rest == ["null"]:
            thr = out[f"{j}/{rho}/thresholds"]
            for k, v in cell["false_alarm"].items():
                fa = {f"FA@{a}": x for a, x in v.items()}
                se = {f"s.e.@{a}": x for a, x in cell["mc_se"].items()}
                fa_rows.append({**head, "method": k, **fa, **se, "c_tau": thr["svt_scale"]})
        elif rest != ["thresholds"]:
            for k, v in cell["delays"].items():
                rows.append({**head, "change": rest[0], "kappa": float(rest[1]), "method": k, **v})
    return fa_rows, rows


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs the synthetic grid and the flights study; writes results.md, JSON cells, plots."""
    check_config(config)
    common.write_config_json(workdir, config)
    key = jax.random.key(config.seed)
    store = sweep.CellStore(workdir, options=options, log_metrics=False)
    out = synthetic_cells(config, store, key)
    fa_rows, rows = _rows(config, out)
    m = config.model
    metrics = {
        f"delay/J={r['J']}/rho={r['rho']}/{r['change']}/{r['kappa']}/{r['method']}": r[
            "delay_censored"
        ]
        for r in rows
    }
    for r in fa_rows:
        metrics[f"fa/J={r['J']}/rho={r['rho']}/{r['method']}"] = r[f"FA@{config.eval.alpha}"]
    for rho in config.data.rhos:
        for kind in config.data.kinds:
            sel = [r for r in rows if r["J"] == m.num_scales and r["rho"] == rho]
            curves = {
                k: tuple(
                    [r[f] for r in sel if r["method"] == k and r["change"] == kind]
                    for f in ("kappa", "delay_censored")
                )
                for k in m.methods
            }
            common.plot_curves(
                os.path.join(workdir, f"delay_{kind}_rho{rho}.png"),
                curves,
                title=f"delay vs κ ({kind}, ρ={rho}, J={m.num_scales})",
                xlabel="κ",
                ylabel="delay (misses censored)",
                logy=True,
            )
    notes = "False-alarm rates on fresh null streams of length T (thresholds simulated):\n\n"
    notes += common.write_results_md(
        workdir, fa_rows, title="false alarms", filename="false_alarms.md"
    )
    if config.flights.enabled:
        fl = store.get(
            "flights",
            lambda: changepoint_flights.flights(
                config, jax.random.fold_in(key, 7), make_detectors, svt_scale
            ),
        )
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
    store.close()
    return metrics
