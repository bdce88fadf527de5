"""Reporting of the P11 GIST study: the table (step count picked on validation), the trend checks
of specs.md §11, the off-diagonal diagnostic, the spectrum plot and ``results.md``.

Used by ``experiments/gist.py``. ``res`` maps a method (``gist_k<k>`` per GIST ``k``) to its
fine-tune cells over seeds, each with ``at`` (``{"<steps>": {"test_loss", ("test_accuracy"),
"valid_loss"}}``), ``target_share``, ``distractor_share``, ``time_s`` and ``bytes`` (of the
selection); ``sels`` holds each seed's selection record (``spectrum``, ``num_params``,
``less_paper_bytes`` and ``offdiag``: ``{"val"|"pool": lora_vs_full_offdiag's ratios}``).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.common import sweep
from experiments.common.plots import plot_curves

__all__ = ["checks", "offdiag_checks", "offdiag_means", "table", "write_results"]

_COMMAND = "python -m experiments.train --config=configs/gist.py"
_OFFDIAG_KEYS = ("lora", "full", "full_adapted", "lora_null", "full_null", "full_adapted_null")


def table(res: dict[str, list], metric: str) -> list[dict[str, Any]]:
    """One row per method at the step count with the lowest mean validation loss: ``metric``
    as ``"mean ± sd"`` and its plain ``mean`` and standard error ``se`` (for :func:`checks`)."""
    rows = []
    for name, cells in res.items():  # the step count is picked on the validation loss
        stop = min(cells[0]["at"], key=lambda t: np.mean([r["at"][t]["valid_loss"] for r in cells]))
        vals = [r["at"][stop][metric] for r in cells]
        mean, sd = sweep.mean_sd(vals)
        rows.append({"method": name, metric: sweep.format_mean_sd(vals, 4),
                     "mean": mean, "se": sd / np.sqrt(len(vals)), "steps": int(stop),
                     "valid loss": sweep.format_mean_sd([r["at"][stop]["valid_loss"] for r in cells], 4),
                     "target share": float(np.mean([r["target_share"] for r in cells])),
                     "distractor share": float(np.mean([r["distractor_share"] for r in cells])),
                     "bytes/example": cells[0]["bytes"],
                     "selection s": float(np.mean([r["time_s"] for r in cells]))})  # fmt: skip
    return rows


def checks(rows, sel, *, higher_better: bool) -> list[dict[str, Any]]:
    """GIST ≥ LESS within one SE, with ≤ 1% of LESS's storage and less selection time, both
    against LESS as run (the ``d`` of the quality comparison, not the paper's d = 8192:
    ``sel["less_paper_bytes"]`` is reported apart); GIST k = 9 and LESS more than 2 SE above
    random. ``sel``: the first seed's selection."""
    by = {r["method"]: r for r in rows}
    sign = 1.0 if higher_better else -1.0
    out = []
    less = by.get("less")
    for name in [m for m in by if m.startswith("gist_k")]:
        g = by[name]
        if less:
            se = float(np.hypot(g["se"], less["se"]))
            out.append(sweep.check(f"{name} ≥ LESS within 1 SE", sign * (g["mean"] - less["mean"]) >= -se,
                                   f"{g['mean']:.4f} vs {less['mean']:.4f} (SE {se:.4f})"))  # fmt: skip
            ratio = g["bytes/example"] / less["bytes/example"]
            out.append(sweep.check(f"{name} storage ≤ 1% of LESS as run (by construction)",
                                   ratio <= 0.01, f"{g['bytes/example']} B vs "
                                   f"{less['bytes/example']} B, ratio {ratio:.5f}"))  # fmt: skip
            out.append(sweep.check(f"{name} faster than LESS", g["selection s"] < less["selection s"],
                                   f"{g['selection s']:.1f}s vs {less['selection s']:.1f}s"))  # fmt: skip
    rnd = by.get("random")
    for name in [m for m in by if m.startswith("gist_k9") or m == "less"]:
        if rnd:
            se = float(np.hypot(by[name]["se"], rnd["se"]))
            gap = sign * (by[name]["mean"] - rnd["mean"])
            out.append(sweep.check(f"{name} clearly above random (> 2 SE)", gap > 2 * se,
                                   f"gap {gap:.4f}, SE {se:.4f}"))  # fmt: skip
    return out


def offdiag_means(sels: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``offdiag_<split>_<key>``: the diagnostic's ratios (and permutation nulls) averaged over
    seeds, on the validation set and the pool sample."""
    return {f"offdiag_{split}_{k}": float(np.mean([x["offdiag"][split][k] for x in sels]))
            for split in ("val", "pool") for k in _OFFDIAG_KEYS}  # fmt: skip


def offdiag_checks(offdiag: dict[str, float]) -> list[dict[str, Any]]:
    """Specs §11 (4a): LoRA gradients further from diagonal than random full-parameter ones, per
    split, as the ratio ρ and as ρ over its permutation null."""
    out = []
    for split, null in itertools.product(("val", "pool"), (False, True)):  # ρ, or ρ / its null
        r = {k: offdiag[f"offdiag_{split}_{k}"] / (offdiag[f"offdiag_{split}_{k}_null"] if null else 1)
             for k in ("lora", "full", "full_adapted")}  # fmt: skip
        out.append(sweep.check(f"LoRA gradients further from diagonal than random full-parameter"
                               f" ones ({split}{', ρ / permutation null' if null else ''})",
                               r["lora"] > r["full"], ", ".join(f"{k} {v:.2f}" for k, v in r.items())))  # fmt: skip
    return out


def write_results(config, workdir, res, sels, base) -> dict[str, Any]:
    """The table, checks, diagnostic and ``spectrum.png`` (cumulative energy of each seed's
    validation-gradient spectrum), written as ``results.md`` and ``summary.json``
    (:func:`sweep.write_sweep_results`); ``base``: the base model's test metrics. Returns the
    run's metrics."""
    text = config.data.name == "shakespeare"
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    metric = "test_accuracy" if not text else "test_loss"
    rows = table(res, metric)
    found = checks(rows, sels[0], higher_better=not text)
    offdiag = offdiag_means(sels)
    found += offdiag_checks(offdiag)
    spec = np.asarray(sels[0]["spectrum"]) ** 2
    curves = {f"seed {s}": (list(range(1, len(x["spectrum"]) + 1)),
                            list(np.cumsum(np.square(x["spectrum"])) / np.sum(np.square(x["spectrum"]))))
              for s, x in zip(seeds, sels, strict=True)}  # fmt: skip
    plot_curves(os.path.join(workdir, "spectrum.png"), curves, xlabel="k",
                ylabel="energy share of top-k", title="validation-gradient spectrum")  # fmt: skip
    title = f"GIST vs LESS on {'Shakespeare (target: Histories)' if text else 'the synthetic pool'}"
    return sweep.write_sweep_results(
        workdir, rows, found, title=title,
        columns=["method", metric, "steps", "valid loss", "target share", "distractor share",
                 "bytes/example", "selection s"],
        command=sweep.command_line(_COMMAND),
        extra={"base_" + metric.split("_")[1]: base.get(metric.split("_")[1]),
               "num_lora_params": sels[0]["num_params"], "seeds": len(seeds),
               "top9_energy": float(spec[:9].sum() / spec.sum()),
               "less_d8192_bytes": sels[0]["less_paper_bytes"], **offdiag},
    )  # fmt: skip
