"""Reporting of the P13 SPR study: the table (mean and 95% t-interval over seeds), the trend
checks of specs.md §13, the F1-vs-missing-rate plot and ``results.md``.

Used by ``experiments/spr.py``. ``cells`` maps ``"seed=<s>/<arm>"`` to a cell record (an arm is
a method, with missing modalities as blank inputs, or ``<method>:drop``, with their tokens dropped
from the attention; ``missing.drop_methods``):
``learning_rate`` (chosen on validation), ``valid_f1``, ``trainable_params``, ``prompt_params``,
``pretrain_valid_accuracy`` and the test macro-F1 columns ``f1@<rate>`` (per
``missing.test_rates``), ``complete`` and ``no_<view>`` (per ``data.views``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import scipy.stats

from experiments.common import sweep
from experiments.common.plots import plot_curves

__all__ = ["checks", "paired", "plot", "table", "write_results"]


def _ci(values) -> tuple[float, float]:
    """``(mean, half-width of the 95% t-interval)`` over seeds (0 for a single seed)."""
    v = np.asarray(values, np.float64)
    if v.size < 2:
        return float(v.mean()), 0.0
    return float(v.mean()), float(
        scipy.stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    )


def _arms(config) -> list[str]:
    """Every arm's name: the methods, then ``<method>:drop`` per ``missing.drop_methods``."""
    return [*config.methods, *(f"{m}:drop" for m in config.missing.get("drop_methods", ()))]


def table(config, cells) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """``(rows, means)``: one row per arm (``"mean ± half-width"`` of every F1 column, the
    prompt parameter count and the chosen learning rate per seed) and the plain means by method
    and column for :func:`checks` and :func:`plot`."""
    cols = [f"f1@{r:g}" for r in config.missing.test_rates]
    cols += ["complete", *(f"no_{v}" for v in config.data.views)]
    rows, means = [], {}
    for m in _arms(config):
        group = [cells[f"seed={s}/{m}"] for s in config.seeds]
        row = {"method": m, "prompt_params": group[0]["prompt_params"]}
        row["learning_rates"] = "/".join(f"{c['learning_rate']:g}" for c in group)
        means[m] = {}
        for col in cols:
            mean, half = _ci([c[col] for c in group])
            row[col] = f"{mean:.3f} ± {half:.3f}"
            means[m][col] = mean
        rows.append(row)
    return rows, means


def checks(config, means) -> list[dict[str, Any]]:
    """SPR ≥ DCP-like ≥ MAP > probe at the training rate, SPR's margin over MAP largest at the
    highest missing rate, each ablation below SPR, and each dropped-token arm against its blank
    one (descriptive: which way the missing-input choice moves F1) (each only where its arms
    ran)."""
    rates = config.missing.test_rates
    train = f"f1@{config.missing.train_rate:g}"
    have = lambda *ms: all(m in means for m in ms)  # noqa: E731
    out = []
    if have("spr", "dcp", "map", "probe") and train in means["spr"]:
        f = {m: means[m][train] for m in ("spr", "dcp", "map", "probe")}
        ok = f["spr"] >= f["dcp"] >= f["map"] > f["probe"]
        ev = ", ".join(f"{m} {v:.3f}" for m, v in f.items())
        out.append(sweep.check(f"SPR ≥ DCP-like ≥ MAP > probe ({train})", ok, ev))
    if have("spr", "map") and len(rates) > 1:
        margins = {r: means["spr"][f"f1@{r:g}"] - means["map"][f"f1@{r:g}"] for r in rates}
        ok = max(margins, key=margins.get) == max(rates)
        ev = ", ".join(f"η={r:g}: {v:+.3f}" for r, v in margins.items())
        out.append(sweep.check("SPR − MAP margin largest at the highest missing rate", ok, ev))
    for ablation in ("spr-gif", "spr-lfr", "spr-cfs"):
        if have("spr", ablation) and train in means["spr"]:
            a, s = means[ablation][train], means["spr"][train]
            module = ablation.split("-")[1].upper()
            out.append(
                sweep.check(
                    f"removing {module} lowers F1 ({train})", a < s, f"{a:.3f} vs SPR {s:.3f}"
                )
            )
    for m in config.missing.get("drop_methods", ()):
        if have(m, f"{m}:drop") and train in means[m]:
            b, d = means[m][train], means[f"{m}:drop"][train]
            out.append(
                sweep.check(
                    f"{m}: blank missing input ≥ dropped tokens ({train})",
                    b >= d,
                    f"blank {b:.3f} vs drop {d:.3f}",
                )
            )
    return out


def paired(config, cells) -> dict[str, str]:
    """Per-seed paired differences at the training rate and the highest test rate,
    ``"mean ± half-width (sd s)"`` (95% t-interval and standard deviation over seeds): every arm minus the probe, the trend's
    steps (SPR − DCP-like, DCP-like − MAP, SPR − MAP), each SPR ablation minus SPR, and each
    ``<method>:drop`` minus its blank arm (each only where its arms ran)."""
    rates = sorted({config.missing.train_rate, max(config.missing.test_rates)})
    drops = [m for m in config.missing.get("drop_methods", ()) if m in config.methods]
    out = {}
    for col in (f"f1@{r:g}" for r in rates):

        def diff(a: str, b: str, col: str = col) -> str:
            v = [cells[f"seed={s}/{a}"][col] - cells[f"seed={s}/{b}"][col] for s in config.seeds]
            mean, half = _ci(v)
            sd = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
            return f"{a} {mean:+.3f} ± {half:.3f} (sd {sd:.3f})"

        if "probe" in config.methods:
            arms = [m for m in _arms(config) if m != "probe"]
            out[f"paired difference to the probe ({col})"] = ", ".join(
                diff(m, "probe") for m in arms
            )
        steps = [("spr", "dcp"), ("dcp", "map"), ("spr", "map")]
        steps += [(a, "spr") for a in ("spr-gif", "spr-lfr", "spr-cfs")]
        steps = [(a, b) for a, b in steps if a in config.methods and b in config.methods]
        if steps:
            out[f"paired difference, trend steps and ablations ({col})"] = ", ".join(
                f"{diff(a, b)} vs {b}" for a, b in steps
            )
        if drops:
            out[f"paired difference drop − blank ({col})"] = ", ".join(
                diff(f"{m}:drop", m) for m in drops
            )
    return out


def plot(config, workdir, means) -> str:
    """``f1_vs_missing_rate.png``: mean test macro-F1 per method against the missing rate; returns
    its path."""
    return plot_curves(
        os.path.join(workdir, "f1_vs_missing_rate.png"),
        {
            m: (
                list(config.missing.test_rates),
                [means[m][f"f1@{r:g}"] for r in config.missing.test_rates],
            )
            for m in _arms(config)
        },
        title="P13: test macro-F1 vs missing rate (trained at 70%)",
        xlabel="missing rate η (missing-both)",
        ylabel="macro-F1",
    )


def write_results(config, workdir, cells) -> dict[str, Any]:
    """The table, checks and plot of ``cells``, with the views and the frozen backbone's complete
    validation accuracy per seed, written as ``results.md`` and ``summary.json``
    (:func:`sweep.write_sweep_results`); returns the run's metrics."""
    rows, means = table(config, cells)
    found = checks(config, means)
    path = plot(config, workdir, means)
    extra = {"plots": os.path.basename(path), "views": "+".join(config.data.views)}
    extra.update(paired(config, cells))
    first = [cells[f"seed={s}/{config.methods[0]}"] for s in config.seeds]
    if all("pretrain_valid_accuracy" in c for c in first):  # the frozen backbone, complete data
        extra["pretrained backbone, complete valid accuracy"] = ", ".join(
            f"{c['pretrain_valid_accuracy']:.3f}" for c in first
        )
    cmd = sweep.command_line("python -m experiments.train --config=configs/spr.py")
    cols = list(rows[0])  # method, prompt_params, learning_rates, then the F1 columns
    return sweep.write_sweep_results(
        workdir,
        rows,
        found,
        title="P13 SPR: test macro-F1 (mean ± 95% t-interval over seeds) under missing modalities",
        columns=cols,
        command=cmd,
        extra=extra,
    )
