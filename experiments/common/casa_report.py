"""Reporting of the CASA transfer study (P18): the table over seeds, ``results.json`` and the plot.

Used by ``experiments/casa.py``; ``results`` are its per-seed cells (``cells/seed=<s>.json``):
``{"rows": {name: {"play_accuracy", "genre_accuracy", "genre_agreement", "norm_inflation",
"combined", "hparams", ...}}, "diagnostics": {name: mean over adapted kernels}, "per_kernel":
...}``, with a row per transfer method and the references ``target_alone`` and ``source_lora``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from experiments.common.metrics import write_json, write_results_md

__all__ = ["DIAGNOSTICS", "METRICS", "mean_std", "plot_transfer", "write_report"]

METRICS = ("play_accuracy", "genre_accuracy", "genre_agreement", "norm_inflation", "combined")
# The spectral-rigidity diagnostics of merging.casa.casa_diagnostics reported (mean over kernels).
DIAGNOSTICS = (
    "weight_drift",
    "spectrum_drift",
    "rigidity_ratio",
    "fft_near_degenerate_mass",
    "fft_in_cluster_mass",
    "in_cluster_pairs",
    "sign_agreement_in_clusters",
    "sign_agreement_elsewhere",
    "multi_clusters",
)


def mean_std(values: Sequence[float]) -> str:
    """``"0.123 ± 0.045"``: the mean and the (population) standard deviation of ``values``."""
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def write_report(
    config: Any,
    workdir: str,
    results: Sequence[Mapping[str, Any]],
    *,
    methods: Sequence[str],
) -> dict[str, float]:
    """Writes ``results.md``, ``results.json`` and ``transfer.png``; returns the summary.

    Args:
      config: the experiment's config (``merge.rank`` goes into the notes).
      workdir: the run directory.
      results: the per-seed records, in seed order.
      methods: the transfer methods, in table order (``"casa"`` among them).

    Returns:
      ``{"<row>/<metric>": mean over seeds, "casa_beats/<method>": seeds where CASA's combined
      score is above that method's}``.
    """
    table, summary = [], {}
    for name in (*methods, "target_alone", "source_lora"):
        row = {"method": name}
        for k in METRICS:
            vals = [r["rows"][name].get(k, np.nan) for r in results]
            row[k] = mean_std(vals)
            summary[f"{name}/{k}"] = float(np.mean(vals))
        row["chosen (per seed)"] = "; ".join(
            ",".join(f"{a}={b}" for a, b in r["rows"][name].get("hparams", {}).items()) or "-"
            for r in results
        )
        table.append(row)
    wins = {
        other: sum(r["rows"]["casa"]["combined"] > r["rows"][other]["combined"] for r in results)
        for other in ("ties", "dare", "task_arithmetic", "direct", "source_revert")
    }
    diag_row = {k: mean_std([r["diagnostics"][k] for r in results]) for k in DIAGNOSTICS}
    summary.update({f"casa_beats/{k}": v for k, v in wins.items()})
    notes = (
        f"{len(results)} seed(s), mean ± std over seeds; test split. play_accuracy: the LoRA task "
        "on the target; genre_accuracy / genre_agreement: the target's own behaviour (retention) "
        "and agreement with the unmodified target; norm_inflation: mean pooled-feature norm on "
        "the play inputs over that of source + LoRA. Hyper-parameters chosen on the validation "
        f"split by `combined` = mean(play, genre accuracy); adapters of rank {config.merge.rank}. "
        f"CASA's combined score above the other method on (seeds): {wins}.\n\n"
        "## Spectral-rigidity diagnostics (mean over adapted kernels)\n\n"
        "| " + " | ".join(DIAGNOSTICS) + " |\n|" + "---|" * len(DIAGNOSTICS) + "\n| "
        + " | ".join(diag_row[k] for k in DIAGNOSTICS) + " |\n"
    )  # fmt: skip
    write_results_md(workdir, table, title="CASA: LoRA transfer to a fine-tuned MiniLM", notes=notes)  # fmt: skip
    write_json(os.path.join(workdir, "results.json"), {"summary": summary, "seeds": results})
    plot_transfer(workdir, results, methods=methods)
    return summary


def plot_transfer(
    workdir: str, results: Sequence[Mapping[str, Any]], *, methods: Sequence[str]
) -> None:
    """``transfer.png``: each method's (and ``target_alone``'s) play accuracy against its genre
    accuracy, means over seeds."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's inline backend stays

    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for name, marker in zip((*methods, "target_alone"), itertools.cycle("osD^v*Px")):
        xs = [r["rows"][name]["genre_accuracy"] for r in results]
        ys = [r["rows"][name]["play_accuracy"] for r in results]
        ax.scatter(np.mean(xs), np.mean(ys), marker=marker, s=60, label=name)
    ax.set_xlabel("genre accuracy (target's own task, retention)")
    ax.set_ylabel("play accuracy (LoRA task on the target)")
    ax.set_title("LoRA transfer to the fine-tuned target (mean over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "transfer.png"), dpi=120)
