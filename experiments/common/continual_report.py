"""Reporting of continual-learning runs: the table of accuracy-matrix metrics, JSON and plots.

Used by ``experiments/continual.py``. A *record* is one method's run on one seed: ``{"R": (T, T)
accuracy matrix (NaN above the diagonal), "summary": {metric: value}}`` plus optional lists
``update_cosine`` (``(T, T)`` cosines between the tasks' updates), ``selection_accuracy`` (per
task; NaN when the method selects no module), ``memory_fill`` and ``recycled_fraction``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from experiments.common.metrics import write_json, write_results_md
from experiments.common.plots import plot_curves, plot_heatmap
from lowrank_jax import continual

__all__ = ["COLUMNS", "cosines", "mean_sd", "summary", "write_continual_outputs"]

COLUMNS = ("final_acc", "avg_inc_acc", "forgetting", "bwt", "plasticity")


def summary(r: np.ndarray, *, final_row_only: bool = False) -> dict[str, float]:
    """The metrics of an accuracy matrix; ``final_row_only`` (joint training): final_acc only."""
    if final_row_only:
        return {"final_acc": float(np.mean(r[-1])), **{c: math.nan for c in COLUMNS[1:]}}
    return continual.summarize(r)


def mean_sd(values: Sequence[float]) -> str:
    """``"0.123"`` for one value, ``"0.123 ± 0.045"`` (sample sd) for several, ``"–"`` if all NaN."""
    v = np.asarray(values, np.float64)
    if np.all(np.isnan(v)):
        return "–"
    if len(v) == 1:
        return f"{v[0]:.3f}"
    return f"{np.nanmean(v):.3f} ± {np.nanstd(v, ddof=1):.3f}"


def cosines(updates: Sequence[np.ndarray]) -> list[list[float]]:
    """``cos(ΔW_i, ΔW_j)`` between flattened per-task updates, ``(T, T)``."""
    u = np.stack(updates).astype(np.float64)
    u /= np.maximum(np.linalg.norm(u, axis=1, keepdims=True), 1e-30)
    return (u @ u.T).tolist()


def _mean_offdiagonal(cosine: list[list[float]]) -> float:
    c = np.abs(np.asarray(cosine, np.float64))
    n = len(c)
    return float((c.sum() - np.trace(c)) / (n * (n - 1))) if n > 1 else math.nan


def write_continual_outputs(
    workdir: str, records: Mapping[str, list[dict[str, Any]]], *, title: str, notes: str
) -> dict[str, dict[str, float]]:
    """Writes ``results.md`` (mean ± sd over seeds), ``accuracy_matrices.json`` and the plots.

    Returns:
      ``{method: {metric: mean over seeds}}``; prints the table.
    """
    rows, table = [], {}
    for method, outs in records.items():
        row = {"method": method}
        table[method] = {}
        for col in COLUMNS:
            vals = [o["summary"][col] for o in outs]
            row[col] = mean_sd(vals)
            table[method][col] = float(np.nanmean(vals)) if not np.all(np.isnan(vals)) else math.nan
        vals = [_mean_offdiagonal(o["update_cosine"]) for o in outs if "update_cosine" in o]
        if vals:
            row["update_cos"] = mean_sd(vals)
            table[method]["update_cos"] = float(np.nanmean(vals))
        vals = [o["selection_accuracy"][-1] for o in outs if o.get("selection_accuracy")]
        if vals and not np.any(np.isnan(vals)):
            row["selection_acc"] = mean_sd(vals)
            table[method]["selection_acc"] = float(np.mean(vals))
        rows.append(row)
    columns = ["method", *COLUMNS] + [
        c for c in ("update_cos", "selection_acc") if any(c in r for r in rows)
    ]
    text = write_results_md(workdir, rows, title=title, columns=columns, notes=notes)
    matrices = {
        m: [
            {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in o.items()}
            for o in outs
        ]
        for m, outs in records.items()
    }
    write_json(os.path.join(workdir, "accuracy_matrices.json"), matrices)
    _plots(workdir, records)
    print(text)
    return table


def _plots(workdir: str, records: Mapping[str, list[dict[str, Any]]]) -> None:
    if jax.process_index() != 0:
        return
    for method, outs in records.items():
        plot_heatmap(  # the per-task accuracy matrix, mean over seeds (NaN above the diagonal)
            os.path.join(workdir, f"acc_matrix_{method}.png"),
            np.mean(np.stack([o["R"] for o in outs]), axis=0),
            title=f"{method}: test accuracy R[t, j]",
            xlabel="evaluated task j",
            ylabel="after task t",
            vmin=0.0,
            vmax=1.0,
        )
    curves = {}
    for method, outs in records.items():
        diag = np.mean([np.diag(o["R"]) for o in outs], axis=0)
        if np.all(np.isfinite(diag)):  # (joint training fills only the last row)
            curves[method] = (list(range(1, len(diag) + 1)), diag.tolist())
    plot_curves(
        os.path.join(workdir, "plasticity.png"),
        curves,
        title="new-task accuracy right after learning it",
        xlabel="task",
        ylabel="accuracy",
    )
    fills = {
        m: (
            list(range(1, len(outs[0]["memory_fill"]) + 1)),
            np.mean([o["memory_fill"] for o in outs], axis=0).tolist(),
        )
        for m, outs in records.items()
        if outs and outs[0].get("memory_fill")
    }
    if fills:
        plot_curves(
            os.path.join(workdir, "memory_fill.png"),
            fills,
            title="subspace memory: fraction of input dims used",
            xlabel="task",
            ylabel="k / n (mean over kernels)",
        )
