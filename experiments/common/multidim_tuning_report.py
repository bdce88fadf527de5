"""Reporting of the P12 multi-dimensional tuning study: bound columns, table rows, trend checks,
plots and ``results.md``.

Used by ``experiments/multidim_tuning.py``. A family's repetitions ``reps`` are its per-
repetition cells ``{"<tuner>_p<p>": {"alpha", "empirical", "true", "evals"}}`` (one entry per N
of ``config.data.ns``); ``oracles`` are ``{"p<p>": {"alpha", "true"}}`` (``α*_p`` on the fresh
instances; TPE is compared with the ``rs`` oracle of its p).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common import sweep
from lowrank_jax.tuning.bounds import (
    lasso_loss_polynomials,
    pseudo_dimension_bound,
    uniform_convergence_bound,
    uniform_convergence_sample_size,
)
from lowrank_jax.tuning.lasso import Penalty

__all__ = [
    "COLUMNS",
    "extra_summary",
    "gap_bounds",
    "log_slope",
    "plot_bound",
    "plot_vs_n",
    "summarise",
    "write_results",
]

COLUMNS = (
    "family",
    "tuner",
    "N",
    "gap",
    "abs_gap",
    "bound",
    "excess",
    "true_risk",
    "R_minus_best_R*",
    "abs_gap_slope",
)


def plot_vs_n(
    path: str,
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    ylabel: str,
    guide: tuple[float, float] | None = None,
) -> None:
    """Draws ``{label: (ns, ys)}`` against N (log x; log y when every y is positive) into ``path``.

    Args:
      path: output ``.png`` file.
      curves: label -> (N values, y values).
      title, ylabel: the plot's title and y label.
      guide: optional ``(x0, y0)``: a dashed ``∝ N^(-1/2)`` line through it.
    """
    from experiments.common.plots import subplots

    fig, ax = subplots(figsize=(6, 4), dpi=100)
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", ms=3, label=label)
    if guide is not None:  # a dashed N^(-1/2) line through (x0, y0)
        x0, y0 = guide
        xs = np.array([min(xs[0] for xs, _ in curves.values()), x0])
        ax.plot(xs, y0 * np.sqrt(x0 / xs), "k--", lw=0.8, label="∝ N^(-1/2)")
    ax.set_xscale("log")
    if all(y > 0 for _, ys in curves.values() for y in ys):
        ax.set_yscale("log")
    ax.set(title=title, xlabel="N (training instances)", ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def log_slope(ns: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log N (NaN unless every y is positive).

    Args:
      ns: ``(K,)`` instance counts; ys: ``(K,)`` values.

    Returns:
      The slope (e.g. ``-0.5`` for ``y ∝ N^(-1/2)``), or NaN.
    """
    ys = np.asarray(ys)
    return float(np.polyfit(np.log(ns), np.log(ys), 1)[0]) if np.all(ys > 0) else float("nan")


def gap_bounds(
    config: Any, penalty: Penalty, loss_range: float, ps: Sequence[int]
) -> dict[int, dict]:
    """The pseudo-dimension bound on the gap of each p, at every N of ``config.data.ns``.

    Args:
      config: the experiment's config (``data.ns``, ``eval.bound_delta``).
      penalty: the family's penalty (:func:`tuning.lasso_loss_polynomials` counts its loss class).
      loss_range: ``H``, the plug-in range of the loss.
      ps: the numbers of tied weights tuned.

    Returns:
      ``{p: {"pdim": Pdim bound (int), "bound": (K,) uniform-convergence bound per N}}``
      (:func:`tuning.pseudo_dimension_bound`, :func:`tuning.uniform_convergence_bound` with
      ``δ = config.eval.bound_delta``).
    """
    num_polys, degree = lasso_loss_polynomials(penalty)
    out = {}
    for p in sorted(set(ps)):
        d = pseudo_dimension_bound(p, num_polys=num_polys, degree=degree)
        b = uniform_convergence_bound(
            np.array(config.data.ns), pdim=d, loss_bound=loss_range, delta=config.eval.bound_delta
        )
        out[p] = {"pdim": d, "bound": b}
    return out


def plot_bound(
    path: str,
    ns: Sequence[int],
    stats: Mapping[str, Mapping],
    bounds: Mapping[int, Mapping],
    title: str,
) -> None:
    """The bound (solid) against the measured mean |gap| (dashed) over N, one colour per p.

    Args:
      path: output ``.png`` file.
      ns: ``(K,)`` instance counts.
      stats: ``{"<tuner>_p<p>": {"abs_gap": (K,), ...}}``.
      bounds: :func:`gap_bounds`' output.
      title: plot title.
    """
    from experiments.common.plots import subplots

    fig, ax = subplots(figsize=(6, 4), dpi=100)
    import matplotlib

    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(sorted(bounds)):
        c = colours[i % len(colours)]
        ax.plot(
            ns, bounds[p]["bound"], "-", color=c, label=f"bound, p={p} (Pdim ≤ {bounds[p]['pdim']})"
        )
        for k, st in stats.items():
            if int(k.split("_p")[1]) == p:
                style = ":" if k.startswith("tpe") else "--"
                ax.plot(ns, np.maximum(st["abs_gap"], 1e-6), style, marker="o", ms=3, color=c,
                        label=f"measured |gap|, {k}")  # fmt: skip
    ax.set(xscale="log", yscale="log", title=title, xlabel="N (training instances)",
           ylabel="generalisation gap")  # fmt: skip
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


def summarise(
    config: Any,
    workdir: str,
    part: str,
    reps: Sequence[Mapping],
    oracles: Mapping[str, Mapping],
    bounds: Mapping[int, Mapping],
) -> tuple[list[dict], list[dict]]:
    """Table rows, plots and trend checks of one family.

    ``gap`` is the signed ``R(α̂) − R̂_N(α̂)`` (the optimism of the empirical risk), ``|gap|`` its
    absolute value (what uniform convergence bounds), both averaged over repetitions; ``bound``
    is the pseudo-dimension bound on ``sup_α |gap|`` for the tuner's p (:func:`gap_bounds`).

    Args:
      config: the experiment's config (``data.ns``).
      workdir: where ``<part>_{abs_gap,excess,risk,bound}.png`` are written.
      part: the family's name.
      reps: the repetition cells; oracles: the oracle cells (module docstring).
      bounds: :func:`gap_bounds`' output.

    Returns:
      ``(rows, checks)``: one row per tuner and N (:data:`COLUMNS`), and the trend checks
      (:func:`experiments.common.sweep.check` records).
    """
    ns = np.array(config.data.ns)
    names = list(reps[0])
    rows, stats = [], {}
    best_all = min(o["true"] for o in oracles.values())
    for name in names:
        tr = np.array([r[name]["true"] for r in reps])
        g = tr - np.array([r[name]["empirical"] for r in reps])
        ex = tr - oracles[name.replace("tpe", "rs").split("_")[1]]["true"]
        st = {"gap": g.mean(0), "abs_gap": np.abs(g).mean(0), "excess": ex.mean(0), "risk": tr}
        st["slope"] = log_slope(ns, st["abs_gap"])
        stats[name] = st
        for j, n in enumerate(ns):
            rows.append(
                {
                    "family": part,
                    "tuner": name,
                    "N": int(n),
                    "gap": sweep.format_mean_sd(g[:, j], 4),
                    "abs_gap": float(st["abs_gap"][j]),
                    "bound": float(bounds[int(name.split("_p")[1])]["bound"][j]),
                    "excess": sweep.format_mean_sd(ex[:, j], 4),
                    "true_risk": sweep.format_mean_sd(tr[:, j], 4),
                    "R_minus_best_R*": float(tr[:, j].mean() - best_all),
                    "abs_gap_slope": st["slope"] if j == 0 else "",
                }
            )
    for what, ylabel in (("abs_gap", "mean |generalisation gap|"), ("excess", "excess risk")):
        curves = {k: (ns, np.maximum(v[what], 1e-6)) for k, v in stats.items()}
        last = (ns[-1], float(np.median([v[-1] for _, v in curves.values()])))
        guide = last if what == "abs_gap" else None
        plot_vs_n(os.path.join(workdir, f"{part}_{what}.png"), curves, f"P12 {part}", ylabel, guide)
    plot_vs_n(
        os.path.join(workdir, f"{part}_risk.png"),
        {k: (ns, v["risk"].mean(0)) for k, v in stats.items()},
        f"P12 {part}",
        "true risk of the tuned weights",
    )
    plot_bound(
        os.path.join(workdir, f"{part}_bound.png"),
        ns,
        stats,
        bounds,
        f"P12 {part}: pseudo-dimension bound vs measured gap",
    )
    slopes = ", ".join(f"{k}: {v['slope']:.2f}" for k, v in stats.items())
    checks = [
        sweep.check(
            f"{part}: mean |gap| slope in N within [-0.75, -0.25] for every tuner",
            all(-0.75 <= v["slope"] <= -0.25 for v in stats.values()),
            slopes,
        )
    ]
    rs = sorted((k for k in names if k.startswith("rs")), key=lambda k: int(k.split("_p")[1]))
    if "grid_p1" in stats and rs:
        order = ["grid_p1", *rs]
        for what in ("gap", "abs_gap"):
            at = {k: stats[k][what] for k in order}
            checks.append(
                sweep.check(
                    f"{part}: {what} grows with p ({' < '.join(order)}) at N={ns[0]}; "
                    f"{rs[-1]} > grid_p1 at every N",
                    bool(
                        np.all(np.diff([at[k][0] for k in order]) > 0)
                        and np.all(at[rs[-1]] > at["grid_p1"])
                    ),
                    "; ".join(f"{k}: " + ", ".join(f"{x:.3f}" for x in at[k]) for k in order),
                )
            )
        for k in rs:
            d = stats[k]["risk"] - stats["grid_p1"]["risk"]
            se = d.std(0, ddof=1) / np.sqrt(len(d)) if len(d) > 1 else np.zeros(len(ns))
            checks.append(
                sweep.check(
                    f"{part}: weighted ({k}) beats scalar in true risk at N={ns[-1]}",
                    bool(d[:, -1].mean() < 0),
                    "R(weighted) − R(scalar) per N: "
                    + ", ".join(f"{m:+.4f}±{e:.4f}" for m, e in zip(d.mean(0), se, strict=True)),
                )
            )
    return rows, checks


def extra_summary(
    config: Any, oracles: Mapping[str, Mapping], loss_range: float, bounds: Mapping[int, Mapping]
) -> dict[str, Any]:
    """The family's entries of ``summary.json``'s ``extra`` (without the family prefix).

    Args:
      config: the experiment's config (``eval.bound_delta``).
      oracles: the oracle cells; loss_range: the plug-in ``H``; bounds: :func:`gap_bounds`.

    Returns:
      ``{"oracle_risk", "loss_range_H", "pdim_bound", "N_for_bound_0.1H"}``: the oracles' true
      risks, ``H``, the Pdim bound per p and the N at which the bound reaches ``ε = 0.1 H``
      (:func:`tuning.uniform_convergence_sample_size`; the bound is vacuous, ≥ H, below N = Pdim).
    """
    return {
        "oracle_risk": {k: round(v["true"], 4) for k, v in oracles.items()},
        "loss_range_H": round(loss_range, 3),
        "pdim_bound": {f"p{p}": b["pdim"] for p, b in bounds.items()},
        "N_for_bound_0.1H": {
            f"p{p}": uniform_convergence_sample_size(
                0.1 * loss_range,
                pdim=b["pdim"],
                loss_bound=loss_range,
                delta=config.eval.bound_delta,
            )
            for p, b in bounds.items()
        },
    }


def write_results(
    workdir: str, rows: Sequence[Mapping], checks: Sequence[Mapping], extra: Mapping[str, Any]
) -> dict:
    """Writes ``results.md`` and ``summary.json`` (:func:`sweep.write_sweep_results`).

    Args:
      workdir: the run directory.
      rows: every family's :func:`summarise` rows; checks: their checks.
      extra: every family's :func:`extra_summary`, keys prefixed ``<family>_``.

    Returns:
      The summary metrics of :func:`sweep.write_sweep_results`.
    """
    return sweep.write_sweep_results(
        workdir,
        rows,
        checks,
        title="P12 multi-dimensional tuning: generalisation gap and excess risk vs N "
        "(mean ± sd over repetitions)",
        columns=list(COLUMNS),
        command=sweep.command_line(
            "python -m experiments.train --config=configs/multidim_tuning.py"
        ),
        extra=extra,
    )
