"""Reporting of continual-learning runs: the table of accuracy-matrix metrics, JSON and plots.

Used by ``experiments/continual.py``: :func:`task_measures` after each task, :func:`notes` (the
setting and the validation search's choice, :func:`search_markdown`, :func:`heads_markdown`) and
:func:`write_continual_outputs` at the end. A *record* is one method's run on one seed: ``{"R": (T, T)
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
from experiments.common.sweep import markdown_table
from lowrank_jax import continual
from lowrank_jax import optim as lj_optim

__all__ = [
    "COLUMNS",
    "cosines",
    "heads_markdown",
    "mean_sd",
    "notes",
    "search_markdown",
    "summary",
    "task_measures",
    "write_continual_outputs",
]

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


def task_measures(state: continual.ContinualState, opt_state: Any) -> dict[str, Any]:
    """What a record keeps of a finished task besides its accuracies.

    Args:
      state: the method's state after ``end_task``.
      opt_state: the optimizer state the task's training ended with.

    Returns:
      ``{"recycled_fraction": [the first GradientRecyclingState's fraction] or [],
      "memory_fill": [mean over kernels of k / n] or [] (no subspace memory), "update": the
      flattened float32 updates of all adapted kernels (for :func:`cosines`)}``.
    """
    recycling = [
        float(s.recycled_fraction)
        for s in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, lj_optim.GradientRecyclingState)
        )
        if isinstance(s, lj_optim.GradientRecyclingState)
    ]
    memories = jax.tree.leaves(
        state.memory, is_leaf=lambda x: isinstance(x, lj_optim.SubspaceMemory)
    )
    # k / n per kernel (per layer of a stacked kernel: basis (*stack, n, k), size (*stack,))
    fill = [float(np.mean([np.mean(np.asarray(m.size) / m.basis.shape[-2]) for m in memories]))]
    fill = fill if memories else []
    update = np.concatenate(
        [np.ravel(np.asarray(state.update[k], np.float32)) for k in state.kernels]
    )
    return {"recycled_fraction": recycling[:1], "memory_fill": fill, "update": update}


def _mean_offdiagonal(cosine: list[list[float]]) -> float:
    c = np.abs(np.asarray(cosine, np.float64))
    n = len(c)
    return float((c.sum() - np.trace(c)) / (n * (n - 1))) if n > 1 else math.nan


def notes(
    config: Any, chosen: Mapping[str, Mapping[str, Any]], workdir: str, *, protocol: str
) -> str:
    """The notes under the table of ``results.md``: the setting (``protocol``: ``"til"`` or
    ``"cil"``), the metrics and, if the validation search ran (``chosen``: its choice per
    method), what it chose (:func:`search_markdown`, which writes ``search.json``;
    :func:`heads_markdown`)."""
    bench = config.data.benchmark
    seeds = ", ".join(str(s) for s in config.seeds)
    text = (
        f"Benchmark `{bench}` ({protocol}), {config.data.num_tasks} tasks, "
        f"seeds ({seeds}), "
        f"LoRA rank {config.adapter.rank}, {config.schedule.steps_per_task} steps per task, "
        + (
            "head chosen per method on validation (below). "
            if config.search.heads
            else f"head `{config.head}`. "
        )
        + "final_acc: mean accuracy on all tasks after the last; avg_inc_acc: mean over steps of the "
        "accuracy on the tasks seen so far; forgetting/bwt: from the accuracy matrix; plasticity: "
        "mean accuracy on each task right after learning it; update_cos: mean |cos| between "
        "different tasks' updates ΔW_t (all adapted kernels). Mean ± sd over seeds."
    )
    if chosen:
        heads = tuple(config.search.heads)
        what = f"{config.search.trials} random-search trials" if config.search.trials else ""
        what += (" × " if what else "the configured values × ") + "heads " if heads else ""
        what += ", ".join(heads)
        text += (
            f"\n\nHyper-parameters chosen per method by {what} "
            f"on seed {config.seeds[0]}'s validation split ({config.data.valid_fraction:.0%} "
            "of each class's training rows; final validation accuracy; experiments/common/"
            "continual_search.py), then every seed trained on all training rows with them:\n\n"
            + search_markdown(chosen, workdir)
        )
        if heads:
            text += "\n\nValidation final accuracy per head:\n\n" + heads_markdown(chosen)
    return text


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


def search_markdown(chosen: Mapping[str, Mapping[str, Any]], workdir: str) -> str:
    """The chosen values as a Markdown table (also written to ``<workdir>/search.json``)."""
    write_json(os.path.join(workdir, "search.json"), dict(chosen))
    rows = []
    for method, c in chosen.items():
        scores = [t["valid_final_acc"] for t in c["trials"]]
        values = ", ".join(
            f"{k.split('.')[-1]}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in c["values"].items()
        )
        rows.append(
            {
                "method": method,
                "trials": len(scores),
                "valid_final_acc (chosen)": c["valid_final_acc"],
                "valid range": f"{min(scores):.3f}–{max(scores):.3f}" if scores else "",
                "chosen values": values,
            }
        )
    cols = [(c, c) for c in ("method", "trials", "valid_final_acc (chosen)", "valid range")]
    return markdown_table(rows, [*cols, ("chosen values", "chosen values")])


def heads_markdown(chosen: Mapping[str, Mapping[str, Any]]) -> str:
    """Validation final accuracy of every method × head (the best trial of each), as Markdown."""
    heads = list(
        dict.fromkeys(
            t["values"]["head"]
            for c in chosen.values()
            for t in c["trials"]
            if "head" in t["values"]
        )
    )
    rows = []
    for method, c in chosen.items():
        row: dict[str, Any] = {"method": method}
        for h in heads:
            scores = [t["valid_final_acc"] for t in c["trials"] if t["values"].get("head") == h]
            row[h] = max(scores) if scores else math.nan
        rows.append(row)
    return markdown_table(rows, [("method", "method"), *((f"valid {h}", h) for h in heads)])
