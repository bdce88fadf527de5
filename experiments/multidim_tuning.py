"""P12: learning p tied regularisation weights from N instances; gap and excess risk against N.

For each instance family (``config.data.parts``), each repetition draws ``max(ns)`` training
instances; for each N the tuners see the first N. Tuners (``lowrank_jax.tuning``), all with
``config.tune.budget`` candidate evaluations: ``grid`` (p = 1, :func:`tuning.log_grid`),
``rs`` (p > 1, log-uniform candidates + :func:`tuning.lasso_tuners.coordinate_refine`, i.e.
:func:`tuning.random_refine_search` with the random stage's losses computed once on all instances
and averaged over each prefix) and ``tpe`` (:func:`tuning.tpe_search`). The true risk ``R`` of a
chosen α̂ is its mean validation loss on ``num_test`` fresh instances (one fixed set per family);
the generalisation gap is ``R(α̂) − R̂_N(α̂)``; the excess risk is ``R(α̂) − R(α*_p)`` with ``α*_p``
tuned on the fresh instances themselves (``oracle_budget``). Cells (one per family and
repetition, one per oracle) live in ``<workdir>/cells``; rerunning resumes. Losses come from
:func:`tuning.instance_losses`, the diabetes instances from :func:`tuning.sample_row_instances`;
the bound columns, table, checks and plots from ``experiments/common/multidim_tuning_report.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import tqdm

from experiments import common
from experiments.common import multidim_tuning_report as report
from experiments.common import sweep
from lowrank_jax import tuning
from lowrank_jax.tuning.lasso import fused_lasso, prepare_instances
from lowrank_jax.tuning.lasso_tuners import instance_losses
from lowrank_jax.tuning.search import LogBox, SearchResult
from lowrank_jax.tuning.signal_banks import weekly_windows
from lowrank_jax.tuning.synthetic import (
    sample_fused_instances,
    sample_row_instances,
    sample_signal_instances,
)

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
    return weekly_windows(
        c.dates, c.ridership, num_weeks=d.chicago_weeks, start=d.chicago_start
    ).signals


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
            fused_lasso(d.fused_features),
            lambda k, m: sample_fused_instances(
                k, m, num_features=d.fused_features, jump_probs=d.jump_probs, noise=d.noise, **kw
            ),
            config.model.fused_num_iters,
        )
    if part == "chicago":
        return (
            fused_lasso(d.chicago_weeks),
            lambda k, m: sample_signal_instances(k, m, data, noise=d.noise, **kw),
            config.model.fused_num_iters,
        )
    x, y, sizes = data
    return (
        tuning.group_lasso(sizes),
        lambda k, m: sample_row_instances(k, x, y, m, **kw),
        config.model.num_iters,
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted instance preparation (``tuning.lasso.prepare_instances``) of each synthetic
    family, on abstract instances. (The FISTA solves run in ``tuning.validation_losses``, which cuts
    its chunks on the host; the real-data families only change the sizes.)"""
    del mesh  # one device
    check_config(config)
    key, out = jax.random.key(0), []
    for part in config.data.parts:
        if part not in ("group", "fused"):
            continue
        pen, sample, _ = family(config, part)
        inst = jax.eval_shape(lambda k, sample=sample: sample(k, max(config.data.ns)), key)
        kwargs = {"penalty": pen, "ridge": config.model.ridge}
        out.append(common.Step(f"{part} prepare", prepare_instances, (inst.train,), kwargs))
    return out


def _tuners(config: Any) -> list[tuple[str, int]]:
    out = [("grid" if p == 1 else "rs", p) for p in config.model.ps]
    return out + [("tpe", p) for p in config.tune.tpe_ps]


def _losses(config, train, val, pen, num_iters):
    """``(alphas (C, p), n=None) -> (n, C)`` validation losses
    (``tuning.lasso_tuners.instance_losses``, float64; candidates and instances padded to powers of
    two: few compilations)."""
    m = config.model
    return instance_losses(
        train, val, pen, num_iters=num_iters, ridge=m.ridge, chunk_size=m.chunk_size, pad=True
    )


class PrefixLosses:
    """``(alphas, n) -> (n, C)`` losses of the first ``n`` of a repetition's instances.

    A batch of more than ``full_batch`` candidates (the grid, the random stage: the same
    candidates for every N) is solved once on all instances and sliced per prefix; smaller
    batches (coordinate refinement, TPE trials) are solved on the prefix only. Both give the
    same numbers (an instance's loss does not depend on the others); this only saves solves.
    """

    def __init__(self, config, inst, pen, num_iters, *, full_batch: int = 8):
        prep = prepare_instances(inst.train, pen, ridge=config.model.ridge)
        prep, inst = jax.tree.map(np.asarray, prep), jax.tree.map(np.asarray, inst)
        self.losses = _losses(config, prep, inst.val, pen, num_iters)
        self.full_batch, self.cache = full_batch, {}

    def __call__(self, alphas: np.ndarray, n: int) -> np.ndarray:
        alphas = np.asarray(alphas, np.float64)
        if len(alphas) > self.full_batch:
            key = alphas.tobytes()
            if key not in self.cache:
                self.cache[key] = self.losses(alphas)
            return self.cache[key][:n]
        return self.losses(alphas, n)


def tune(config, method, p, losses, seed, num_instances) -> SearchResult:
    """One tuner on the first ``num_instances`` instances of ``losses`` (``(alphas, n) ->
    (n, C)``), with ``config.tune.budget`` candidate evaluations."""
    t = config.tune
    lo, hi = t.low, t.high

    def f(a):
        return losses(a, num_instances).mean(0)

    if method == "grid":
        return tuning.log_grid_search(f, budget=t.budget, low=lo, high=hi)
    box = LogBox(p, lo, hi)
    if method == "tpe":  # Optuna's default 10 random start-up trials
        return tuning.tpe_search(f, box, seed=seed, budget=t.budget, n_init=10, goal="min")
    return tuning.random_refine_search(
        f,
        box,
        key=jax.random.key(seed),
        budget=t.budget,
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
        alphas = np.stack([r.best_point for r in res])
        true = test_f(alphas).mean(0)
        out[f"{method}_p{p}"] = {
            "alpha": alphas.tolist(),
            "empirical": [r.best_value for r in res],
            "true": true.tolist(),
            "evals": [r.num_evals for r in res],
        }
    return out


def oracle_cell(config, method, p, test_f, num_test) -> dict:
    """``α*_p``: the same tuner with ``oracle_budget`` evaluations on the fresh instances."""
    c = config.copy_and_resolve_references()
    c.tune.budget = config.tune.oracle_budget
    r = tune(c, method, p, lambda a, n: test_f(a)[:n], 7 + p, num_test)
    return {"alpha": r.best_point.tolist(), "true": r.best_value}


def run_part(config: Any, workdir: str, store: sweep.CellStore, part: str):
    """One instance family: oracles, repetitions, table rows, checks and plots."""
    real = {"diabetes": diabetes_design, "chicago": chicago_signals}  # real-data families
    data = real[part](config) if part in real else None
    pen, sample, num_iters = family(config, part, data)
    test = sample(jax.random.fold_in(jax.random.key(config.seed), 1), config.data.num_test)
    test_losses = _losses(config, test.train, test.val, pen, num_iters)
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
    bounds = report.gap_bounds(config, pen, loss_range, [p for _, p in _tuners(config)])
    rows, checks = report.summarise(config, workdir, part, reps, oracles, bounds)
    return rows, checks, report.extra_summary(config, oracles, loss_range, bounds)


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs every family; writes results.md, summary.json and gap/excess/risk plots."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    rows, checks, extra = [], [], {}
    for part in config.data.parts:
        r, c, e = run_part(config, workdir, store, part)
        rows, checks = rows + r, checks + c
        extra.update({f"{part}_{k}": v for k, v in e.items()})
    store.close()
    return report.write_results(workdir, rows, checks, extra)
