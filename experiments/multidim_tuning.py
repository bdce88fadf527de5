"""P12: learning p tied regularisation weights from N instances; gap and excess risk against N.

For each instance family (``config.data.parts``), each repetition draws ``max(ns)`` training
instances; for each N the tuners see the first N. Tuners (``lowrank_jax.tuning``), all with
``config.tune.budget`` candidate evaluations: ``grid`` (p = 1, :func:`tuning.log_grid`),
``rs`` (p > 1, :func:`tuning.sample_log_uniform` + :func:`tuning.coordinate_refine`, i.e.
:func:`tuning.tune_random_refine` with the random stage's losses computed once on all instances
and averaged over each prefix) and ``tpe`` (:func:`tuning.tune_tpe`). The true risk ``R`` of a
chosen α̂ is its mean validation loss on ``num_test`` fresh instances (one fixed set per family);
the generalisation gap is ``R(α̂) − R̂_N(α̂)``; the excess risk is ``R(α̂) − R(α*_p)`` with ``α*_p``
tuned on the fresh instances themselves (``oracle_budget``). Cells (one per family and
repetition, one per oracle) live in ``<workdir>/cells``; rerunning resumes.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import tqdm

from experiments import common
from experiments.common import sweep
from lowrank_jax import tuning

PARTS = ("group", "diabetes", "fused", "chicago")


def check_config(config: Any) -> None:
    """Validates ``config`` (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for key in ("data.num_test", "data.n_train", "data.n_val", "tune.budget", "eval.num_reps"):
        c.check_positive(config, key, integer=True)
    c.check_fraction(config, "eval.bound_delta", allow_zero=False)
    for part in config.data.parts:
        if part not in PARTS:
            raise c.ConfigError(f"config.data.parts holds {part!r}: use {', '.join(PARTS)}")
    if sorted(config.data.ns) != list(config.data.ns) or min(config.data.ns) < 1:
        raise c.ConfigError("config.data.ns must be increasing positive instance counts")
    if not 0 < config.tune.low < config.tune.high:
        raise c.ConfigError("config.tune needs 0 < low < high")
    for p in (*config.model.ps, *config.tune.tpe_ps):
        d = config.data
        for g in (len(d.active_probs), d.fused_features - 1, d.chicago_weeks - 1):
            if g % p:
                raise c.ConfigError(f"p={p} does not divide the {g} weights of a penalty")


def diabetes_design(config: Any) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """sklearn's diabetes data, each kept feature a standardised cubic-spline group."""
    from sklearn.datasets import load_diabetes
    from sklearn.preprocessing import SplineTransformer

    ds = load_diabetes()
    keep = [i for i, n in enumerate(ds.feature_names) if n not in config.data.diabetes_drop]
    spl = SplineTransformer(n_knots=config.data.spline_knots, degree=3, include_bias=True)
    blocks = [spl.fit_transform(ds.data[:, [i]]) for i in keep]
    x = np.concatenate(blocks, axis=1)
    x = (x - x.mean(0)) / np.maximum(x.std(0), 1e-8)
    y = (ds.target - ds.target.mean()) / ds.target.std()
    return x.astype(np.float32), y.astype(np.float32), tuple(b.shape[1] for b in blocks)


def chicago_signals(config: Any) -> np.ndarray:
    """Standardised weekly windows of the Chicago station series (one per station and year)."""
    from lowrank_jax import data as data_lib

    c = data_lib.load_chicago()
    d = config.data
    return tuning.weekly_windows(
        c.dates, c.ridership, num_weeks=d.chicago_weeks, start=d.chicago_start
    ).signals


def _row_instances(key, x, y, num, n_train, n_val) -> tuning.Instances:
    """``num`` instances, each a random subset of ``n_train + n_val`` rows split in two."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    rows = np.stack([rng.permutation(len(x))[: n_train + n_val] for _ in range(num)])
    xs, ys = x[rows], y[rows]
    nan = np.full((num, x.shape[1]), np.nan, np.float32)
    return tuning.Instances(xs[:, :n_train], ys[:, :n_train], xs[:, n_train:], ys[:, n_train:], nan)


def family(config: Any, part: str, data: Any = None):
    """``(penalty, sample(key, num) -> Instances, num_iters)`` of one instance family."""
    d = config.data
    kw = dict(n_train=d.n_train, n_val=d.n_val)
    if part == "group":
        sizes = (5,) * len(d.active_probs)
        return (
            tuning.group_lasso(sizes),
            lambda k, m: tuning.sample_group_instances(
                k, m, group_sizes=sizes, active_probs=d.active_probs, noise=d.noise, **kw
            ),
            config.model.num_iters,
        )
    if part == "fused":
        return (
            tuning.fused_lasso(d.fused_features),
            lambda k, m: tuning.sample_fused_instances(
                k, m, num_features=d.fused_features, jump_probs=d.jump_probs, noise=d.noise, **kw
            ),
            config.model.fused_num_iters,
        )
    if part == "chicago":
        return (
            tuning.fused_lasso(d.chicago_weeks),
            lambda k, m: tuning.sample_signal_instances(k, m, data, noise=d.noise, **kw),
            config.model.fused_num_iters,
        )
    x, y, sizes = data
    return (
        tuning.group_lasso(sizes),
        lambda k, m: _row_instances(k, x, y, m, d.n_train, d.n_val),
        config.model.num_iters,
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted instance preparation (``tuning.prepare_instances``) of each synthetic family, on
    abstract instances. (The FISTA solves run in ``tuning.validation_losses``, which cuts its
    chunks on the host; the real-data families only change the sizes.)"""
    del mesh  # one device
    check_config(config)
    key, out = jax.random.key(0), []
    for part in config.data.parts:
        if part not in ("group", "fused"):
            continue
        pen, sample, _ = family(config, part)
        inst = jax.eval_shape(lambda k, sample=sample: sample(k, max(config.data.ns)), key)
        kwargs = {"penalty": pen, "ridge": config.model.ridge}
        out.append(common.Step(f"{part} prepare", tuning.prepare_instances, (inst.train,), kwargs))
    return out


def _tuners(config: Any) -> list[tuple[str, int]]:
    out = [("grid" if p == 1 else "rs", p) for p in config.model.ps]
    return out + [("tpe", p) for p in config.tune.tpe_ps]


def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _objective(config, inst, pen, num_iters, prep=None):
    """``alphas (C, p) -> (N, C)`` validation losses of ``inst`` (float64)."""
    m = config.model
    prep = tuning.prepare_instances(inst.train, pen, ridge=m.ridge) if prep is None else prep

    def f(alphas):
        c = len(alphas)  # padded to a power of two: few distinct shapes, few compilations
        a = np.concatenate([alphas, np.repeat(alphas[-1:], _bucket(c) - c, axis=0)])
        w = tuning.tie_weights(a.astype(np.float32), num_weights=pen.num_weights)
        u = tuning.validation_losses(
            prep, inst.val, w, pen, num_iters=num_iters, chunk_size=m.chunk_size
        )
        return np.asarray(u, np.float64)[:, :c]

    return f


class PrefixLosses:
    """``(alphas, n) -> (n, C)`` losses of the first ``n`` of a repetition's instances.

    A batch of more than ``full_batch`` candidates (the grid, the random stage: the same
    candidates for every N) is solved once on all instances and sliced per prefix; smaller
    batches (coordinate refinement, TPE trials) are solved on the prefix only. Both give the
    same numbers (an instance's loss does not depend on the others); this only saves solves.
    """

    def __init__(self, config, inst, pen, num_iters, *, full_batch: int = 8):
        prep = tuning.prepare_instances(inst.train, pen, ridge=config.model.ridge)
        self.prep, inst = jax.tree.map(np.asarray, prep), jax.tree.map(np.asarray, inst)
        self.inst, self.args, self.full_batch = inst, (config, pen, num_iters), full_batch
        self.cache: dict[bytes, np.ndarray] = {}

    def __call__(self, alphas: np.ndarray, n: int) -> np.ndarray:
        alphas = np.asarray(alphas, np.float64)
        if len(alphas) > self.full_batch:
            key = alphas.tobytes()
            if key not in self.cache:
                self.cache[key] = _objective(*self._sub(None))(alphas)
            return self.cache[key][:n]
        return _objective(*self._sub(n))(alphas)[:n]

    def _sub(self, n):  # the first bucket(n) instances: few distinct shapes, few compilations
        cut = (lambda v: v) if n is None else (lambda v: v[: _bucket(n)])
        config, pen, num_iters = self.args
        return config, jax.tree.map(cut, self.inst), pen, num_iters, jax.tree.map(cut, self.prep)


def tune(config, method, p, losses, seed, num_instances) -> tuning.TuneResult:
    """One tuner on the first ``num_instances`` instances of ``losses`` (``(alphas, n) ->
    (n, C)``), with ``config.tune.budget`` candidate evaluations."""
    t = config.tune
    lo, hi = t.low, t.high

    def f(a):
        return losses(a, num_instances).mean(0)

    if method == "grid":
        return tuning.tune_grid(f, budget=t.budget, low=lo, high=hi)
    if method == "tpe":
        return tuning.tune_tpe(f, p=p, budget=t.budget, low=lo, high=hi, seed=seed)
    return tuning.tune_random_refine(
        f,
        jax.random.key(seed),
        p=p,
        budget=t.budget,
        low=lo,
        high=hi,
        refine_fraction=t.refine_fraction,
        num_points=t.num_points,
    )


def rep_cell(config, part, rep, pen, sample, num_iters, test_f) -> dict:
    """One repetition: every tuner at every N; true risks on the fresh instances."""
    key = jax.random.fold_in(jax.random.key(config.seed), 100 + rep)
    inst = sample(key, max(config.data.ns))
    losses = PrefixLosses(config, inst, pen, num_iters)
    out = {}
    for method, p in _tuners(config):
        res = [
            tune(config, method, p, losses, 1000 * rep + 10 * p + i, n)
            for i, n in enumerate(config.data.ns)
        ]
        alphas = np.stack([r.alpha for r in res])
        true = test_f(alphas).mean(0)
        out[f"{method}_p{p}"] = {
            "alpha": alphas.tolist(),
            "empirical": [r.loss for r in res],
            "true": true.tolist(),
            "evals": [r.num_evals for r in res],
        }
    return out


def oracle_cell(config, method, p, test_f, num_test) -> dict:
    """``α*_p``: the same tuner with ``oracle_budget`` evaluations on the fresh instances."""
    c = config.copy_and_resolve_references()
    c.tune.budget = config.tune.oracle_budget
    r = tune(c, method, p, lambda a, n: test_f(a)[:n], 7 + p, num_test)
    return {"alpha": r.alpha.tolist(), "true": r.loss}


def _plot(path, curves, title, ylabel, guide=None):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, marker="o", ms=3, label=label)
    if guide is not None:  # a dashed N^(-1/2) line through (x0, y0)
        x0, y0 = guide
        xs = np.array([min(xs[0] for xs, _ in curves.values()), x0])
        ax.plot(xs, y0 * np.sqrt(x0 / xs), "k--", lw=0.8, label="∝ N^(-1/2)")
    ax.set_xscale("log")
    if all(y > 0 for _, ys in curves.values() for y in ys):
        ax.set_yscale("log")
    ax.set(title=title, xlabel="N (training instances)", ylabel=ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _slope(ns, ys) -> float:
    """Least-squares slope of log y against log N (NaN unless every y is positive)."""
    ys = np.asarray(ys)
    return float(np.polyfit(np.log(ns), np.log(ys), 1)[0]) if np.all(ys > 0) else float("nan")


def gap_bounds(config, pen, loss_range: float) -> dict[int, dict]:
    """``{p: {"pdim", "bound"}}``: the pseudo-dimension bound of the family's loss class with p
    tied weights (:func:`tuning.pseudo_dimension_bound` of :func:`tuning.lasso_loss_polynomials`)
    and the uniform-convergence bound on the gap at every N (:func:`tuning.uniform_convergence_bound`,
    ``H = loss_range``, ``δ = config.eval.bound_delta``)."""
    num_polys, degree = tuning.lasso_loss_polynomials(pen)
    out = {}
    for p in sorted({p for _, p in _tuners(config)}):
        d = tuning.pseudo_dimension_bound(p, num_polys=num_polys, degree=degree)
        b = tuning.uniform_convergence_bound(
            np.array(config.data.ns), pdim=d, loss_bound=loss_range, delta=config.eval.bound_delta
        )
        out[p] = {"pdim": d, "bound": b}
    return out


def _plot_bound(path, ns, stats, bounds, title):
    """The bound (solid) against the measured mean |gap| (dashed) over N, one colour per p."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, p in enumerate(sorted(bounds)):
        c = colours[i % len(colours)]
        ax.plot(
            ns, bounds[p]["bound"], "-", color=c, label=f"bound, p={p} (Pdim ≤ {bounds[p]['pdim']})"
        )
        for k, st in stats.items():
            if int(k.split("_p")[1]) == p:
                style = ":" if k.startswith("tpe") else "--"
                ax.plot(ns, np.maximum(st["abs_gap"], 1e-6), style, marker="o", ms=3, color=c,
                        label=f"measured |gap|, {k}")  # fmt: skip
    ax.set(xscale="log", yscale="log", title=title, xlabel="N (training instances)",
           ylabel="generalisation gap")  # fmt: skip
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarise(config, workdir, part, reps, oracles, bounds) -> tuple[list[dict], list[dict]]:
    """Table rows, plots and trend checks of one family.

    ``gap`` is the signed ``R(α̂) − R̂_N(α̂)`` (the optimism of the empirical risk), ``|gap|`` its
    absolute value (what uniform convergence bounds), both averaged over repetitions; ``bound``
    is the pseudo-dimension bound on ``sup_α |gap|`` for the tuner's p (:func:`gap_bounds`).
    """
    ns = np.array(config.data.ns)
    names = list(reps[0])
    rows, stats = [], {}
    best_all = min(o["true"] for o in oracles.values())
    for name in names:
        tr = np.array([r[name]["true"] for r in reps])
        g = tr - np.array([r[name]["empirical"] for r in reps])
        ex = tr - oracles[name.replace("tpe", "rs").split("_")[1]]["true"]
        st = {"gap": g.mean(0), "abs_gap": np.abs(g).mean(0), "excess": ex.mean(0), "risk": tr}
        st["slope"] = _slope(ns, st["abs_gap"])
        stats[name] = st
        for j, n in enumerate(ns):
            rows.append(
                {
                    "family": part,
                    "tuner": name,
                    "N": int(n),
                    "gap": sweep.format_mean_sd(g[:, j], 4),
                    "abs_gap": float(st["abs_gap"][j]),
                    "bound": float(bounds[int(name.split("_p")[1])]["bound"][j]),
                    "excess": sweep.format_mean_sd(ex[:, j], 4),
                    "true_risk": sweep.format_mean_sd(tr[:, j], 4),
                    "R_minus_best_R*": float(tr[:, j].mean() - best_all),
                    "abs_gap_slope": st["slope"] if j == 0 else "",
                }
            )
    for what, ylabel in (("abs_gap", "mean |generalisation gap|"), ("excess", "excess risk")):
        curves = {k: (ns, np.maximum(v[what], 1e-6)) for k, v in stats.items()}
        last = (ns[-1], float(np.median([v[-1] for _, v in curves.values()])))
        guide = last if what == "abs_gap" else None
        _plot(os.path.join(workdir, f"{part}_{what}.png"), curves, f"P12 {part}", ylabel, guide)
    _plot(
        os.path.join(workdir, f"{part}_risk.png"),
        {k: (ns, v["risk"].mean(0)) for k, v in stats.items()},
        f"P12 {part}",
        "true risk of the tuned weights",
    )
    _plot_bound(
        os.path.join(workdir, f"{part}_bound.png"),
        ns,
        stats,
        bounds,
        f"P12 {part}: pseudo-dimension bound vs measured gap",
    )
    slopes = ", ".join(f"{k}: {v['slope']:.2f}" for k, v in stats.items())
    checks = [
        sweep.check(
            f"{part}: mean |gap| slope in N within [-0.75, -0.25] for every tuner",
            all(-0.75 <= v["slope"] <= -0.25 for v in stats.values()),
            slopes,
        )
    ]
    rs = sorted((k for k in names if k.startswith("rs")), key=lambda k: int(k.split("_p")[1]))
    if "grid_p1" in stats and rs:
        order = ["grid_p1", *rs]
        for what in ("gap", "abs_gap"):
            at = {k: stats[k][what] for k in order}
            checks.append(
                sweep.check(
                    f"{part}: {what} grows with p ({' < '.join(order)}) at N={ns[0]}; "
                    f"{rs[-1]} > grid_p1 at every N",
                    bool(
                        np.all(np.diff([at[k][0] for k in order]) > 0)
                        and np.all(at[rs[-1]] > at["grid_p1"])
                    ),
                    "; ".join(f"{k}: " + ", ".join(f"{x:.3f}" for x in at[k]) for k in order),
                )
            )
        for k in rs:
            d = stats[k]["risk"] - stats["grid_p1"]["risk"]
            se = d.std(0, ddof=1) / np.sqrt(len(d)) if len(d) > 1 else np.zeros(len(ns))
            checks.append(
                sweep.check(
                    f"{part}: weighted ({k}) beats scalar in true risk at N={ns[-1]}",
                    bool(d[:, -1].mean() < 0),
                    "R(weighted) − R(scalar) per N: "
                    + ", ".join(f"{m:+.4f}±{e:.4f}" for m, e in zip(d.mean(0), se, strict=True)),
                )
            )
    return rows, checks


def run_part(config: Any, workdir: str, store: sweep.CellStore, part: str):
    """One instance family: oracles, repetitions, table rows, checks and plots."""
    real = {"diabetes": diabetes_design, "chicago": chicago_signals}  # real-data families
    data = real[part](config) if part in real else None
    pen, sample, num_iters = family(config, part, data)
    test = sample(jax.random.fold_in(jax.random.key(config.seed), 1), config.data.num_test)
    test_losses = _objective(config, test, pen, num_iters)
    oracles = {  # keyed like the tuners: p1, p2, ... (TPE is compared with the rs oracle)
        f"p{p}": store.get(
            f"{part}/oracle/p={p}",
            lambda m=method, p=p: oracle_cell(config, m, p, test_losses, config.data.num_test),
        )
        for method, p in _tuners(config)
        if method != "tpe"
    }
    reps = [
        store.get(
            f"{part}/rep={r}",
            lambda r=r: rep_cell(config, part, r, pen, sample, num_iters, test_losses),
        )
        for r in tqdm.trange(config.eval.num_reps, disable=not config.log.progress, desc=part)
    ]
    # H of the bound (a plug-in): the largest validation loss of a fresh instance at the oracles.
    loss_range = store.get(
        f"{part}/loss_range",
        lambda: {
            "H": max(float(test_losses(np.array([o["alpha"]])).max()) for o in oracles.values())
        },
    )["H"]
    bounds = gap_bounds(config, pen, loss_range)
    rows, checks = summarise(config, workdir, part, reps, oracles, bounds)
    extra = {
        "oracle_risk": {k: round(v["true"], 4) for k, v in oracles.items()},
        "loss_range_H": round(loss_range, 3),
        "pdim_bound": {f"p{p}": b["pdim"] for p, b in bounds.items()},
        # N(ε, δ) at which the bound reaches ε = 0.1 H (it is vacuous, ≥ H, below N = Pdim).
        "N_for_bound_0.1H": {
            f"p{p}": tuning.uniform_convergence_sample_size(
                0.1 * loss_range,
                pdim=b["pdim"],
                loss_bound=loss_range,
                delta=config.eval.bound_delta,
            )
            for p, b in bounds.items()
        },
    }
    return rows, checks, extra


def run(config: Any, workdir: str) -> dict:
    """Runs every family; writes results.md, summary.json and gap/excess/risk plots."""
    check_config(config)
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, resume=config.ckpt.resume)
    rows, checks, extra = [], [], {}
    for part in config.data.parts:
        r, c, e = run_part(config, workdir, store, part)
        rows, checks = rows + r, checks + c
        extra.update({f"{part}_{k}": v for k, v in e.items()})
    store.close()
    cols = ["family", "tuner", "N", "gap", "abs_gap", "bound", "excess", "true_risk"]
    cols.append("R_minus_best_R*")
    cols.append("abs_gap_slope")
    return sweep.write_sweep_results(
        workdir,
        rows,
        checks,
        title="P12 multi-dimensional tuning: generalisation gap and excess risk vs N "
        "(mean ± sd over repetitions)",
        columns=cols,
        command=sweep.command_line(
            "python -m experiments.train --config=configs/multidim_tuning.py"
        ),
        extra=extra,
    )
