"""Reporting of the P16 TFFT study: the table, the trend checks of specs.md §16, plots and
``results.md``.

Used by ``experiments/tfft.py``. ``cells`` maps ``"<source>/seed=<s>/<method>"`` to a cell record:
``mean``, ``cvar_left``, ``cvar_right``, ``seconds``, ``cpu_seconds``, ``rewards`` (the first
2,000 evaluation rewards) and, where they apply, ``alpha``, ``eta``, ``target_kl``, ``model_kl``
(the learned model's measured KL from the pre-trained flow) with ``model_kl_se`` and (ring)
``hist_kl`` and ``samples`` (the first 1,000 evaluation samples, ``(1000, 2)``). With
``tfft.alpha_grid``, the same methods at further multiples of their ``α`` are cells under
``"<source>/seed=<s>/<method>/alpha_x<multiple>"`` (:func:`cell_key`), and :func:`matched_kl`
compares the methods at budgets of measured KL (``frontier.md``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from experiments.common import metrics as metrics_lib
from experiments.common import sweep

__all__ = [
    "cell_key",
    "checks",
    "frontier_plots",
    "matched_kl",
    "method_runs",
    "multiples",
    "plots",
    "table",
    "write_results",
]

OBJECTIVES = (("cvar_left", "tfft_left"), ("cvar_right", "tfft_right"), ("mean", "expected"))


def multiples(config) -> list[float]:
    """The α multiples every fine-tuned method runs at: 1 and those of ``tfft.alpha_grid``."""
    return sorted({1.0, *config.tfft.alpha_grid})


def method_runs(config) -> list[tuple[str, float]]:
    """``(method, α multiple)`` of every cell of a seed: each method at 1, then the fine-tuned
    ones at the other multiples."""
    others = [g for g in multiples(config) if g != 1.0]
    return [(m, 1.0) for m in config.methods] + [
        (m, g) for g in others for m in config.methods if m != "pretrained"
    ]


def cell_key(source: str, seed: int, method: str, multiple: float = 1.0) -> str:
    """The cell of ``method`` at ``multiple`` × its ``α`` (the plain key at 1)."""
    key = f"{source}/seed={seed}/{method}"
    return key if multiple == 1.0 else f"{key}/alpha_x{multiple:g}"


def matched_kl(config, cells) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows and checks of the comparison at matched measured KL.

    For each budget ``b`` of ``eval.kl_budgets`` and each seed, a method is represented by its run
    (over ``1`` and ``tfft.alpha_grid``) with the largest measured KL ``≤ b``: the choice reads
    the learned models' KL, never a reward, so it is the same for every objective. A row holds the
    mean ± sd over the seeds where such a run exists (``seeds`` counts them) of its measured KL,
    α multiple and metrics; the checks ask, per budget, whether each TFFT variant (and expected
    fine-tuning for the mean) is the best on its objective on the seed mean and on how many seeds.
    """
    rows, found = [], []
    grid = multiples(config)
    tuned = [m for m in config.methods if m != "pretrained"]
    for src in config.sources:
        for budget in config.eval.kl_budgets:
            chosen = {}  # method -> seed -> cell
            for m in tuned:
                for s in config.seeds:
                    runs = [{**cells[cell_key(src, s, m, g)], "alpha_multiple": g} for g in grid]
                    within = [c for c in runs if c["model_kl"] <= budget]
                    if within:
                        best = max(within, key=lambda c: c["model_kl"])
                        chosen.setdefault(m, {})[s] = best
            for m in tuned:
                got = list(chosen.get(m, {}).values())
                row = {"source": src, "kl_budget": budget, "method": m, "seeds": len(got)}
                for col in ("model_kl", "alpha_multiple", "mean", "cvar_left", "cvar_right"):
                    row[col] = sweep.format_mean_sd([c[col] for c in got]) if got else "–"
                rows.append(row)
            # the methods with a run within the budget on every seed are compared
            present = [m for m in tuned if len(chosen.get(m, {})) == len(config.seeds)]
            for col, want in OBJECTIVES:
                if want not in present or len(present) < 2:
                    continue
                seeds = config.seeds
                wins = [max(present, key=lambda m, s=s: chosen[m][s][col]) == want for s in seeds]
                means = {m: np.mean([chosen[m][s][col] for s in seeds]) for m in present}
                top = max(means, key=means.get)
                found.append(sweep.check(
                    f"{src}, measured KL <= {budget}: {want} has the best {col}",
                    top == want,
                    f"best on the mean of {len(seeds)} seeds: {top}; {want} best on "
                    f"{sum(wins)}/{len(seeds)} seeds (among {', '.join(present)})",
                ))  # fmt: skip
    return rows, found


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

        for col, want in OBJECTIVES:
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


def frontier_plots(config, workdir, cells) -> list[str]:
    """``kl_frontier_<source>.png``: each objective against the measured KL, one point per
    (method, α multiple, seed); returns their paths."""
    from experiments.common.plots import subplots

    paths = []
    grid = multiples(config)
    for src in config.sources:
        fig, axes = subplots(1, len(OBJECTIVES), figsize=(4.2 * len(OBJECTIVES), 3.6))
        for ax, (col, _) in zip(axes, OBJECTIVES, strict=True):
            for m in config.methods:
                if m == "pretrained":
                    continue
                got = [cells[cell_key(src, s, m, g)] for s in config.seeds for g in grid]
                ax.scatter([c["model_kl"] for c in got], [c[col] for c in got], s=14, label=m)
            for b in config.eval.kl_budgets:
                ax.axvline(b, color="0.8", lw=0.8, zorder=0)
            ax.set(xscale="log", xlabel="measured KL of the model (nats)", title=col)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{src}: objectives against measured KL (α × {grid}, all seeds)", y=1.04)
        paths.append(os.path.join(workdir, f"kl_frontier_{src}.png"))
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths


def write_results(config, workdir, cells) -> dict[str, Any]:
    """The table, checks and plots of ``cells``, written as ``results.md`` and ``summary.json``
    (:func:`sweep.write_sweep_results`); returns the run's metrics."""
    rows = table(config, cells)
    found = checks(config, rows)
    paths = plots(config, workdir, cells)
    cmd = sweep.command_line("python -m experiments.train --config=configs/tfft.py")
    if config.tfft.alpha_grid:
        matched, matched_checks = matched_kl(config, cells)
        found += matched_checks
        metrics_lib.write_results_md(
            workdir, matched, filename="frontier.md",
            title="P16 TFFT at matched measured KL (the run with the largest measured KL within "
                  "each budget, over the alpha multiples)",
            notes=f"Command: `{cmd}`\n\n" + sweep.checks_markdown(matched_checks),
        )  # fmt: skip
        paths += frontier_plots(config, workdir, cells)
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
