"""Reporting of the P16 TFFT study: the table, the trend checks of specs.md §16, plots and
``results.md``.

Used by ``experiments/tfft.py``. ``cells`` maps ``"<source>/seed=<s>/<method>"`` to a cell record:
``mean``, ``cvar_left``, ``cvar_right``, ``seconds``, ``cpu_seconds``, ``rewards`` (the first
2,000 evaluation rewards) and, where they apply, ``alpha``, ``eta``, ``target_kl``, ``model_kl``
(the learned model's measured KL from the pre-trained flow) with ``model_kl_se`` and (ring)
``hist_kl`` and ``samples`` (the first 1,000 evaluation samples, ``(1000, 2)``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from experiments.common import sweep

__all__ = ["checks", "plots", "table", "write_results"]


def table(config, cells) -> list[dict[str, Any]]:
    """One row per (source, method): mean ± sd over seeds of every column, and the plain mean of
    each under ``"_<column>"`` (NaN when no cell has it) for :func:`checks`."""
    rows = []
    for src in config.sources:
        for m in config.methods:
            got = [cells[f"{src}/seed={s}/{m}"] for s in config.seeds]
            row = {"source": src, "method": m}
            cols = (
                "mean",
                "cvar_left",
                "cvar_right",
                "target_kl",
                "model_kl",
                "hist_kl",
                "seconds",
                "cpu_seconds",
            )
            for col in cols:
                vals = [g[col] for g in got if col in g]
                row[col] = sweep.format_mean_sd(vals) if vals else "–"
                row[f"_{col}"] = float(np.mean(vals)) if vals else float("nan")
            rows.append(row)
    return rows


def checks(config, rows) -> list[dict[str, Any]]:
    """Per source: each method wins its own objective among the fine-tuned methods, and TFFT's
    CPU time is about expected fine-tuning's and 1/K of the iterative baseline's."""
    out = []
    for src in config.sources:
        tuned = {r["method"]: r for r in rows if r["source"] == src and r["method"] != "pretrained"}

        def best(col, tuned=tuned):
            return max(tuned, key=lambda name: tuned[name][f"_{col}"])

        for col, want in (("cvar_left", "tfft_left"), ("cvar_right", "tfft_right"),
                          ("mean", "expected")):  # fmt: skip
            if want in tuned:
                got = best(col)
                out.append(sweep.check(
                    f"{src}: {want} has the best {col} among the fine-tuned methods",
                    got == want, f"best is {got} ({tuned[got][col]})",
                ))  # fmt: skip
        if {"tfft_right", "expected", "iterative_right"} <= set(tuned):
            t, e, i = (
                tuned[m]["_cpu_seconds"] for m in ("tfft_right", "expected", "iterative_right")
            )
            k = config.tfft.rounds
            out.append(sweep.check(
                f"{src}: TFFT costs about expected fine-tuning (0.5-2x CPU time) and about 1/K of "
                f"the iterative baseline (iterative/TFFT >= K/2 = {k / 2})",
                0.5 <= t / e <= 2 and i / t >= k / 2, f"TFFT/expected {t / e:.2f}, iterative/TFFT {i / t:.2f}",
            ))  # fmt: skip
    return out


def plots(config, workdir, cells) -> list[str]:
    """``rewards_<source>.png`` (reward histograms per method, first seed) and, with the ring,
    ``ring_samples.png``; returns their paths."""
    from experiments.common.plots import subplots

    paths = []
    seed = config.seeds[0]
    for src in config.sources:
        fig, ax = subplots(figsize=(7, 4))
        for m in config.methods:
            r = cells[f"{src}/seed={seed}/{m}"]["rewards"]
            ax.hist(r, bins=60, histtype="step", density=True, label=m)
        ax.set(xlabel="reward", ylabel="density", title=f"{src}: rewards after fine-tuning")
        ax.legend()
        paths.append(os.path.join(workdir, f"rewards_{src}.png"))
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    if "ring" in config.sources:
        fig, axes = subplots(1, len(config.methods), figsize=(3 * len(config.methods), 3))
        for ax, m in zip(np.atleast_1d(axes), config.methods, strict=True):
            x = np.asarray(cells[f"ring/seed={seed}/{m}"]["samples"])
            ax.scatter(x[:, 0], x[:, 1], s=2, alpha=0.4)
            ax.set(title=m, xlim=(-6, 6), ylim=(-6, 6), aspect="equal")
        paths.append(os.path.join(workdir, "ring_samples.png"))
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths


def write_results(config, workdir, cells) -> dict[str, Any]:
    """The table, checks and plots of ``cells``, written as ``results.md`` and ``summary.json``
    (:func:`sweep.write_sweep_results`); returns the run's metrics."""
    rows = table(config, cells)
    found = checks(config, rows)
    paths = plots(config, workdir, cells)
    cmd = sweep.command_line("python -m experiments.train --config=configs/tfft.py")
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    return sweep.write_sweep_results(
        workdir,
        public,
        found,
        title="P16 TFFT: tail-aware flow fine-tuning at matched KL",
        columns=[
            "source",
            "method",
            "mean",
            "cvar_left",
            "cvar_right",
            "target_kl",
            "model_kl",
            "hist_kl",
            "seconds",
            "cpu_seconds",
        ],  # fmt: skip
        command=cmd,
        extra={"plots": ", ".join(os.path.basename(p) for p in paths)},
    )
