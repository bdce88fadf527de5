"""Reporting of the KGE rank-bottleneck study (P4): trend checks, ``results.md`` and plots.

Used by ``experiments/kge.py``; ``results`` are its cell records (one dict per trained model:
``group``, ``dataset``, ``scorer``, ``kind``, ``d``, ``K``, ``params``, ``train_*``/``test_*``
metrics), ``graphs`` its graphs and ``bounds`` the Forster-type bounds of each graph
(:func:`lowrank_jax.kge.linear_output_dim_bound`).
"""

from __future__ import annotations

import math
import os
from itertools import pairwise
from typing import Any

from experiments.common import plots as plots_lib
from experiments.common import sweep as sweep_lib

__all__ = ["base_params", "d_star", "plots", "results_md", "trend_checks"]


def base_params(g, d: int) -> int:
    """Parameters of a linear-output KGE at dimension ``d``: entity and relation embeddings."""
    return (g["E"] + 2 * g["R"]) * d


def d_star(rows, threshold):
    """Smallest d with training MRR >= threshold (inf if none)."""
    ok = [r["d"] for r in rows if r["train_mrr"] >= threshold]
    return float(min(ok)) if ok else math.inf


def trend_checks(config, graphs, results, bounds) -> tuple[list[dict[str, Any]], dict]:
    """The checks of specs.md section 4 (:func:`experiments.common.sweep.check` records) and a
    summary (``synthetic_d_star``, ``gains`` of the mixture per graph, scorer and d)."""
    checks = []
    summary: dict[str, Any] = {}
    thr = config.eval.fit_mrr
    by_id = {r["id"]: r for r in results}

    def cell(group, ds, scorer, kind, d, k):
        return by_id.get(f"{group}-{ds}-{scorer}-{kind}-d{d}-K{k}")

    # (a) d* for K = 1 grows with |E| and density (synthetic), Kinships vs Nations.
    syn = [n for n, g in graphs.items() if g["synthetic"]]
    sc = config.model.synthetic_scorer
    dstar = {}
    for n in syn:
        rows = [cell("synthetic", n, sc, "softmax", d, 1) for d in config.model.dims]
        dstar[n] = d_star([r for r in rows if r], thr)
    summary["synthetic_d_star"] = dstar
    ents, dens = config.data.synthetic_entities, config.data.synthetic_densities
    # (sparser or smaller graph, denser or larger graph): neighbours in density, then in E
    pairs = [(f"syn_E{e}_p{a}", f"syn_E{e}_p{b}") for e in ents for a, b in pairwise(dens)] + [
        (f"syn_E{a}_p{p}", f"syn_E{b}_p{p}") for p in dens for a, b in pairwise(ents)
    ]
    mono = all(dstar[x] <= dstar[y] for x, y in pairs)
    strict = len(set(dstar.values())) > 1
    checks.append(
        sweep_lib.check(
            f"(a) K=1: d* (train MRR >= {thr:.2f}) non-decreasing in density and E, "
            "not constant (synthetic)",
            bool(mono and strict),
            ", ".join(f"{n}: d*={sweep_lib.format_cell(v)}" for n, v in dstar.items()),
        )
    )
    # (a'') the same at fixed d, in training MRR (less coarse than d* on a short d grid)
    ev, ok, n_pairs = [], True, 0
    for d in [d for d in config.model.dims if d >= 8]:
        mrr = {n: cell("synthetic", n, sc, "softmax", d, 1)["train_mrr"] for n in syn}
        bad = [f"{x}->{y}" for x, y in pairs if mrr[y] > mrr[x]]
        n_pairs += len(pairs)
        ok = ok and not bad
        ev.append(f"d={d}: " + (f"violations {', '.join(bad)}" if bad else "monotone"))
    if n_pairs:
        checks.append(
            sweep_lib.check(
                "(a'') K=1: at every d >= 8, training MRR falls as density or E grows (synthetic)",
                bool(ok),
                "; ".join(ev),
            )
        )
    b_ok = all(bounds[x]["sign_rank_bound"] < bounds[y]["sign_rank_bound"] for x, y in pairs)
    checks.append(
        sweep_lib.check(
            "(a') Forster necessary dimension grows with density and E (synthetic)",
            bool(b_ok),
            ", ".join(f"{n}: {bounds[n]['sign_rank_bound']:.2f}" for n in syn),
        )
    )
    if {"nations", "kinships"} <= set(config.data.datasets):
        ev, ok = [], True
        for s in config.model.scorers:
            rows_n = [cell("sweep", "nations", s, "softmax", d, 1) for d in config.model.dims]
            rows_k = [cell("sweep", "kinships", s, "softmax", d, 1) for d in config.model.dims]
            dn, dk = d_star(rows_n, thr), d_star(rows_k, thr)
            ok = ok and dk > dn
            ev.append(
                f"{s}: Nations d*={sweep_lib.format_cell(dn)}, Kinships d*={sweep_lib.format_cell(dk)}"
            )
        checks.append(
            sweep_lib.check(
                "(a) Kinships needs a larger d than Nations (K=1)", bool(ok), "; ".join(ev)
            )
        )

    # (b) at fixed small d, K >= 2 lowers train NLL and raises train MRR; overhead < 5 %;
    # (c) the gain vanishes as d grows.
    real = [n for n, g in graphs.items() if not g["synthetic"]]
    comps = [k for k in config.model.components if k > 1]
    gains = {}
    if comps:
        ev_b, ok_b, ev_o, ok_o, ev_c, ok_c = [], True, [], True, [], True
        for s in config.model.scorers:
            for n in real:
                g = graphs[n]
                per_d = {}
                for d in config.model.dims:
                    lin = cell("sweep", n, s, "softmax", d, 1)
                    mos = [cell("sweep", n, s, "mos", d, k) for k in comps]
                    best = min(mos, key=lambda r: r["train_nll"])
                    per_d[d] = {
                        "nll_gain": lin["train_nll"] - best["train_nll"],
                        "mrr_gain": best["train_mrr"] - lin["train_mrr"],
                        "best_K": best["K"],
                        "overhead": (best["params"] - lin["params"]) / lin["params"],
                    }
                gains[f"{n}/{s}"] = per_d
                for d in config.eval.small_dims:
                    gd = per_d[d]
                    ok_b = ok_b and gd["nll_gain"] > 0 and gd["mrr_gain"] > 0
                    ev_b.append(
                        f"{n}/{s} d={d}: dNLL={gd['nll_gain']:+.3f}, dMRR={gd['mrr_gain']:+.3f} (K={gd['best_K']})"
                    )
                    min_over = min(
                        (cell("sweep", n, s, "mos", d, k)["params"] - base_params(g, d))
                        / base_params(g, d)
                        for k in comps
                    )
                    ok_o = ok_o and min_over < config.eval.max_overhead
                    ev_o.append(f"{n}/{s} d={d}: {100 * min_over:.1f}%")
                d_small, d_big = min(config.eval.small_dims), max(config.model.dims)
                ok_c = ok_c and per_d[d_big]["nll_gain"] < per_d[d_small]["nll_gain"]
                ev_c.append(
                    f"{n}/{s}: dNLL d={d_small} {per_d[d_small]['nll_gain']:+.3f} -> d={d_big} {per_d[d_big]['nll_gain']:+.3f}"
                )
        checks.append(
            sweep_lib.check(
                "(b) at small d, best K>=2 lowers train NLL and raises train MRR vs K=1",
                bool(ok_b),
                "; ".join(ev_b),
            )
        )
        checks.append(
            sweep_lib.check(
                f"(b) ...with < {100 * config.eval.max_overhead:.0f}% extra parameters "
                "(smallest K>=2)",
                bool(ok_o),
                "; ".join(ev_o),
            )
        )
        dens_real = {n: bounds[n]["density"] for n in real}
        densest = max(dens_real, key=dens_real.get)
        ok_dense, ev_d = True, []
        for s in config.model.scorers:
            d_small = min(config.eval.small_dims)
            g_by = {n: gains[f"{n}/{s}"][d_small]["nll_gain"] for n in real}
            ok_dense = ok_dense and max(g_by, key=g_by.get) == densest
            ev_d.append(f"{s} d={d_small}: " + ", ".join(f"{n} {v:+.3f}" for n, v in g_by.items()))
        checks.append(
            sweep_lib.check(
                f"(b) biggest NLL gain on the densest real graph ({densest}, density {dens_real[densest]:.3f})",
                bool(ok_dense),
                "; ".join(ev_d),
            )
        )
        checks.append(
            sweep_lib.check(
                "(c) the NLL gain of the mixture shrinks from the smallest to the largest d",
                bool(ok_c),
                "; ".join(ev_c),
            )
        )
    summary["gains"] = gains
    return checks, summary


def plots(workdir, config, graphs, results, bounds) -> list[str]:
    """Writes the fit-vs-d plots per graph and scorer and the synthetic control; their paths."""
    paths = []
    by = {}
    for r in results:
        by.setdefault((r["group"], r["dataset"], r["scorer"], r["K"]), []).append(r)
    for name, g in graphs.items():
        if g["synthetic"]:
            continue
        for s in config.model.scorers:
            for metric, label in (("train_mrr", "training MRR"), ("train_nll", "training NLL")):
                curves = {}
                for k in config.model.components:
                    rows = sorted(by.get(("sweep", name, s, k), []), key=lambda r: r["d"])
                    if rows:
                        lab = "K=1 (linear)" if k == 1 else f"K={k} (MoS)"
                        curves[lab] = ([r["d"] for r in rows], [r[metric] for r in rows])
                paths.append(
                    plots_lib.plot_curves(
                        os.path.join(workdir, f"fit_{metric.split('_')[1]}_{name}_{s}.png"),
                        curves,
                        title=f"{name} {s}: {label} vs d",
                        xlabel="d",
                        ylabel=label,
                    )
                )
    syn = [n for n, g in graphs.items() if g["synthetic"]]
    if syn:
        curves = {}
        for n in syn:
            for k in config.model.synthetic_components:
                rows = sorted(
                    by.get(("synthetic", n, config.model.synthetic_scorer, k), []),
                    key=lambda r: r["d"],
                )
                curves[f"{n} K={k}"] = ([r["d"] for r in rows], [r["train_mrr"] for r in rows])
        paths.append(
            plots_lib.plot_curves(
                os.path.join(workdir, "synthetic_fit.png"),
                curves,
                title="synthetic graphs: training MRR vs d",
                xlabel="d",
                ylabel="training MRR",
            )
        )
        curves = {}
        for e in config.data.synthetic_entities:
            ns = [f"syn_E{e}_p{p}" for p in config.data.synthetic_densities]
            curves[f"|E|={e}"] = (
                [bounds[n]["density"] for n in ns],
                [bounds[n]["sign_rank_bound"] for n in ns],
            )
        paths.append(
            plots_lib.plot_curves(
                os.path.join(workdir, "synthetic_bound.png"),
                curves,
                title="Forster sign-rank bound vs density",
                xlabel="density of the query x entity matrix",
                ylabel="sign-rank lower bound",
            )
        )
    return paths


def results_md(config, graphs, results, bounds, checks) -> str:
    """The Markdown body of ``results.md``: graphs and bounds, trend checks, sweep tables."""
    cmd = "python -m experiments.train --config=configs/kge.py --workdir=runs/kge"
    parts = [
        "Training-set fit of 1-N KGEs with a linear softmax (K=1) vs a mixture of softmaxes "
        f"(K>1, projection init `{config.model.proj_init}`): full-batch Adam (lr {config.optim.learning_rate}), {config.schedule.epochs} "
        "epochs, inverse relations. `train_*` metrics are on the training triples (MRR "
        "training-filtered; `perfect` = fraction of queries whose true objects all outrank all "
        "others); `test_*` are filtered test metrics.",
        "",
        "## Graphs and the necessary dimension of a linear output layer",
        "",
        "`bound` = max of the Forster-type sign-rank lower bounds (plain / centered / "
        "row-centered); a linear-output KGE that ranks every training query perfectly needs "
        "d >= bound - 1 (`min d`).",
        "",
        sweep_lib.markdown_table(
            [{"graph": n, **bounds[n]} for n in graphs],
            [
                ("graph", "graph"),
                ("E", "entities"),
                ("R", "relations"),
                ("triples", "triples"),
                ("queries (with inverses)", "queries"),
                ("objects/query mean", "objects_per_query_mean"),
                ("max", "objects_per_query_max"),
                ("density", "density"),
                ("Forster plain", "forster_plain"),
                ("centered", "forster_centered"),
                ("row-centered", "forster_row_centered"),
                ("bound", "sign_rank_bound"),
                ("min d", "min_dim"),
            ],
        ),
        "",
        "## Trend checks (specs.md section 4)",
        "",
        sweep_lib.checks_markdown(checks),
    ]
    metric_cols = [
        ("params", "params"),
        ("extra %", "extra_pct"),
        ("train NLL", "train_nll"),
        ("train MRR", "train_mrr"),
        ("perfect", "train_perfect"),
        ("test MRR", "test_mrr"),
        ("test H@10", "test_hits@10"),
        ("test NLL", "test_nll"),
    ]
    for r in results:
        g = graphs[r["dataset"]]
        r["extra_pct"] = 100.0 * (r["params"] - base_params(g, r["d"])) / base_params(g, r["d"])
    sweep = [r for r in results if r["group"] == "sweep"]
    parts += ["", "## Summary: linear (K=1) vs best mixture (K>1) per d", ""]
    parts.append(
        "Each cell: K=1 value / best K>1 value (that K). NLL: lower is better; MRR: higher."
    )
    for metric, better in (("train_nll", min), ("train_mrr", max), ("test_mrr", max)):
        rows = []
        for ds, sc in dict.fromkeys((r["dataset"], r["scorer"]) for r in sweep):
            row = {"graph": f"{ds} / {sc}"}
            for d in config.model.dims:
                cands = [
                    r for r in sweep if r["dataset"] == ds and r["scorer"] == sc and r["d"] == d
                ]
                lin = [r for r in cands if r["K"] == 1]
                mix = [r for r in cands if r["K"] > 1]
                if lin and mix:
                    best = better(mix, key=lambda r, m=metric: r[m])
                    row[f"d={d}"] = f"{lin[0][metric]:.3f} / {best[metric]:.3f} (K={best['K']})"
            rows.append(row)
        cols = [("graph", "graph")] + [(f"d={d}", f"d={d}") for d in config.model.dims]
        parts += ["", f"**{metric}**", "", sweep_lib.markdown_table(rows, cols)]
    parts += [
        "",
        "## d x K sweep (K=1: linear softmax, K>1: mixture of softmaxes)",
        "",
        sweep_lib.markdown_table(
            sorted(sweep, key=lambda r: (r["dataset"], r["scorer"], r["d"], r["K"])),
            [("dataset", "dataset"), ("scorer", "scorer"), ("d", "d"), ("K", "K"), *metric_cols],
        ),
    ]
    first = [("dataset", "dataset"), ("scorer", "scorer")]
    base_rows = [r for r in results if r["group"] == "baseline"]
    base_rows += [
        r
        for r in sweep
        if r["d"] == config.model.baseline_dim and r["K"] in (1, config.model.baseline_components)
    ]
    parts += [
        "",
        f"## Baselines at d = {config.model.baseline_dim} (K = {config.model.baseline_components})",
        "",
        "`softmax`: linear; `mos`: mixture of softmaxes; `sigmoid`: linear 1-vs-all (BCE), NLL "
        "of softmax(logits); `mos1`: K=1 with the tanh projection (non-linearity, no mixture); "
        "`mol`: mixture of logits (still rank <= d); `matched`: linear softmax at the larger d "
        "with the parameter count of MoS; `ensemble`: mean of the probabilities of K "
        "independently trained linear models (K times the parameters).",
        "",
        sweep_lib.markdown_table(
            sorted(base_rows, key=lambda r: (r["dataset"], r["scorer"], r["kind"], r["K"])),
            [*first, ("model", "kind"), ("d", "d"), ("K", "K"), *metric_cols],
        ),
    ]
    syn = [r for r in results if r["group"] == "synthetic"]
    if syn:
        ks = config.model.synthetic_components
        rows = []
        for name in dict.fromkeys(r["dataset"] for r in syn):
            row = {
                "graph": name,
                "density": bounds[name]["density"],
                "bound": bounds[name]["sign_rank_bound"],
            }
            for d in config.model.dims:
                vals = []
                for k in ks:
                    hit = [r for r in syn if r["dataset"] == name and r["d"] == d and r["K"] == k]
                    vals.append(f"{hit[0]['train_mrr']:.3f}" if hit else "")
                row[f"d={d}"] = " / ".join(vals)
            for k in ks:
                row[f"d* K={k}"] = d_star(
                    [r for r in syn if r["dataset"] == name and r["K"] == k], config.eval.fit_mrr
                )
            rows.append(row)
        cols = [("graph", "graph"), ("density", "density"), ("bound", "bound")]
        cols += [(f"d={d}", f"d={d}") for d in config.model.dims]
        cols += [(f"d* K={k}", f"d* K={k}") for k in ks]
        parts += [
            "",
            "## Synthetic control: training MRR per d (K = "
            + " / ".join(str(k) for k in ks)
            + f"), d* = smallest d with training MRR >= {config.eval.fit_mrr}",
            "",
            sweep_lib.markdown_table(rows, cols),
        ]
        parts += [
            "",
            f"## Synthetic control ({config.model.synthetic_scorer}, random graphs, "
            f"{config.data.synthetic_relations} relations)",
            "",
            sweep_lib.markdown_table(
                sorted(syn, key=lambda r: (r["dataset"], r["K"], r["d"])),
                [("graph", "dataset"), ("d", "d"), ("K", "K"), *metric_cols[:5]],
            ),
        ]
    parts += ["", f"Command: `{cmd}` (smoke: `--config=configs/kge.py:smoke`)."]
    return "\n".join(parts)
