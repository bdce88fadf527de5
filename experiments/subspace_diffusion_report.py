"""Reporting of the P7 experiment (``experiments/subspace_diffusion.py``): slopes over seeds, W₁
against the ambient dimension, trend checks and plots, from the per-cell results. Split off to keep
the experiment module short; it imports nothing from other experiments.

The finite-sample floor: ``W₁`` is measured between ``m`` generated and ``m`` fresh true samples,
so even a perfect sampler scores about ``floor = W₁(true, true')`` (two independent ``m``-samples of
the law, per seed). The rate is read from the excess: the slope of ``log(W₁ - floor)`` against
``log n`` per seed (:func:`lowrank_jax.generative.log_log_slope`; cells at or under the floor are
left out and counted), then its mean and standard deviation over seeds. Near the floor that
subtraction is biased (W₁ is not additive in the two errors), so the rate is also read from the
*resolved* cells alone, those whose ``W₁ ≥ eval.resolution × floor`` (:func:`resolved_slope`), and
counted only where every seed has at least 3 of them spanning 4× in ``n``: elsewhere the
evaluation does not resolve the rate and the check says so (inconclusive).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from lowrank_jax import generative as gen

__all__ = [
    "METHODS",
    "checks",
    "d_rows",
    "md_table",
    "notes",
    "plots",
    "resolved_slope",
    "summaries",
]

METHODS = ("diffusion", "diffusion_no_tweedie", "empirical", "kde_cv", "kde_silverman")
REPRODUCED, NOT_REPRODUCED, BY_CONSTRUCTION, INCONCLUSIVE = (
    "REPRODUCED",
    "NOT reproduced",
    "by construction (not counted)",
    "inconclusive (the evaluation does not resolve it)",
)
MIN_RESOLVED, MIN_SPAN = 3, 4.0  # a resolved slope: >= 3 cells spanning >= 4x in n


def _mean_sd(values) -> tuple[float, float]:
    v = np.asarray([x for x in values if math.isfinite(x)], np.float64)
    if not len(v):
        return math.nan, math.nan
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def _cells_of(cells, source, seed):
    return sorted(
        (c for c in cells if c["source"] == source and c["seed"] == seed), key=lambda c: c["n"]
    )


def resolved_slope(sizes, errors, floor: float, resolution: float) -> tuple[float, int]:
    """The slope of ``log(W₁ - floor)`` against ``log n`` on the cells with
    ``W₁ ≥ resolution × floor`` only: ``(slope, number of such cells)``, the slope NaN unless
    there are at least 3 of them spanning at least 4× in ``n``."""
    keep = [(n, w) for n, w in zip(sizes, errors, strict=True) if w >= resolution * floor]
    if len(keep) < MIN_RESOLVED or max(n for n, _ in keep) < MIN_SPAN * min(n for n, _ in keep):
        return math.nan, len(keep)
    return gen.log_log_slope(*zip(*keep, strict=True), floor=floor)[0], len(keep)


def summaries(config, sources, cells, floors) -> list[dict[str, Any]]:
    """One row per (source, method): raw, floor-subtracted and resolved slopes (mean, sd over
    seeds; the resolved one NaN unless every seed resolves it) and ``W₁ / floor`` at the largest
    ``n``."""
    rows = []
    seeds = range(config.eval.num_seeds)
    for src in sources:
        per_seed = {seed: _cells_of(cells, src["id"], seed) for seed in seeds}
        for meth in config.eval.methods:
            raw, excess, used, first, last, ratio = [], [], [], [], [], []
            res, res_used, over = [], [], []
            for seed, mine in per_seed.items():
                ns, ws = [c["n"] for c in mine], [c[f"w1_{meth}"] for c in mine]
                floor = floors[(src["id"], seed)]
                ratio += [c[f"w1_{meth}"] / c["w1_empirical"] for c in mine]
                raw.append(gen.log_log_slope(ns, ws)[0])
                slope, num = gen.log_log_slope(ns, ws, floor=floor)
                excess.append(slope)
                used.append(num)
                slope, num = resolved_slope(ns, ws, floor, config.eval.resolution)
                res.append(slope)
                res_used.append(num)
                over.append(ws[-1] / floor)
                first.append(ws[0])
                last.append(ws[-1])
            (slope, slope_sd), (ex, ex_sd) = _mean_sd(raw), _mean_sd(excess)
            rs, rs_sd = _mean_sd(res) if all(map(math.isfinite, res)) else (math.nan, math.nan)
            rows.append(
                {
                    "source": src["id"],
                    "k": src["k"],
                    "D": src["D"],
                    "method": meth,
                    "slope": slope,
                    "slope_sd": slope_sd,
                    "slope_excess": ex,
                    "slope_excess_sd": ex_sd,
                    "excess_points": int(min(used)),
                    "slope_resolved": rs,
                    "slope_resolved_sd": rs_sd,
                    "resolved_points": int(min(res_used)),
                    "w1_over_floor": _mean_sd(over)[0],
                    "target": -1.0 / max(src["k"], 2),
                    "w1_n_min": _mean_sd(first)[0],
                    "w1_n_max": _mean_sd(last)[0],
                    "floor": _mean_sd([floors[(src["id"], s)] for s in seeds])[0],
                    "ratio_to_empirical": _mean_sd(ratio)[0],
                    "max_ratio_to_empirical": float(max(ratio)),
                }
            )
    return rows


def d_rows(config, sources, cells, floors, mlp_rows) -> list[dict[str, Any]]:
    """W₁ against ``D`` at ``k = mlp_k``, ``n = mlp_n`` (mean ± sd over seeds): the kernel sampler
    with and without its Tweedie step, the tuned DSM-MLP score, the empirical measure."""
    k, n = config.model.mlp_k, config.model.mlp_n
    out = []
    for src in sorted((s for s in sources if s["k"] == k), key=lambda s: s["D"]):
        mine = [c for c in cells if c["source"] == src["id"] and c["n"] == n]
        mlps = [r for r in mlp_rows if r["source"] == src["id"]]
        sigma_t0 = float(n) ** (-1.0 / max(k, 2)) * config.model.sigma_scale
        row = {"D": src["D"], "k": k, "n": n, "sigma_t0_sqrt_D_minus_k": sigma_t0 * math.sqrt(src["D"] - k)}  # fmt: skip
        for meth in ("diffusion", "diffusion_no_tweedie", "empirical"):
            row[meth], row[f"{meth}_sd"] = _mean_sd([c.get(f"w1_{meth}", math.nan) for c in mine])
        for meth in ("mlp", "mlp_no_tweedie"):
            row[meth], row[f"{meth}_sd"] = _mean_sd([r[f"w1_{meth}"] for r in mlps])
        row["mlp_lr"] = mlps[0]["lr"] if mlps else math.nan
        row["mlp_param"] = mlps[0]["parameterisation"] if mlps else ""
        row["floor"] = _mean_sd([floors[(src["id"], s)] for s in range(config.eval.num_seeds)])[0]
        out.append(row)
    return out


def _check(criterion, status, evidence) -> dict[str, Any]:
    return {"criterion": criterion, "status": status, "evidence": evidence}


def _rate_check(config, rows, meth, status=None) -> dict[str, Any]:
    """``meth``'s resolved slope against -1/max(k,2), over the sources whose rate is resolved."""
    tol, mine = config.eval.slope_tolerance, [r for r in rows if r["method"] == meth]
    resolved = [r for r in mine if math.isfinite(r["slope_resolved"])]
    ok = [abs(r["slope_resolved"] - r["target"]) <= tol for r in resolved]
    if status is None:
        status = INCONCLUSIVE if not resolved else REPRODUCED if all(ok) else NOT_REPRODUCED
    per = [
        f"k{r['k']} D{r['D']}: "
        + (
            f"{r['slope_resolved']:.2f} ± {r['slope_resolved_sd']:.2f}"
            if math.isfinite(r["slope_resolved"])
            else f"unresolved ({r['resolved_points']} cells)"
        )
        + f" [floor {r['floor']:.3f}, W₁/floor at n_max {r['w1_over_floor']:.2f}]"
        for r in mine
    ]
    return _check(
        f"{meth}: slope of log(W₁ - floor) vs log n on the resolved cells (W₁ >= "
        f"{config.eval.resolution:g} × floor, >= {MIN_RESOLVED} spanning {MIN_SPAN:g}× in n, "
        f"every seed) within ±{tol} of -1/max(k,2)",
        status,
        f"{sum(ok)}/{len(resolved)} resolved sources within (of {len(mine)}); " + ", ".join(per),
    )


def _slope_vs_d(config, rows) -> list[dict[str, Any]]:
    """The Tweedie sampler's slopes at the largest against the smallest ``D`` per ``k``: raw, and
    on the resolved cells where both resolve. By construction (not counted): its output law
    depends on the training set only through the set's pairwise geometry."""
    out, tol = [], config.eval.slope_tolerance
    by = {(r["k"], r["D"]): r for r in rows if r["method"] == "diffusion"}
    for k in sorted({k for k, _ in by}):
        dims = sorted(d for kk, d in by if kk == k)
        if len(dims) < 2:
            continue
        lo, hi = by[(k, dims[0])], by[(k, dims[-1])]
        parts = []
        for col, name in (("slope", "raw"), ("slope_resolved", "resolved")):
            diff = hi[col] - lo[col]
            parts.append(
                f"{name}: {lo[col]:.2f} ± {lo[col + '_sd']:.2f} vs {hi[col]:.2f} ± "
                f"{hi[col + '_sd']:.2f}, difference {diff:+.2f} "
                f"({'within' if abs(diff) <= tol else 'outside'} ±{tol})"
                if math.isfinite(diff)
                else f"{name}: unresolved"
            )
        out.append(
            _check(
                f"k={k}: diffusion's slope at D={dims[-1]} vs D={dims[0]} within ±{tol}",
                BY_CONSTRUCTION,
                "; ".join(parts),
            )
        )
    return out


def checks(config, rows, by_d) -> list[dict[str, Any]]:
    """The trend checks of specs.md §7, each REPRODUCED, NOT reproduced, inconclusive or by
    construction (checks of a method not in ``config.eval.methods`` are left out)."""
    tol, max_ratio, out = config.eval.slope_tolerance, config.eval.max_d_ratio, []
    methods = set(config.eval.methods)
    no_tweedie = "by construction: σ(t₀) ∝ n^(-1/max(k,2)) by choice of t₀ (not counted)"
    for meth, status in (
        ("diffusion", None),
        ("empirical", "reference (not counted)"),
        ("diffusion_no_tweedie", no_tweedie),
    ):
        if meth not in methods:
            continue
        mine = [r for r in rows if r["method"] == meth]
        ok = [abs(r["slope_excess"] - r["target"]) <= tol for r in mine]
        out.append(
            _check(
                f"{meth}: slope of log(W₁ - floor) vs log n within ±{tol} of -1/max(k,2) "
                "(mean over seeds)",
                status or (REPRODUCED if all(ok) else NOT_REPRODUCED),
                f"{sum(ok)}/{len(ok)} sources; "
                + ", ".join(
                    f"k{r['k']} D{r['D']}: {r['slope_excess']:.2f} ± {r['slope_excess_sd']:.2f}"
                    for r in mine
                ),
            )
        )
        out.append(_rate_check(config, rows, meth, status))
    if "diffusion" in methods:
        out += _slope_vs_d(config, rows)
        mine = [r for r in rows if r["method"] == "diffusion"]
        out.append(
            _check(
                "diffusion tracks the empirical measure: W₁(diffusion)/W₁(empirical) per cell "
                "(mean over n and seeds; max)",
                "reference (not counted)",
                ", ".join(
                    f"k{r['k']} D{r['D']}: {r['ratio_to_empirical']:.2f} "
                    f"({r['max_ratio_to_empirical']:.2f})"
                    for r in mine
                ),
            )
        )
    if len(by_d) >= 2:
        lo, hi = by_d[0], by_d[-1]
        for meth, status in (
            ("mlp", None),
            ("diffusion_no_tweedie", None),
            ("diffusion", BY_CONSTRUCTION),
        ):
            ratio = hi[meth] / lo[meth]
            if not math.isfinite(ratio):
                continue
            out.append(
                _check(
                    f"{meth} independent of D: W₁(D={hi['D']}) / W₁(D={lo['D']}) <= {max_ratio} "
                    f"(k={lo['k']}, n={lo['n']})",
                    status or (REPRODUCED if ratio <= max_ratio else NOT_REPRODUCED),
                    ", ".join(f"D{r['D']}: {r[meth]:.3f} ± {r[meth + '_sd']:.3f}" for r in by_d)
                    + f"; ratio {ratio:.2f}",
                )
            )
    by = {(r["k"], r["D"], r["method"]): r for r in rows}
    kde = ("diffusion", "kde_cv", "kde_silverman")
    for k in sorted({r["k"] for r in rows}):
        dims = sorted({r["D"] for r in rows if r["k"] == k})
        if len(dims) < 2 or not set(kde) <= methods:
            continue
        ratio = {m: by[(k, dims[-1], m)]["w1_n_max"] / by[(k, dims[0], m)]["w1_n_max"] for m in kde}
        out.append(
            _check(
                f"k={k}: KDE degrades with D more than diffusion (W₁ ratio D={dims[-1]}/"
                f"D={dims[0]} at the largest n)",
                BY_CONSTRUCTION,
                ", ".join(f"{m}: {v:.2f}" for m, v in ratio.items()),
            )
        )
    return out


def notes(config, trend, by_d, mlp_rows) -> str:
    """The markdown under the slope table: the checks, W₁ against D, the MLP tuning."""
    cols = ["D", "diffusion", "diffusion_sd", "diffusion_no_tweedie", "diffusion_no_tweedie_sd",
            "sigma_t0_sqrt_D_minus_k", "mlp", "mlp_sd", "mlp_no_tweedie", "mlp_no_tweedie_sd",
            "mlp_param", "mlp_lr", "empirical", "floor"]  # fmt: skip
    tuning = [r for r in mlp_rows if r["seed"] == 0]
    return "\n".join(
        [
            f"m = {config.eval.num_samples} generated vs m fresh true samples per seed, "
            f"{config.eval.num_seeds} seeds. `slope`: log W₁ vs log n; `slope_excess`: "
            "log(W₁ - floor) vs log n, floor = W₁(true, true') of the seed, cells at or under "
            "the floor left out (`excess_points`: fewest cells used over seeds); mean and sd "
            "over seeds. `slope_resolved`: the same on the cells with W₁ >= "
            f"{config.eval.resolution:g} × floor only (NaN unless every seed has >= "
            f"{MIN_RESOLVED} spanning {MIN_SPAN:g}× in n; `resolved_points`: fewest over "
            "seeds); `w1_over_floor`: W₁ / floor at the largest n (mean over seeds).",
            "",
            "Trend checks (specs.md §7):",
            "",
            *(f"- {c['status']}: {c['criterion']} — {c['evidence']}" for c in trend),
            "",
            f"W₁ against D (k = {config.model.mlp_k}, n = {config.model.mlp_n}; mean and sd over "
            "seeds; `sigma_t0_sqrt_D_minus_k`: the norm of D-dimensional noise of scale σ(t₀) "
            "off a k-dim subspace):",
            "",
            md_table(by_d, cols),
            "",
        ]
        + (
            [
                "",
                f"DSM-MLP (parameterisation, learning rate) by validation W₁ (seed 0, "
                f"{config.schedule.mlp_steps} steps, widths {tuple(config.model.mlp_features)}, "
                "same grid at every D):",
                "",
                md_table(tuning, ["D", "valid_w1_by_lr", "parameterisation", "lr", "final_loss"]),
            ]
            if tuning
            else []
        )
    )


def _mean_curve(cells, source, meth):
    ns = sorted({c["n"] for c in cells if c["source"] == source})
    return ns, [
        np.mean([c[f"w1_{meth}"] for c in cells if c["source"] == source and c["n"] == n])
        for n in ns
    ]


def plots(workdir, sources, cells, floors) -> list[str]:
    """``w1_vs_n.png`` (seed means, one panel per source) and ``samples.png`` (k = 2 sources)."""
    from matplotlib.ticker import NullFormatter

    from experiments.common.plots import subplots

    ks = sorted({s["k"] for s in sources})
    dims = sorted({s["D"] for s in sources})
    fig, axes = subplots(len(ks), len(dims), figsize=(3.0 * len(dims), 2.4 * len(ks)))
    axes = np.atleast_2d(axes).reshape(len(ks), len(dims))
    for ax in axes.ravel():
        ax.set_visible(False)
    for src in sources:
        ax = axes[ks.index(src["k"]), dims.index(src["D"])]
        ax.set_visible(True)
        for meth in [m for m in METHODS if f"w1_{m}" in cells[0]]:
            ns, ws = _mean_curve(cells, src["id"], meth)
            ax.loglog(ns, ws, "o-", ms=2, lw=1, label=meth)
        floor = np.mean([v for (s, _), v in floors.items() if s == src["id"]])
        ax.axhline(floor, color="gray", ls=":", label="floor")
        ns, ws = _mean_curve(cells, src["id"], "empirical")
        ax.loglog(ns, ws[0] * (np.asarray(ns) / ns[0]) ** (-1 / max(src["k"], 2)), "k--", lw=0.8,
                  label="n^(-1/max(k,2))")  # fmt: skip
        ax.set_title(f"k={src['k']}, D={src['D']}", fontsize=8)
        ax.tick_params(labelsize=6, which="both")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    axes[0, 0].legend(fontsize=5)
    fig.supxlabel("n (training points)")
    fig.supylabel("W₁ to fresh true samples")
    fig.tight_layout()
    paths = [os.path.join(workdir, "w1_vs_n.png")]
    fig.savefig(paths[-1], dpi=60)
    show = [s for s in sources if s["k"] == 2] or sources[:1]
    meths = ("diffusion", "diffusion_no_tweedie", "empirical", "kde_cv")
    meths = [m for m in meths if f"w1_{m}" in cells[0]]
    size = (2.5 * len(meths), 2.6 * len(show))
    fig, axes = subplots(len(show), len(meths), figsize=size, squeeze=False)
    for i, src in enumerate(show):
        cell = next(c for c in cells if c["source"] == src["id"] and "samples" in c)
        u = src["bases"][0]
        for j, meth in enumerate(meths):
            s = np.asarray(cell["samples"][meth])
            inside = np.linalg.norm(s - (s @ u) @ u.T, axis=1)
            z = s @ u
            axes[i, j].scatter(z[:, 0], z[:, -1], s=2, c=np.log10(inside + 1e-6), cmap="viridis")
            axes[i, j].set_title(f"{src['id']} n={cell['n']}: {meth}", fontsize=7)
    fig.suptitle("samples in the first subspace's coordinates (colour: log10 distance to it)")
    fig.tight_layout()
    paths.append(os.path.join(workdir, "samples.png"))
    fig.savefig(paths[-1], dpi=80)
    return paths


def md_table(rows, cols) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])
