"""Reporting of the P7 experiment (``experiments/subspace_diffusion.py``): slopes, trend checks and
plots, from the per-cell results. Split off to keep the experiment module short; it imports
nothing from other experiments.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["METHODS", "checks", "md_table", "plots", "summaries"]

METHODS = ("diffusion", "empirical", "kde_cv", "kde_silverman")


def _slope(ns, ws) -> float:
    ok = [(a, b) for a, b in zip(ns, ws, strict=True) if b > 0]
    if len(ok) < 2:
        return math.nan
    return float(np.polyfit(np.log([a for a, _ in ok]), np.log([b for _, b in ok]), 1)[0])


def summaries(config, sources, cells, floors):
    rows = []
    for src in sources:
        mine = sorted((c for c in cells if c["source"] == src["id"]), key=lambda c: c["n"])
        ns = [c["n"] for c in mine]
        for meth in METHODS:
            ws = [c[f"w1_{meth}"] for c in mine]
            excess = [w - floors[src["id"]] for w in ws]
            rows.append(
                {
                    "source": src["id"],
                    "k": src["k"],
                    "D": src["D"],
                    "method": meth,
                    "slope": _slope(ns, ws),
                    "slope_excess": _slope(ns, excess) if min(excess) > 0 else math.nan,
                    "target": -1.0 / max(src["k"], 2),
                    "w1_n_min": ws[0],
                    "w1_n_max": ws[-1],
                    "floor": floors[src["id"]],
                }
            )
    return rows


def checks(config, rows) -> list[dict[str, Any]]:
    tol, checks = config.eval.slope_tolerance, []
    by = {(r["source"], r["method"]): r for r in rows}
    for fam, dims in (("syn", config.data.dims), ("mnist", config.data.mnist_dims)):
        ks = config.data.ks if fam == "syn" else config.data.mnist_ks
        if not dims:
            continue
        d_lo, d_hi = min(dims), max(dims)
        diff = [by[(f"{fam}-k{k}-D{d}", "diffusion")] for k in ks for d in dims]
        ok = [r for r in diff if abs(r["slope"] - r["target"]) <= tol]
        checks.append(
            {
                "criterion": f"({fam}) diffusion slope within ±{tol} of -1/max(k,2)",
                "reproduced": len(ok) == len(diff),
                "evidence": ", ".join(
                    f"k{r['k']} D{r['D']}: {r['slope']:.2f} (target {r['target']:.2f})"
                    for r in diff
                ),
            }
        )
        ratios = {
            meth: [
                by[(f"{fam}-k{k}-D{d_hi}", meth)]["w1_n_max"]
                / by[(f"{fam}-k{k}-D{d_lo}", meth)]["w1_n_max"]
                for k in ks
            ]
            for meth in ("diffusion", "kde_cv", "kde_silverman")
        }
        slopes_d = [
            abs(
                by[(f"{fam}-k{k}-D{d_hi}", "diffusion")]["slope"]
                - by[(f"{fam}-k{k}-D{d_lo}", "diffusion")]["slope"]
            )
            for k in ks
        ]
        checks.append(
            {
                "criterion": f"({fam}) diffusion independent of D: |slope(D={d_hi}) - "
                f"slope(D={d_lo})| <= {tol} and W₁ ratio at the largest n <= "
                f"{config.eval.max_d_ratio}",
                "reproduced": max(slopes_d) <= tol
                and max(ratios["diffusion"]) <= config.eval.max_d_ratio,
                "evidence": "slope gaps "
                + ", ".join(f"{s:.2f}" for s in slopes_d)
                + "; W₁ ratios "
                + ", ".join(f"{r:.2f}" for r in ratios["diffusion"]),
            }
        )
        for meth in ("kde_cv", "kde_silverman"):
            worse = [a > b for a, b in zip(ratios[meth], ratios["diffusion"], strict=True)]
            checks.append(
                {
                    "criterion": f"({fam}) {meth} degrades with D more than diffusion "
                    f"(W₁ ratio D={d_hi}/D={d_lo} at the largest n, every k)",
                    "reproduced": all(worse),
                    "evidence": ", ".join(
                        f"k{k}: {a:.2f} vs {b:.2f}"
                        for k, a, b in zip(ks, ratios[meth], ratios["diffusion"], strict=True)
                    ),
                }
            )
    return checks


def plots(workdir, sources, cells, floors) -> list[str]:
    from experiments.common.plots import subplots

    paths = []
    for fam in ("synthetic", "mnist"):
        srcs = [s for s in sources if s["family"] == fam]
        if not srcs:
            continue
        ks = sorted({s["k"] for s in srcs})
        dims = sorted({s["D"] for s in srcs})
        fig, axes = subplots(len(ks), len(dims), figsize=(3.2 * len(dims), 2.6 * len(ks)))
        axes = np.atleast_2d(axes).reshape(len(ks), len(dims))
        for src in srcs:
            ax = axes[ks.index(src["k"]), dims.index(src["D"])]
            mine = sorted((c for c in cells if c["source"] == src["id"]), key=lambda c: c["n"])
            ns = [c["n"] for c in mine]
            for meth in METHODS:
                ax.loglog(ns, [c[f"w1_{meth}"] for c in mine], "o-", ms=3, label=meth)
            ax.axhline(floors[src["id"]], color="gray", ls=":", label="floor")
            ref = mine[0]["w1_empirical"] * (np.asarray(ns) / ns[0]) ** (-1 / max(src["k"], 2))
            ax.loglog(ns, ref, "k--", lw=0.8, label="n^(-1/max(k,2))")
            ax.set_title(f"k={src['k']}, D={src['D']}", fontsize=9)
        axes[0, 0].legend(fontsize=6)
        fig.supxlabel("n (training points)")
        fig.supylabel("W₁ to fresh true samples")
        fig.tight_layout()
        paths.append(os.path.join(workdir, f"w1_vs_n_{fam}.png"))
        fig.savefig(paths[-1], dpi=110)
        # samples on the subspaces: coordinates in the first subspace's basis (k = 2 sources)
        show = [s for s in srcs if s["k"] == 2] or srcs[:1]
        fig, axes = subplots(len(show), 3, figsize=(9, 3 * len(show)), squeeze=False)
        for i, src in enumerate(show):
            cell = max((c for c in cells if c["source"] == src["id"]), key=lambda c: c["n"])
            u = src["bases"][0]
            for j, meth in enumerate(("diffusion", "empirical", "kde_cv")):
                s = np.asarray(cell["samples"][meth])
                inside = np.linalg.norm(s - (s @ u) @ u.T, axis=1)
                z = s @ u
                ax = axes[i, j]
                ax.scatter(z[:, 0], z[:, -1], s=3, c=np.log10(inside + 1e-6), cmap="viridis")
                ax.set_title(f"{src['id']} n={cell['n']}: {meth}", fontsize=8)
        fig.suptitle("samples in the first subspace's coordinates (colour: log10 distance to it)")
        fig.tight_layout()
        paths.append(os.path.join(workdir, f"samples_{fam}.png"))
        fig.savefig(paths[-1], dpi=110)
    return paths


def md_table(rows, cols) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows])
