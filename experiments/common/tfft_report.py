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

A comparison counts (``reproduced`` True or False) only beyond the seeds' spread: the method the
paper favours against its best rival by the mean of their paired per-seed differences, against
the differences' standard deviation (:func:`compare`); inside it the check reads ``"tie ..."``. A
comparison on a saturated scale (the compared methods' seed means of the objective within
``eval.saturation`` × the pre-trained model's reward sd) reads ``"saturated scale ..."``, and the
cost check, which holds by construction (TFFT is one fine-tune plus a 1-D bisection, the
iterative baseline K of them), ``"by construction ..."``: none of the three is counted.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from experiments.common import config_checks, sweep
from experiments.common import metrics as metrics_lib

__all__ = [
    "alpha_grid",
    "cell_key",
    "check_config",
    "checks",
    "compare",
    "frontier_plots",
    "matched_kl",
    "method_runs",
    "multiples",
    "plots",
    "table",
    "write_results",
]

OBJECTIVES = (("cvar_left", "tfft_left"), ("cvar_right", "tfft_right"), ("mean", "expected"))


def check_config(config, sources: tuple[str, ...]) -> None:
    """Validates the keys of the comparisons: ``tfft.alpha_grid``, ``tfft.alpha_grid_by_source``
    (keys among ``sources``), ``eval.kl_budgets`` and ``eval.saturation``.

    Raises:
      experiments.common.ConfigError: naming the first bad key.
    """
    c = config_checks
    grids = {"tfft.alpha_grid": c.get_path(config, "tfft.alpha_grid")}
    by_source = config.tfft.get("alpha_grid_by_source", {})
    grids.update({f"tfft.alpha_grid_by_source.{s}": g for s, g in by_source.items()})
    for key, grid in grids.items():
        if not all(0 < g < math.inf for g in grid):
            raise c.ConfigError(
                f"config.{key}={tuple(grid)} is invalid: positive multiples of alpha "
                "(empty: no KL frontier)"
            )
    if set(by_source) - set(sources):
        raise c.ConfigError(
            f"config.tfft.alpha_grid_by_source has {sorted(set(by_source) - set(sources))}: "
            f"sources are {sources}"
        )
    c.check_nonnegative(config, "eval.saturation")
    budgets = c.get_path(config, "eval.kl_budgets")
    if not budgets or not all(0 < b < math.inf for b in budgets):
        raise c.ConfigError(
            f"config.eval.kl_budgets={tuple(budgets)} is invalid: a non-empty tuple of positive "
            "nats"
        )


def alpha_grid(config, source: str) -> tuple[float, ...]:
    """The further α multiples of ``source``: ``tfft.alpha_grid_by_source[source]`` where set,
    else ``tfft.alpha_grid``."""
    return tuple(config.tfft.get("alpha_grid_by_source", {}).get(source, config.tfft.alpha_grid))


def multiples(config, source: str) -> list[float]:
    """The α multiples every fine-tuned method runs at on ``source``: 1 and :func:`alpha_grid`."""
    return sorted({1.0, *alpha_grid(config, source)})


def method_runs(config, source: str) -> list[tuple[str, float]]:
    """``(method, α multiple)`` of every cell of a seed of ``source``: each method at 1, then the
    fine-tuned ones at the other multiples."""
    others = [g for g in multiples(config, source) if g != 1.0]
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
    tuned = [m for m in config.methods if m != "pretrained"]
    for src in [s for s in config.sources if alpha_grid(config, s)]:
        grid, scale = multiples(config, src), _reward_scale(config, cells, src)
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
                values = {m: [chosen[m][s][col] for s in config.seeds] for m in present}
                verdict, evidence = compare(values, want, config.eval.saturation * scale)
                found.append(sweep.check(
                    f"{src}, measured KL <= {budget}: {want} has the best {col}", verdict,
                    f"{evidence} (among {', '.join(present)})",
                ))  # fmt: skip
    return rows, found


def _reward_scale(config, cells, src: str) -> float:
    """The pre-trained model's reward sd on ``src`` (mean over seeds; NaN without its cells)."""
    got = [cells.get(cell_key(src, s, "pretrained")) for s in config.seeds]
    return float(np.mean([np.std(c["rewards"]) for c in got])) if all(got) else float("nan")


def compare(values: dict[str, list[float]], want: str, saturated_below: float = 0.0):
    """Whether ``want`` has the largest objective among ``values`` (method -> per-seed values,
    larger is better), beyond the seeds' spread.

    ``want`` is set against the rival with the best seed mean: with the paired per-seed
    differences ``d`` (``want`` minus rival), True when ``mean(d) > sd(d)``, False when
    ``mean(d) < -sd(d)``, else ``"tie (within the seeds' spread, not counted)"``; with one seed
    (no spread) ``"one seed (not counted)"``. When the methods' seed means lie within
    ``saturated_below`` of each other, ``"saturated scale (not counted)"``.

    Returns:
      ``(verdict, evidence)``: the verdict and a sentence with the numbers.
    """
    means = {m: float(np.mean(v)) for m, v in values.items()}
    top = max(means, key=means.get)
    seeds = len(values[want])
    wins = sum(max(values, key=lambda m, s=s: values[m][s]) == want for s in range(seeds))
    rival = max((m for m in means if m != want), key=means.get)
    d = np.asarray(values[want]) - np.asarray(values[rival])
    spread = float(np.std(d, ddof=1)) if seeds > 1 else float("nan")
    evidence = (
        f"best on the mean of {seeds} seeds: {top}; {want} best on {wins}/{seeds} seeds; "
        f"{want} - {rival}: {d.mean():+.4g} (sd {spread:.2g} over seeds)"
    )
    if max(means.values()) - min(means.values()) < saturated_below:
        return "saturated scale (not counted)", evidence + f"; methods within {saturated_below:.2g}"
    if seeds < 2:
        return "one seed (not counted)", evidence
    if abs(d.mean()) <= spread:
        return "tie (within the seeds' spread, not counted)", evidence
    return bool(d.mean() > 0), evidence


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


def checks(config, rows, cells) -> list[dict[str, Any]]:
    """Per source: each method wins its own objective among the fine-tuned methods
    (:func:`compare`), and TFFT's CPU time is about expected fine-tuning's and 1/K of the
    iterative baseline's (by construction, not counted)."""
    out = []
    for src in config.sources:
        tuned = {r["method"]: r for r in rows if r["source"] == src and r["method"] != "pretrained"}
        scale = _reward_scale(config, cells, src)
        for col, want in OBJECTIVES:
            if want in tuned and len(tuned) > 1:
                values = {m: [cells[cell_key(src, s, m)][col] for s in config.seeds] for m in tuned}
                verdict, evidence = compare(values, want, config.eval.saturation * scale)
                out.append(sweep.check(
                    f"{src}: {want} has the best {col} among the fine-tuned methods", verdict,
                    evidence,
                ))  # fmt: skip
        if {"tfft_right", "expected", "iterative_right"} <= set(tuned):
            t, e, i = (
                tuned[m]["_cpu_seconds"] for m in ("tfft_right", "expected", "iterative_right")
            )
            k = config.tfft.rounds
            held = 0.5 <= t / e <= 2 and i / t >= k / 2
            out.append(sweep.check(
                f"{src}: TFFT costs about expected fine-tuning (0.5-2x CPU time) and about 1/K of "
                f"the iterative baseline (iterative/TFFT >= K/2 = {k / 2})",
                f"by construction (not counted; {'holds' if held else 'does not hold'})",
                f"TFFT/expected {t / e:.2f}, iterative/TFFT {i / t:.2f}",
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
    for src in [s for s in config.sources if alpha_grid(config, s)]:
        grid = multiples(config, src)
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
    found = checks(config, rows, cells)
    paths = plots(config, workdir, cells)
    cmd = sweep.command_line("python -m experiments.train --config=configs/tfft.py")
    if any(alpha_grid(config, s) for s in config.sources):
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
