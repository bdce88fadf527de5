"""The P9 experiment's reporting: cell summaries, the fixed-width control's verdict, the result
rows, plots and trend checks of :mod:`experiments.multitask_limits`."""

from __future__ import annotations

import os

import numpy as np

from experiments import common
from experiments.common import sweep
from lowrank_jax import analysis

EST = analysis.ESTIMATORS
ADAPTIVE = ("target_only", "pooled", "agreement", "validation_prefix", "inverse_variance", "lepski")


def summarise(excess: np.ndarray) -> dict:
    """``excess``: ``(members, draws, E)`` -> means, ratios to the oracle, worst-case ratios."""
    mean = excess.mean(1)  # (members, E)
    ratio = mean / mean[:, EST.index("oracle")][:, None]
    return {
        "mean": mean.tolist(),
        "sem": (excess.std(1) / np.sqrt(excess.shape[1])).tolist(),
        "ratio": ratio.tolist(),
        "worst_ratio": dict(zip(EST, ratio.max(0).tolist(), strict=True)),
    }


def control_verdict(diff: float, spread: float) -> str:
    """The fixed-width check's word for a mean per-seed change ``diff`` of the ratio (larger n
    minus smaller n) with sd ``spread``: ``"shrinks"`` or ``"does not shrink"`` only beyond the
    seeds' spread, else ``"tie"`` (the registry's rule; a single seed has no spread: a tie)."""
    if spread <= 0 or abs(diff) <= spread:
        return "tie"
    return "shrinks" if diff < 0 else "does not shrink"


def rows_and_plots(workdir, cells, part, tasks, ns):
    rows = []
    for n in ns:
        curves = {}
        for e in ADAPTIVE:
            curves[e] = (list(tasks), [cells[(nt, n)]["worst_ratio"][e] for nt in tasks])
        common.plot_curves(
            os.path.join(workdir, f"{part}_worst_ratio_n{n}.png"),
            curves,
            title=f"{part}: worst-case mean excess risk / oracle's (n={n})",
            xlabel="N (source tasks)",
            ylabel="ratio to oracle",
            logy=True,
            hline=1.0,
        )
        for nt in tasks:
            cell = cells[(nt, n)]
            oracle = [row[EST.index("oracle")] for row in cell["mean"]]
            rows.append(
                {
                    "part": part,
                    "N": nt,
                    "n": n,
                    "oracle_excess(k=N)": oracle[cell["members"].index(f"k={nt},c=1.0")],
                    **{f"worst/{e}": cell["worst_ratio"][e] for e in ADAPTIVE},
                }
            )
    return rows


def checks(cells, tasks, ns, part):
    lo, hi = tasks[0], tasks[-1]
    falls = all(
        cells[(hi, n)]["mean"][cells[(hi, n)]["members"].index(f"k={hi},c=1.0")][2]
        < cells[(lo, n)]["mean"][cells[(lo, n)]["members"].index(f"k={lo},c=1.0")][2]
        for n in ns
    )
    adaptive = [e for e in ADAPTIVE]
    grows = {
        e: all(cells[(hi, n)]["worst_ratio"][e] > cells[(lo, n)]["worst_ratio"][e] for n in ns)
        for e in adaptive
    }
    best = {n: min(cells[(hi, n)]["worst_ratio"][e] for e in adaptive) for n in ns}
    return [
        sweep.check(f"{part}: oracle excess risk (k=N) falls from N={lo} to N={hi}", falls),
        sweep.check(
            f"{part}: worst-case ratio grows from N={lo} to N={hi} for every method (each n)",
            all(grows.values()),
            ", ".join(f"{e}: {'yes' if v else 'no'}" for e, v in grows.items()),
        ),
        sweep.check(
            f"{part}: best worst-case ratio at N={hi} does not shrink from n={ns[0]} to n={ns[-1]} "
            "(n-scaled decoys: by construction, not counted)",
            best[ns[-1]] >= 0.8 * best[ns[0]],
            ", ".join(f"n={n}: {v:.2f}" for n, v in best.items()),
        ),
    ]


def write_fixed_width(config, workdir: str, cells: dict) -> tuple[list[dict], list[dict]]:
    """``fixed_width.md`` of the fixed-width control from its cells ``{(seed, N, n): cell}``: each
    method's worst-case ratio to the oracle as mean ± sd over the seeds, and one check per pair of
    ``control.compare`` on the best adaptive method's ratio at the largest N; ``(rows, checks)``."""
    ctl = config.control

    def best(cell):  # the best adaptive method's worst-case ratio
        return min(cell["worst_ratio"][e] for e in ADAPTIVE)

    rows = []
    for n in ctl.ns:
        for nt in ctl.num_tasks:
            per_seed = [cells[(s, nt, n)] for s in ctl.seeds]
            member = per_seed[0]["members"].index(f"k={nt},w={ctl.widths[0]}")
            rows.append({
                "N": nt, "n": n,
                "oracle excess (k=N)": sweep.format_mean_sd(
                    [c["mean"][member][EST.index("oracle")] for c in per_seed], 5),
                "best adaptive": sweep.format_mean_sd([best(c) for c in per_seed], 2),
                **{e: sweep.format_mean_sd([c["worst_ratio"][e] for c in per_seed], 2)
                   for e in ADAPTIVE},
            })  # fmt: skip
    hi, checks = ctl.num_tasks[-1], []
    for lo_n, hi_n in ctl.compare:
        first = [best(cells[(s, hi, lo_n)]) for s in ctl.seeds]
        last = [best(cells[(s, hi, hi_n)]) for s in ctl.seeds]
        diff, spread = sweep.mean_sd(np.subtract(last, first))
        verdict = control_verdict(diff, spread)
        checks.append(sweep.check(
            f"fixed_width: best worst-case ratio at N={hi} from n={lo_n} to n={hi_n} "
            f"(measured; decoy widths {tuple(ctl.widths)} fixed)",
            verdict,
            f"n={lo_n}: {sweep.format_mean_sd(first, 2)}, n={hi_n}: "
            f"{sweep.format_mean_sd(last, 2)}, per-seed difference "
            f"{diff:+.2f} ± {spread:.2f} over {len(ctl.seeds)} seeds",
        ))  # fmt: skip
    columns = ["N", "n", "oracle excess (k=N)", "best adaptive", *ADAPTIVE]
    common.write_results_md(
        workdir, rows, columns=columns, filename="fixed_width.md",
        title="P9 fixed-width control: worst-case ratio of mean excess risk to the oracle's",
        notes=f"Decoy half-widths w ∈ {tuple(ctl.widths)}, the same at every n (not rescaled), "
        f"k ∈ {tuple(ctl.good)} good sources, β = {config.data.beta}, {ctl.num_draws} draws per "
        f"family member; mean ± sd over seeds {tuple(ctl.seeds)}; 'best adaptive' is each seed's "
        "smallest worst-case ratio over the adaptive methods.\n\n" + sweep.checks_markdown(checks),
    )  # fmt: skip
    return rows, checks
