"""P9: the threshold-class mechanism demo of the limits of adaptation (specs §9 (4)).

Per cell ``(N, n)`` and family member ``(k, c)`` (``k`` good sources among ``N``, decoy width
constant ``c``), :func:`lowrank_jax.analysis.simulate_threshold_family` gives the excess target
risk of every estimator over ``num_draws`` vmapped draws. The table reports mean excess risks,
the ratio of each estimator's mean to the oracle's, and the worst case of that ratio over the
family. The MNIST version runs the same estimators on a 1-D LDA score of MNIST 4 vs 9 with
semi-synthetic decoys (``lowrank_jax.analysis.multitask.sample_pool_tasks``), excess risk on the
test set. The nlschools version uses real tasks: the 133 school classes of ``MASS::nlschools``
(score = rank of verbal IQ, label = language score above the median); a held-out set of classes is
the target population, each source task is one class (``n`` draws with replacement from its pupils),
decoy classes get coin-flip labels in the flat zone (``lowrank_jax.analysis.multitask.group_pool``).

The decoys of these three families have an n-scaled width (one task's ERM resolution), so the
n-independence of their ratios is built in. The **fixed-width control** (``config.control``) runs
the synthetic family with decoy widths that do not depend on n (the same instance at every n),
over several seeds, and writes ``fixed_width.md``: there the n-dependence of the ratio is measured.

The method (estimators, sampling) lives in ``lowrank_jax.analysis.multitask``; this module only
wires cells and writes ``results.md``, ``summary.json`` and ratio-to-oracle plots. Finished cells
live in ``<workdir>/cells`` (``experiments.common.sweep.CellStore``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from experiments import common
from experiments.common import multitask_limits_report as report
from experiments.common import sweep
from experiments.common.multitask_pools import mnist_pool, nlschools_pool
from lowrank_jax import analysis
from lowrank_jax.analysis.multitask import (
    empirical_excess_risk,
    sample_pool_tasks,
    threshold_estimates,
)
from lowrank_jax.analysis.multitask_lower_bound import (
    PACKING_ESTIMATORS,
    packing_separation,
    simulate_packing_family,
)

EST, ADAPTIVE = report.EST, report.ADAPTIVE


def check_config(config: Any) -> None:
    """Validates ``config`` (raises ``common.ConfigError``)."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    for key in ("data.num_draws", "data.n_val", "mnist.pca_dim", "mnist.num_draws",
                "nlschools.num_draws", "nlschools.num_target_groups", "lower_bound.num_draws",
                "control.num_draws"):  # fmt: skip
        c.check_positive(config, key, integer=True)
    for n in (*config.data.ns, *config.mnist.ns, *config.nlschools.ns, *config.control.ns):
        if n < 2:
            raise c.ConfigError(f"config.data.ns holds {n}: need at least 2 samples per task")
    for g in (*config.data.good, config.lower_bound.good, *config.control.good):
        if g not in ("one", "sqrt", "all"):
            raise c.ConfigError(f"config.data.good holds {g!r}: use 'one', 'sqrt' or 'all'")
    for b in (config.data.beta, *config.lower_bound.betas):
        if not 0 < b <= 1:
            raise c.ConfigError(f"config.data.beta / lower_bound.betas hold {b}: use (0, 1]")
    if config.lower_bound.num_hypotheses < 2 or not config.lower_bound.c > 0:
        raise c.ConfigError("config.lower_bound needs num_hypotheses >= 2 and c > 0")
    if min(config.lower_bound.ns) < 2:
        raise c.ConfigError("config.lower_bound.ns must be at least 2 samples per task")
    if not config.control.widths or not all(0 < w <= 0.5 for w in config.control.widths):
        raise c.ConfigError(
            f"config.control.widths holds {tuple(config.control.widths)}: use widths in (0, ½]"
        )
    for pair in config.control.compare:
        if len(pair) != 2 or not set(pair) <= set(config.control.ns) or pair[0] >= pair[1]:
            raise c.ConfigError(
                f"config.control.compare holds {tuple(pair)}: use (n, n') with n < n', both in "
                "config.control.ns"
            )
    if not config.control.seeds:
        raise c.ConfigError("config.control.seeds is empty: the control needs at least one seed")
    if len(config.mnist.digits) != 2:
        raise c.ConfigError("config.mnist.digits must name two digits")


def _num_good(name: str, n_tasks: int) -> int:
    return {"one": 1, "sqrt": math.ceil(math.sqrt(n_tasks)), "all": n_tasks}[name]


def _family(config: Any, n_tasks: int, n: int, *, fixed: bool = False):
    """Jitted ``(key, num_good (F,), c (F,)) -> risks``: the threshold family's simulation for
    every (number of good tasks, c) member at once. ``fixed``: the fixed-width control, where the
    second input is the decoys' half-width itself (``config.control``), not an n-scaled constant."""
    d, m = config.data, config.model
    draws = config.control.num_draws if fixed else d.num_draws

    def one(key, k, c):
        width = {"width": c} if fixed else {"c": c}
        return analysis.simulate_threshold_family(
            key, num_tasks=n_tasks, n=n, num_good=k, num_draws=draws, n_val=d.n_val, beta=d.beta,
            agreement_z=m.agreement_z, lepski_c=m.lepski_c, batch_size=m.batch_size, **width,
        )  # fmt: skip

    return jax.jit(jax.vmap(one, in_axes=(None, 0, 0)))


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The synthetic cells' simulation and the lower-bound packing at the largest task count and
    sample size, on abstract inputs. (The real-pool cells close over their pools' scores.)"""
    del mesh  # one device
    check_config(config)
    d, spec = config.data, jax.ShapeDtypeStruct
    f = len(d.good) * len(d.cs)
    args = (jax.eval_shape(lambda: jax.random.key(0)), spec((f,), jnp.int32), spec((f,), jnp.float32))  # fmt: skip
    n_tasks, n = max(d.num_tasks), max(d.ns)
    out = [common.Step(f"synthetic N={n_tasks} n={n}", _family(config, n_tasks, n), args)]
    lb = config.lower_bound
    if lb.enabled:  # the packing at its largest cell (num_good traced)
        nt, n, b = max(lb.num_tasks), max(lb.ns), lb.betas[0]
        lb_args = (args[0], spec((), jnp.int32))
        out.append(common.Step(f"lower bound N={nt} n={n}", _packing(config, b, nt, n), lb_args))
    return out


def synthetic_cell(
    config: Any, n_tasks: int, n: int, key: jax.Array, *, fixed: bool = False
) -> dict:
    """One (N, n) cell of the synthetic family: members k × c (n-scaled decoy widths), or, with
    ``fixed``, the control's members k × w (decoy half-widths w that do not depend on n)."""
    d = config.control if fixed else config.data
    members = [(g, c) for g in d.good for c in (d.widths if fixed else d.cs)]
    ks = jnp.asarray([_num_good(g, n_tasks) for g, _ in members])
    cs = jnp.asarray([c for _, c in members], jnp.float32)
    family = _family(config, n_tasks, n, fixed=fixed)
    out = report.summarise(np.asarray(family(key, ks, cs), np.float64))
    name = "w" if fixed else "c"
    out["members"] = [f"k={int(k)},{name}={c}" for k, (_, c) in zip(ks, members, strict=True)]
    return out


def pool_cell(config: Any, pool: dict, n_tasks: int, n: int, key: jax.Array, draws: int) -> dict:
    """Excess test risks of the estimators on tasks drawn from a real pool (MNIST scores, or the
    classes of a grouped pool: then the target and ``n_tasks`` random source groups)."""
    d, m = config.data, config.model
    sp, yp = (jnp.asarray(pool[k]) for k in ("scores", "labels"))
    grouped = "group_starts" in pool
    if grouped and n_tasks > len(pool["group_starts"]):
        raise ValueError(f"N={n_tasks} exceeds the {len(pool['group_starts'])} source groups")
    lo, hi = (pool["target_start"], pool["target_start"] + pool["target_size"]) if grouped else (
        0, sp.shape[0])  # fmt: skip
    members = [(g, c) for g in d.good for c in d.cs]

    def one(k, num_good, c):
        kp, ks, kv = jax.random.split(k, 3)
        good = jnp.concatenate(
            [jnp.ones((1,), bool), jax.random.permutation(kp, n_tasks) < num_good]
        )
        seg = {}
        if grouped:
            chosen = jax.random.permutation(jax.random.fold_in(kp, 1), len(pool["group_starts"]))
            chosen = chosen[:n_tasks]
            seg["starts"] = jnp.concatenate(
                [jnp.asarray([lo]), jnp.asarray(pool["group_starts"])[chosen]]
            )
            seg["sizes"] = jnp.concatenate(
                [jnp.asarray([hi - lo]), jnp.asarray(pool["group_sizes"])[chosen]]
            )
        width = jnp.minimum(c * n ** (-d.beta / (2 - d.beta)), 0.5)
        x, y = sample_pool_tasks(ks, sp, yp, good, n=n, center=pool["center"], width=width, **seg)
        iv = jax.random.randint(kv, (d.n_val,), lo, hi)
        return threshold_estimates(
            x, y, sp[iv], yp[iv], good, beta=d.beta, agreement_z=m.agreement_z, lepski_c=m.lepski_c
        )

    keys = jax.random.split(key, draws)
    fn = jax.jit(lambda g, c: jax.lax.map(lambda k: one(k, g, c), keys, batch_size=m.batch_size))
    ts = np.stack([np.asarray(fn(_num_good(g, n_tasks), c)) for g, c in members])
    excess = np.asarray(empirical_excess_risk(ts, *pool["test"]), np.float64)
    out = report.summarise(excess)
    out["members"] = [f"k={_num_good(g, n_tasks)},c={c}" for g, c in members]
    out["pool_error"] = pool["pool_error"]
    return out


LB = PACKING_ESTIMATORS


def _packing(config: Any, beta: float, n_tasks: int, n: int):
    """Jitted ``(key, num_good) -> (draws, len(LB))`` excess risks on the Fano-type packing."""
    lb, m = config.lower_bound, config.model

    def sim(key, k):
        return simulate_packing_family(
            key, num_tasks=n_tasks, n=n, num_good=k, beta=beta, c=lb.c,
            num_hypotheses=lb.num_hypotheses, num_draws=lb.num_draws, n_val=config.data.n_val,
            agreement_z=m.agreement_z, lepski_c=m.lepski_c, batch_size=m.batch_size,
        )  # fmt: skip

    return jax.jit(sim)


def lower_bound_cell(config: Any, beta: float, n_tasks: int, n: int, key: jax.Array) -> dict:
    """One (β, N, n) cell of the Fano-type packing
    (``analysis.multitask_lower_bound.simulate_packing_family``) with ``k = ⌈√N⌉`` good sources:
    mean and s.e. of every estimator's excess risk, the Bayes floor
    (good set unknown) and the oracle's Bayes risk (known) included."""
    lb = config.lower_bound
    k = _num_good(lb.good, n_tasks)
    risks = np.asarray(_packing(config, beta, n_tasks, n)(key, k), np.float64)
    delta = float(packing_separation(n, k, c=lb.c, beta=beta))
    half = (lb.num_hypotheses - 1) / 2 + 1
    return {
        "k": k,
        "delta": min(delta, 0.25 / half),
        "mean": dict(zip(LB, risks.mean(0).tolist(), strict=True)),
        "sem": dict(zip(LB, (risks.std(0) / np.sqrt(len(risks))).tolist(), strict=True)),
    }


def lower_bound_part(config: Any, workdir: str, store: Any, key: jax.Array):
    """The β sweep of the packing: rows (written to ``lower_bound.md``), checks, plots."""
    lb = config.lower_bound
    grid = [(b, nt, n) for b in lb.betas for n in lb.ns for nt in lb.num_tasks]
    cells = {}
    for b, nt, n in tqdm.tqdm(grid, disable=not config.log.progress, desc="lower bound"):
        k = jax.random.fold_in(key, 13 + 1000 * nt + n + int(1e6 * b))
        cells[(b, nt, n)] = store.get(
            f"lower_bound/beta={b}/N={nt}/n={n}",
            lambda b=b, nt=nt, n=n, k=k: lower_bound_cell(config, b, nt, n, k),
        )
    rows, ratio_curves = [], {}
    for (b, nt, n), cell in cells.items():
        mean, floor = cell["mean"], cell["mean"]["bayes_floor"]
        rows.append({
            "beta": b, "N": nt, "n": n, "k": cell["k"], "delta": cell["delta"],
            "floor": f"{floor:.3e} ± {cell['sem']['bayes_floor']:.1e}",
            "oracle floor": mean["bayes_oracle"],
            "floor / oracle floor": floor / mean["bayes_oracle"],
            "oracle ERM": mean["oracle"],
            **{f"{e} / floor": mean[e] / floor for e in ADAPTIVE},
        })  # fmt: skip
        ratio_curves.setdefault(f"β={b}, n={n}", ([], []))
        ratio_curves[f"β={b}, n={n}"][0].append(nt)
        ratio_curves[f"β={b}, n={n}"][1].append(floor / mean["bayes_oracle"])
    common.plot_curves(
        os.path.join(workdir, "lower_bound_ratio.png"), ratio_curves,
        title="Fano-type packing: Bayes floor (good set unknown) / oracle's Bayes risk",
        xlabel="N (source tasks), k = ceil(sqrt N) good", ylabel="ratio", hline=1.0,
    )  # fmt: skip
    lo, hi = lb.num_tasks[0], lb.num_tasks[-1]
    grows = {
        (b, n): cells[(b, hi, n)]["mean"]["bayes_floor"] / cells[(b, hi, n)]["mean"]["bayes_oracle"]
        > cells[(b, lo, n)]["mean"]["bayes_floor"] / cells[(b, lo, n)]["mean"]["bayes_oracle"]
        for b in lb.betas for n in lb.ns
    }  # fmt: skip
    above = [  # Bayes optimality: holds by construction up to Monte Carlo error (2 s.e.)
        (key, e) for key, cell in cells.items() for e in (*ADAPTIVE, "oracle")
        if cell["mean"][e] + 2 * cell["sem"][e] < cell["mean"]["bayes_floor"]
    ]  # fmt: skip
    checks = [
        sweep.check(
            f"lower_bound: floor / oracle floor grows from N={lo} to N={hi} at every (β, n)",
            all(grows.values()),
            ", ".join(f"β={b} n={n}: {'yes' if v else 'no'}" for (b, n), v in grows.items()),
        ),
        sweep.check(
            "lower_bound (by construction, not a reproduction): no method's mean excess risk is "
            "below the Bayes floor by more than 2 s.e.",
            not above,
            "exceptions: " + (", ".join(f"{k}: {e}" for k, e in above) or "none"),
        ),
    ]
    columns = ["beta", "N", "n", "k", "delta", "floor", "oracle floor", "floor / oracle floor",
               "oracle ERM", *[f"{e} / floor" for e in ADAPTIVE]]  # fmt: skip
    common.write_results_md(
        workdir, rows, columns=columns, filename="lower_bound.md",
        title="P9 Fano-type packing: Bayes risk floor next to the methods (mean excess risk)",
        notes=f"δ = {lb.c}·(n(k+1))^(−β/(2−β)) (capped so the window r ≤ ¼), {lb.num_hypotheses} "
        f"hypotheses, {lb.num_draws} draws per cell; the instance is rescaled with n, so ratios "
        "are n-independent by construction.\n\n" + sweep.checks_markdown(checks),
    )  # fmt: skip
    return rows, checks


def control_part(config: Any, workdir: str, store: Any) -> tuple[list[dict], list[dict]]:
    """The fixed-width control: the synthetic family with decoy half-widths that do not depend on
    n, one cell per (seed, N, n); ``fixed_width.md`` lists each method's worst-case ratio to the
    oracle as mean ± sd over the seeds, and one check per pair of ``control.compare`` compares
    the best adaptive method's worst-case ratio at the largest N between its two n, per seed."""
    ctl = config.control
    grid = [(s, nt, n) for s in ctl.seeds for n in ctl.ns for nt in ctl.num_tasks]
    cells = {}
    for s, nt, n in tqdm.tqdm(grid, disable=not config.log.progress, desc="fixed width"):
        k = jax.random.fold_in(jax.random.key(s), 17 + 1000 * nt + n)
        cells[(s, nt, n)] = store.get(
            f"fixed_width/seed={s}/N={nt}/n={n}",
            lambda nt=nt, n=n, k=k: synthetic_cell(config, nt, n, k, fixed=True),
        )

    return report.write_fixed_width(config, workdir, cells)


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs the synthetic grid, the MNIST and nlschools versions, the fixed-width control and the
    lower-bound packing; writes results.md, fixed_width.md, lower_bound.md, summary.json, plots."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    key = jax.random.key(config.seed)
    d = config.data
    rows, checks, extra = [], [], {}
    if d.enabled:
        cells = {}
        for nt, n in tqdm.tqdm(
            [(nt, n) for n in d.ns for nt in d.num_tasks],
            disable=not config.log.progress,
            desc="synthetic",
        ):
            k = jax.random.fold_in(key, 1000 * nt + n)
            cells[(nt, n)] = store.get(
                f"synthetic/N={nt}/n={n}", lambda nt=nt, n=n, k=k: synthetic_cell(config, nt, n, k)
            )
        rows += report.rows_and_plots(workdir, cells, "synthetic", d.num_tasks, d.ns)
        checks += report.checks(cells, d.num_tasks, d.ns, "synthetic")
    parts = (("mnist", mnist_pool, 7), ("nlschools", nlschools_pool, 11))
    for part, builder, salt in parts:
        pc = config[part]
        if not pc.enabled:
            continue
        pool, pcells = None, {}
        for nt, n in tqdm.tqdm(
            [(nt, n) for n in pc.ns for nt in pc.num_tasks],
            disable=not config.log.progress,
            desc=part,
        ):
            name = f"{part}/N={nt}/n={n}"
            if name not in store and pool is None:
                pool = builder(config)
            k = jax.random.fold_in(key, salt + 1000 * nt + n)
            pcells[(nt, n)] = store.get(
                name,
                lambda p=pool, nt=nt, n=n, k=k, pc=pc: pool_cell(config, p, nt, n, k, pc.num_draws),
            )
        error = next(iter(pcells.values())).get("pool_error")  # absent in old cells
        if error is not None:
            extra[f"{part}_pool_error"] = error
        rows += report.rows_and_plots(workdir, pcells, part, pc.num_tasks, pc.ns)
        checks += report.checks(pcells, pc.num_tasks, pc.ns, part)
    if config.control.enabled:
        ctl_rows, ctl_checks = control_part(config, workdir, store)
        checks += ctl_checks
        extra["fixed_width_table"] = "fixed_width.md"
    if config.lower_bound.enabled:
        lb_rows, lb_checks = lower_bound_part(config, workdir, store, key)
        checks += lb_checks
        extra["lower_bound_cells"] = len(lb_rows)
        extra["lower_bound_table"] = "lower_bound.md"
    store.close()
    columns = ["part", "N", "n", "oracle_excess(k=N)", *[f"worst/{e}" for e in ADAPTIVE]]
    return sweep.write_sweep_results(
        workdir,
        rows,
        checks,
        title="P9 multitask limits: worst-case ratio of mean excess risk to the oracle's",
        columns=columns,
        command=sweep.command_line(
            "python -m experiments.train --config=configs/multitask_limits.py"
        ),
        extra=extra,
    )
