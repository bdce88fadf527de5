"""Reporting of the P3 mean-field attention study: tables, trend checks, plots and ``results.md``.

Used by ``experiments/attention_dynamics.py``. ``cells`` maps ``(model, d, gap, seed)`` to a
synthetic cell record (``eps``, and per perturbation ``d_final``, ``d_max``, ``t_dev``,
``w2_final``, ``t_half``, concatenated over ``directions`` in blocks of ``len(eps)``; seed 0 also
``curves`` and ``dt_record``); ``mcells`` maps ``(layer, head)`` to a MiniLM head's record (the
same per-perturbation lists for the aligned then the crossing rank-1 direction, over
``eps = gap · ratios``, plus ``gap``, ``beta``, ``v_norm``, ``curves``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.common import sweep
from experiments.common.metrics import write_json
from experiments.common.plots import plot_curves
from lowrank_jax.analysis.attention_dynamics import drift_jump_ratio, drift_time_fit

__all__ = [
    "minilm_rows_checks",
    "plots",
    "synthetic_checks",
    "synthetic_rows",
    "write_results",
]


def _nanmean(values):
    v = np.asarray(values, np.float64)
    return float(np.nanmean(v)) if np.any(np.isfinite(v)) else float("nan")


def _nanmedian(values):
    v = np.asarray(values, np.float64)
    return float(np.nanmedian(v)) if np.any(np.isfinite(v)) else float("nan")


def synthetic_rows(config, cells, directions: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (model, d, gap, direction); fits per seed, averaged over seeds."""
    rows, dd = [], config.data
    for model, d, g in ((m, d, g) for m in dd.models for d in dd.dims for g in dd.gaps):
        cs = [cells[(model, d, g, s)] for s in range(dd.num_seeds)]
        eps = np.asarray(cs[0]["eps"])
        for i, name in enumerate(directions):
            sl = slice(i * len(eps), (i + 1) * len(eps))
            fits = [drift_time_fit(eps, np.asarray(c["t_dev"][sl])) for c in cs]
            d_final = np.mean([c["d_final"][sl] for c in cs], axis=0)
            below = np.flatnonzero(eps <= g / 2 * (1 + 1e-6))
            rows.append(
                {
                    "model": model,
                    "d": d,
                    "gap": g,
                    "direction": name,
                    **{k: _nanmean([f[k] for f in fits]) for k in ("r2", "slope", "power_r2")},
                    "finite T_dev": int(np.isfinite(cs[0]["t_dev"][sl]).sum()),
                    "D(T) eps<=g/2": d_final[below[-1]] if len(below) else "",
                    "D(T) eps>=2g": d_final[np.flatnonzero(eps >= 2 * g * (1 - 1e-6))[0]],
                    "jump": drift_jump_ratio(d_final, eps, below=g / 2, above=2 * g),
                    "W2(T) eps=max": _nanmean([c["w2_final"][sl][-1] for c in cs]),
                }
            )
    return rows


def synthetic_checks(config, rows, cells, directions: Sequence[str]) -> list[dict[str, Any]]:
    """Checks (a)-(c) of specs.md §3 (4) on the synthetic grid (:func:`sweep.check` records)."""
    dd, checks = config.data, []
    by = {(r["model"], r["d"], r["gap"], r["direction"]): r for r in rows}
    for model in dd.models:
        r2 = [r["r2"] for r in rows if r["model"] == model]
        good = int(sum(bool(np.isfinite(v) and v > 0.9) for v in r2))
        pw = _nanmedian([r["power_r2"] for r in rows if r["model"] == model])
        checks.append(
            sweep.check(
                f"(a) {model}: T_dev affine in log(1/eps), R2 > 0.9 (mean over seeds)",
                good == len(r2),
                f"{good}/{len(r2)} (d, gap, direction); median R2 {_nanmedian(r2):.3f} "
                f"(power law in eps: {pw:.3f})",
            )
        )
    jumps, plateaus = [], []
    for d, g in ((d, g) for d in dd.dims for g in dd.gaps):
        cr, al = by[("sphere", d, g, "crossing")], by[("sphere", d, g, "aligned")]
        jumps.append((d, g, cr["jump"], al["jump"], cr["D(T) eps>=2g"]))
        c, eps = cells[("sphere", d, g, 0)], np.asarray(cells[("sphere", d, g, 0)]["eps"])
        j = np.flatnonzero(eps <= g / 2 * (1 + 1e-6))
        if len(j):
            i = directions.index("crossing") * len(eps) + j[-1]
            plateaus.append((d, g, c["d_final"][i] / max(c["d_max"][i], 1e-12), c["t_half"][i]))
    ok = [bool(c >= 5 * a and top >= 0.5) for _, _, c, a, top in jumps]
    checks.append(
        sweep.check(
            "(b) sphere: D(T) jumps at eps ~ gap for gap-crossing (>= 5x aligned's ratio, D >= 0.5)",
            sum(ok) == len(ok),
            f"{sum(ok)}/{len(ok)}: "
            + "; ".join(
                f"d={d},g={g}: crossing {c:.1f}x vs aligned {a:.1f}x" for d, g, c, a, _ in jumps
            ),
        )
    )
    checks.append(
        sweep.check(
            "(c) sphere, gap-crossing eps <= g/2: D grows then plateaus (D(T) >= 0.5 max_t D)",
            bool(plateaus) and all(bool(r >= 0.5) for _, _, r, _ in plateaus),
            "; ".join(
                f"d={d},g={g}: D(T)/max D {r:.2f}, half-rise t={t:.1f}" for d, g, r, t in plateaus
            ),
        )
    )
    return checks


def minilm_rows_checks(config, mcells) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per MiniLM head a row (gap, β, ‖V‖, jump ratios and T_dev fits) and the heads' checks."""
    rows, n = [], len(config.minilm.ratios)
    for (layer, head), c in mcells.items():
        eps, ratios = np.asarray(c["eps"]), np.asarray(c["ratios"])
        row = {
            "model": f"MiniLM L{layer}H{head}",
            "gap": c["gap"],
            "beta": c["beta"],
            "norm V": c["v_norm"],
        }
        for i, name in enumerate(("aligned", "crossing")):
            sl = slice(i * n, (i + 1) * n)
            row[f"{name} jump"] = drift_jump_ratio(c["d_final"][sl], ratios, below=0.5, above=2.0)
            row[f"{name} R2"] = drift_time_fit(eps, np.asarray(c["t_dev"][sl]))["r2"]
        rows.append(row)
    sharp = sum(r["crossing jump"] >= 5 * r["aligned jump"] for r in rows)
    r2s = [r[f"{k} R2"] for r in rows for k in ("aligned", "crossing")]
    med = {k: np.median([r[f"{k} jump"] for r in rows]) for k in ("aligned", "crossing")}
    checks = [
        sweep.check(
            "(b) MiniLM heads: D(T) jumps at eps ~ gap for crossing (>= 5x aligned's ratio)",
            bool(sharp > len(rows) / 2),
            f"{sharp}/{len(rows)} heads; median D(2g)/D(g/2) crossing {med['crossing']:.2f} vs "
            f"aligned {med['aligned']:.2f}",
        ),
        sweep.check(
            "(a) MiniLM heads: T_dev affine in log(1/eps), R2 > 0.9",
            bool(np.all(np.asarray(r2s) > 0.9)),
            f"{int(np.sum(np.asarray(r2s) > 0.9))}/{len(r2s)} (head, direction) fits; median R2 "
            f"{_nanmedian(r2s):.3f}",
        ),
    ]
    return rows, checks


def _heatmap(path, c, eps, g, title):
    from experiments.common.plots import subplots

    curves = np.asarray(c["curves"])
    t = np.arange(curves.shape[1]) * 5 * c["dt_record"]
    fig, axes = subplots(1, 2, figsize=(10, 4), dpi=100)
    for i, (ax, name) in enumerate(zip(axes, ("aligned", "crossing"), strict=True)):
        im = ax.pcolormesh(t, eps, curves[i * len(eps) : (i + 1) * len(eps)], shading="nearest")
        ax.set_yscale("log")
        ax.axhline(g, color="w", ls=":")
        ax.set(title=f"D(t, eps), {name}", xlabel="depth t", ylabel="eps")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)


def plots(workdir, config, cells, mcells, directions: Sequence[str]) -> None:
    """Per synthetic (model, d, gap): ``heatmap_*``, ``tdev_*``, ``dfinal_*`` PNGs (seed 0); for
    the MiniLM heads ``minilm_dfinal.png`` and the heat maps of the first two heads."""
    dd = config.data
    for model, d, g in ((m, d, g) for m in dd.models for d in dd.dims for g in dd.gaps):
        c, tag = cells[(model, d, g, 0)], f"{model}_d{d}_g{g}"
        eps = np.asarray(c["eps"])
        _heatmap(os.path.join(workdir, f"heatmap_{tag}.png"), c, eps, g, f"{model}, d={d}, gap={g}")
        per = {n: slice(i * len(eps), (i + 1) * len(eps)) for i, n in enumerate(directions)}
        tdev = {n: np.asarray(c["t_dev"][sl]) for n, sl in per.items()}
        plot_curves(
            os.path.join(workdir, f"tdev_{tag}.png"),
            {n: (np.log(1 / eps)[np.isfinite(t)], t[np.isfinite(t)]) for n, t in tdev.items()},
            title=f"T_dev(eps, delta={config.eval.delta}), {model}, d={d}, gap={g}",
            xlabel="log(1/eps)",
            ylabel="T_dev",
        )
        plot_curves(
            os.path.join(workdir, f"dfinal_{tag}.png"),
            {n: (np.log10(eps), c["d_final"][sl]) for n, sl in per.items()},
            title=f"D(T, eps), {model}, d={d}, gap={g}",
            xlabel="log10 eps",
            ylabel="D(T)",
            marks={"gap": float(np.log10(g))} if g > 0 else None,
        )
    if mcells:
        n, x = len(config.minilm.ratios), np.log10(config.minilm.ratios)
        dfin = np.asarray([c["d_final"] for c in mcells.values()])
        plot_curves(
            os.path.join(workdir, "minilm_dfinal.png"),
            {
                k: (x, np.median(dfin[:, i * n : (i + 1) * n], 0))
                for i, k in enumerate(("aligned", "crossing"))
            },
            title="MiniLM heads: median D(T) vs eps / gap",
            xlabel="log10(eps / gap)",
            ylabel="D(T)",
            marks={"gap": 0.0},
        )
        for (layer, head), c in list(mcells.items())[:2]:
            _heatmap(
                os.path.join(workdir, f"heatmap_minilm_L{layer}H{head}.png"),
                c,
                np.asarray(c["ratios"]),
                1.0,
                f"MiniLM layer {layer} head {head} (eps in units of the gap)",
            )


def write_results(workdir, rows, checks, mrows) -> dict[str, Any]:
    """Writes ``results.md`` and ``summary.json`` (:func:`sweep.write_sweep_results`) and, with
    MiniLM rows, ``minilm.json`` and a second table in ``results.md``; returns the run's metrics."""
    columns = ["model", "d", "gap", "direction", "r2", "slope", "power_r2", "finite T_dev"]
    columns += ["D(T) eps<=g/2", "D(T) eps>=2g", "jump", "W2(T) eps=max"]
    out = sweep.write_sweep_results(
        workdir,
        rows,
        checks,
        title="P3 mean-field attention: drift under rank-1 / low-rank perturbations",
        columns=columns,
        command=sweep.command_line(
            "python -m experiments.train --config=configs/attention_dynamics.py"
        ),
        extra={"minilm_heads": len(mrows)} if mrows else None,
    )
    if mrows:  # a second table: per MiniLM head, jump ratios and T_dev fits (eps in gap units)
        mcols = ["model", "gap", "beta", "norm V", "aligned jump", "aligned R2", "crossing jump"]
        write_json(os.path.join(workdir, "minilm.json"), mrows)
        with open(os.path.join(workdir, "results.md"), "a") as f:
            f.write(
                "\n\n## MiniLM heads (jump = D(T, 2 gap) / D(T, gap / 2); R2 of T_dev vs "
                "log 1/eps)\n\n"
                + sweep.markdown_table(
                    rows=mrows, columns=[(c, c) for c in [*mcols, "crossing R2"]]
                )
                + "\n"
            )
    return out
