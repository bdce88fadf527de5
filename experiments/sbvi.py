"""SBVI rank discovery vs fixed-rank LoRA and AdaLoRA in a teacher-student problem (P8, specs §8).

A frozen random tanh MLP (the teacher) is the base model; the target adds ``ΔW*_l`` of known
ranks ``data.true_ranks`` to its kernels; regression on noisy Gaussian inputs. Methods: LoRA at
fixed ranks (Adam), AdaLoRA (:func:`lowrank_jax.optim.scale_by_adalora`) and SBVI
(:func:`lowrank_jax.optim.scale_by_sbvi`, ``adapter.r_max`` modes, a Gaussian ``q(σ)`` per mode
evolved by its Wasserstein flow) at each temperature of ``optim.temperatures`` — ``T = 0`` is the
same flow without diffusion (a MAP point estimate) — each SBVI arm with the same tuning budget
(the frictions ``optim.friction_grid``, chosen on a validation split). Reported: validation and
test MSE (SBVI at its posterior mean), recovered ranks per layer, trainable parameters and
optimizer-state size. Every (method, setting, seed) is one cell of :mod:`experiments.common.sweep`
(``<workdir>/cells/``; a rerun skips finished cells).

Outputs: ``results.md`` (table and trend checks, with the command), ``summary.json``,
``metrics.jsonl``, ``sbvi_spectra.png`` (final σ per layer, first seed) and ``cells/``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from experiments.common import sweep
from lowrank_jax import adapters, models, optim
from lowrank_jax.optim.adalora import adalora_orthogonality
from lowrank_jax.optim.sbvi import sbvi_mean

__all__ = ["check_config", "run", "run_cell", "teacher_student", "validation_split"]

COMMAND = "python -m experiments.train --config=configs/sbvi.py"
_TARGETS = r"params/(dense_\d+|head)/kernel"


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    sweep.check_config(config)
    c.check_positive(config, "data.num_test", integer=True)
    c.check_positive(config, "adapter.r_max", integer=True)
    ranks = c.get_path(config, "data.true_ranks")
    if len(ranks) != len(c.get_path(config, "model.features")) + 1:
        raise c.ConfigError(
            "config.data.true_ranks needs one rank per kernel (len(model.features) + 1)"
        )
    c.check_positive(config, "data.num_valid", integer=True)
    temps, grid = (
        c.get_path(config, "optim.temperatures"),
        c.get_path(config, "optim.friction_grid"),
    )
    if config.optim.temperature not in temps or any(t < 0 for t in temps):
        raise c.ConfigError("config.optim.temperatures: T >= 0, including optim.temperature")
    if not grid or any(f < 0 for f in grid):
        raise c.ConfigError(f"config.optim.friction_grid={grid!r}: a non-empty list of λ >= 0")
    lora_ranks = c.get_path(config, "adapter.lora_ranks")
    if not lora_ranks or any(not isinstance(r, int) or r < 1 for r in lora_ranks):
        raise c.ConfigError(f"config.adapter.lora_ranks={lora_ranks!r}: positive ints, please")


def teacher_student(config: Any, seed: int):
    """A frozen random MLP teacher, the target with low-rank ΔW*_l, and noisy regression data.

    Returns ``(model, teacher_variables, target_variables, (x_train, y_train), (x_test, y_test))``;
    ``ΔW*_l = Σ_i s_i u_i v_iᵀ`` with ``true_ranks[l]`` modes of strengths ``geomspace(1, .5)``
    times the spectral norm of the teacher kernel times ``data.delta_scale``.
    """
    d = config.data
    model = models.MLP(tuple(config.model.features), config.model.num_outputs, activation=nn.tanh)
    rng = np.random.default_rng([seed, 3])
    teacher = model.init(jax.random.key(seed), jnp.zeros((1, config.model.num_inputs)))
    target = jax.tree.map(lambda a: a, teacher)
    names = [f"dense_{i}" for i in range(len(config.model.features))] + ["head"]
    for name, k in zip(names, d.true_ranks, strict=True):
        w = np.asarray(teacher["params"][name]["kernel"], np.float64)
        n, m = w.shape
        u = np.linalg.qr(rng.standard_normal((n, k)))[0]
        v = np.linalg.qr(rng.standard_normal((m, k)))[0]
        s = np.geomspace(1.0, 0.5, k) * np.linalg.norm(w, 2) * d.delta_scale
        target["params"][name]["kernel"] = jnp.asarray(w + (u * s) @ v.T, jnp.float32)
    x = rng.standard_normal((d.num_train + d.num_test, config.model.num_inputs)).astype(np.float32)
    y = np.asarray(model.apply(target, x))
    y = (y + d.noise * rng.standard_normal(y.shape)).astype(np.float32)
    n_tr = d.num_train
    return model, teacher, target, (x[:n_tr], y[:n_tr]), (x[n_tr:], y[n_tr:])


@functools.cache
def _mse_loss(model, orth_weight: float = 0.0):
    fwd = adapters.adapt(model.apply)

    def loss(ad, variables, batch):
        mse = jnp.mean((fwd(variables, ad, batch["x"]) - batch["y"]) ** 2)
        if orth_weight:
            mse = mse + orth_weight * adalora_orthogonality(ad)
        return mse

    return loss


def _numeric_rank(delta: np.ndarray, ratio: float) -> int:
    s = np.linalg.svd(delta, compute_uv=False)
    return int(np.sum(s > ratio * s[0])) if s[0] > 0 else 0


def _state_size(tree: Any) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def _temperature(config: Any, method: str) -> float:
    """``"sbvi"`` runs at ``optim.temperature``; ``"sbvi_T=<float>"`` at that temperature."""
    return (
        float(method[len("sbvi_T=") :])
        if method.startswith("sbvi_T=")
        else config.optim.temperature
    )


def _method(
    config: Any, method: str, teacher: Any, key: jax.Array, steps: int, seed: int, friction
):
    """``(adapters, optimizer, orthogonality weight)`` of ``"lora_r<k>"``, ``"adalora"``, ``"sbvi…"``."""
    o, a = config.optim, config.adapter
    head = min(a.r_max, config.model.num_outputs)  # the head is 128x10: its rank is capped at 10
    if method.startswith("lora_r"):
        r = int(method[len("lora_r") :])
        h = min(r, config.model.num_outputs)
        rules = [
            (r"params/head/kernel", adapters.lora(h, alpha=2.0 * h)),
            (_TARGETS, adapters.lora(r, alpha=2.0 * r)),
        ]
        return adapters.init(key, teacher, rules), sweep.adam(o.lora_lr), 0.0
    if method == "adalora":
        rules = [
            (r"params/head/kernel", adapters.spectral(head, init="adalora")),
            (_TARGETS, adapters.spectral(a.r_max, init="adalora")),
        ]
        tx = optim.scale_by_adalora(
            inner=optax.adam(o.adalora_lr), target_rank=a.adalora_target_rank,
            total_steps=steps, init_warmup=steps // 10, final_warmup=steps // 4,
            mask_interval=10,
        )  # fmt: skip
        return adapters.init(key, teacher, rules), tx, 0.1
    rules = [
        (r"params/head/kernel", adapters.spectral(head)),
        (_TARGETS, adapters.spectral(a.r_max)),
    ]
    tx = optim.scale_by_sbvi(
        learning_rate=o.sbvi_lr, factor_learning_rate=o.sbvi_factor_lr, family=o.sbvi_family,
        friction=o.friction if friction is None else friction,
        temperature=_temperature(config, method), friction_warmup=int(o.friction_warmup * steps),
        anneal_steps=int(0.8 * steps), prune_start=int(o.prune_start * steps),
        prune_ratio=o.prune_ratio, prune_snr=o.prune_snr, precond_max=o.precond_max, seed=seed,
    )  # fmt: skip
    return adapters.init(key, teacher, rules), tx, 0.0


def validation_split(config: Any, seed: int, target: Any, model: Any):
    """``data.num_valid`` fresh noisy examples of the target (own stream: train/test unchanged)."""
    rng = np.random.default_rng([seed, 5])
    x = rng.standard_normal((config.data.num_valid, config.model.num_inputs)).astype(np.float32)
    y = np.asarray(model.apply(target, x))
    return x, (y + config.data.noise * rng.standard_normal(y.shape)).astype(np.float32)


def run_cell(
    config: Any,
    method: str,
    seed: int,
    *,
    friction: float | None = None,
    options: common.TrainOptions,
) -> dict[str, Any]:
    """Trains one method on one seed's teacher-student problem (``train_scan`` with the run's
    ``options``).

    ``method``: ``"lora_r<k>"``, ``"adalora"``, ``"sbvi"`` or ``"sbvi_T=<temperature>"``;
    ``friction`` overrides SBVI's ``optim.friction`` (the tuned hyper-parameter). Returns
    ``{"test_mse", "valid_mse", "final_train_loss", "ranks" (per layer, hidden first), "spectra"
    (final σ per layer; SBVI: the posterior means), "posterior_sd" (SBVI: final s per layer),
    "params", "opt_state" (floats in the optimizer state)}``; the ranks are SBVI's / AdaLoRA's
    active modes, or LoRA's numeric rank (σ > ``optim.prune_ratio`` σ₁). SBVI is evaluated at its
    posterior mean (:func:`lowrank_jax.optim.sbvi.sbvi_mean`).
    """
    model, teacher, target, (xtr, ytr), (xte, yte) = teacher_student(config, seed)
    xva, yva = validation_split(config, seed, target, model)
    train = {"x": jnp.asarray(xtr), "y": jnp.asarray(ytr)}
    steps = config.schedule.num_steps
    idx = sweep.batch_indices(seed, len(ytr), config.data.batch_size, steps)
    key = jax.random.key(seed)
    ad, tx, orth = _method(config, method, teacher, key, steps, seed, friction)
    loss = _mse_loss(model, orth) if orth else _mse_loss(model)
    p, state, trace = sweep.train_scan(
        ad, teacher, train, idx, loss_fn=loss, tx=tx, options=options
    )
    is_sbvi = method.startswith("sbvi")
    if is_sbvi:  # the parameters hold a sample of q(σ); evaluate its mean
        p = sbvi_mean(p, state)
    fwd = adapters.adapt(model.apply)
    pred, pred_va = fwd(teacher, p, xte), fwd(teacher, p, xva)
    names = sorted(p)
    sd = {}
    if is_sbvi or method == "adalora":  # σ ≥ 0 for SBVI; AdaLoRA's Λ has signs
        found = (optim.sbvi_ranks if is_sbvi else optim.adalora_ranks)(state)
        ranks = [found[n] for n in names]
        sigma = {n: np.asarray(p[n].factors["s"]) for n in names}
        if method == "adalora":
            sigma = {n: np.abs(v) for n, v in sigma.items()}
        spectra = {n: np.sort(v)[::-1].tolist() for n, v in sigma.items()}
        if is_sbvi:
            post = optim.sbvi_posterior(state)
            sd = {n: np.asarray(post[n][1])[np.argsort(-sigma[n])].tolist() for n in names}
    else:
        ranks, spectra = [], {}
        for n in names:
            delta = np.asarray(adapters.delta(p[n], p[n].matrix))  # 2-D kernels: shape = (n, m)
            ranks.append(_numeric_rank(delta, config.optim.prune_ratio))
            spectra[n] = np.linalg.svd(delta, compute_uv=False)[:16].tolist()
    order = [n for n in names if "dense" in n] + [n for n in names if "head" in n]
    by_name = dict(zip(names, ranks, strict=True))
    return {
        "test_mse": float(jnp.mean((pred - yte) ** 2)),
        "valid_mse": float(jnp.mean((pred_va - yva) ** 2)),
        "posterior_sd": {n: sd[n] for n in order} if sd else {},
        "final_train_loss": float(trace[-1]),
        "ranks": [by_name[n] for n in order],
        "spectra": {n: spectra[n] for n in order},
        "params": adapters.count_params(ad),
        "opt_state": _state_size(state),
    }


def _methods(config: Any) -> list[str]:
    """Every method the run trains: the LoRA ranks, AdaLoRA, one SBVI arm per temperature."""
    lora = [f"lora_r{r}" for r in config.adapter.lora_ranks]
    return [*lora, "adalora", *(_arm(t) for t in config.optim.temperatures)]


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """Every method's ``train_scan`` on abstract inputs (no teacher is drawn)."""
    del mesh  # the sweep's programs run on one device
    check_config(config)
    model = models.MLP(tuple(config.model.features), config.model.num_outputs, activation=nn.tanh)
    key, m = jax.random.key(0), config.model
    teacher = jax.eval_shape(model.init, key, jnp.zeros((1, m.num_inputs)))
    spec, d, n_steps = jax.ShapeDtypeStruct, config.data, config.schedule.num_steps
    train = {"x": spec((d.num_train, m.num_inputs), jnp.float32), "y": spec((d.num_train, m.num_outputs), jnp.float32)}  # fmt: skip
    idx = spec((n_steps, d.batch_size), jnp.int32)
    out = []
    for method in _methods(config):
        ad, (tx, orth) = common.eval_shape_with_static(
            lambda t, method=method: _pair(_method(config, method, t, key, n_steps, 0, None)), teacher
        )  # fmt: skip
        loss = _mse_loss(model, orth) if orth else _mse_loss(model)
        out.append(sweep.train_scan_step(method, ad, teacher, train, idx, loss_fn=loss, tx=tx))
    return out


def _pair(method):
    ad, tx, orth = method
    return ad, (tx, orth)


def _arm(temp: float) -> str:
    return f"sbvi_T={temp:g}"


def _trend_checks(config: Any, per: dict, table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """specs §8 (4) for SBVI at ``optim.temperature``; then what the diffusion (T > 0) buys."""
    true, sb = list(config.data.true_ranks), per[_arm(config.optim.temperature)]
    within = all(all(abs(a - b) <= 1 for a, b in zip(r["ranks"], true, strict=True)) for r in sb)
    checks = [sweep.check("SBVI ranks within ±1 of true (all seeds)", within)]
    kept = [min([v for v in s if v > 0] or [0.0]) for r in sb for s in r["spectra"].values()]
    checks.append(
        sweep.check(
            "spectral gap: smallest kept σ / largest pruned σ",
            f"pruned σ = 0 exactly; smallest kept σ = {min(kept):.3f}",
        )
    )
    sbvi_mse = np.mean([r["test_mse"] for r in sb])
    loras = [r for r in table if r["method"].startswith("lora")]
    best = min(
        [r for r in loras if r["trainable params"] <= sb[0]["params"]], key=lambda r: r["mean"]
    )
    name = f"SBVI MSE ≤ best LoRA at ≤ its params ({best['method']})"
    checks.append(sweep.check(name, bool(sbvi_mse <= best["mean"])))
    ada_mse = np.mean([r["test_mse"] for r in per["adalora"]])
    checks.append(sweep.check("SBVI MSE ≤ AdaLoRA", bool(sbvi_mse <= ada_mse)))
    smaller = sb[0]["opt_state"] < per["adalora"][0]["opt_state"]
    checks.append(sweep.check("SBVI optimizer state < AdaLoRA's", bool(smaller)))
    cold = per.get(_arm(0.0))
    for temp in config.optim.temperatures:
        if temp == 0 or cold is None:
            continue
        hot = per[_arm(temp)]
        d = [h["test_mse"] - c["test_mse"] for h, c in zip(hot, cold, strict=True)]
        miss = lambda rs: sum(abs(a - b) for r in rs for a, b in zip(r["ranks"], true, strict=True))
        checks.append(
            sweep.check(
                f"diffusion T={temp:g} vs T=0: test MSE lower (paired over seeds)",
                bool(np.mean(d) < 0),
                f"Δ = {np.mean(d):+.5f} (per seed {', '.join(f'{x:+.5f}' for x in d)}); "
                f"rank misses Σ|r − r*| {miss(hot)} vs {miss(cold)}",
            )
        )
    return checks


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs (or resumes) every cell; writes the table, trend checks and plot; returns headlines.

    LoRA and AdaLoRA run at their configured settings. Every SBVI arm (one per temperature in
    ``optim.temperatures``) gets the same budget: the frictions ``optim.friction_grid`` on the
    first seed, the one with the lowest validation MSE then on the other seeds.
    """
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    os.makedirs(workdir, exist_ok=True)
    cells = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    methods = [f"lora_r{r}" for r in config.adapter.lora_ranks] + ["adalora"]
    seeds = list(range(config.seed, config.seed + config.eval.num_seeds))
    cell = lambda m, s, **kw: cells.get(
        f"{m}/" + "".join(f"{k}={v:g}/" for k, v in kw.items()) + f"seed={s}",
        functools.partial(run_cell, config, m, s, **kw, options=options),
    )
    per = {m: [cell(m, s) for s in seeds] for m in methods}
    tuning, chosen = [], {}
    for temp in config.optim.temperatures:
        m = _arm(temp)
        grid = {lam: cell(m, seeds[0], friction=lam) for lam in config.optim.friction_grid}
        best = min(grid, key=lambda lam: grid[lam]["valid_mse"])
        chosen[m] = best
        per[m] = [grid[best]] + [cell(m, s, friction=best) for s in seeds[1:]]
        tuning += [
            {"arm": m, "friction": f"{lam:g}", "valid MSE": r["valid_mse"],
             "ranks": str(tuple(r["ranks"])), "chosen": lam == best}
            for lam, r in grid.items()
        ]  # fmt: skip
    cells.close()
    table = [
        {
            "method": m,
            "friction (chosen)": f"{chosen[m]:g}" if m in chosen else "",
            "valid MSE": sweep.format_mean_sd([r["valid_mse"] for r in res], 4),
            "test MSE": sweep.format_mean_sd([r["test_mse"] for r in res], 4),
            "ranks (per seed)": " ".join(str(tuple(r["ranks"])) for r in res),
            "trainable params": res[0]["params"],
            "optimizer state (floats)": res[0]["opt_state"],
            "mean": float(np.mean([r["test_mse"] for r in res])),
        }
        for m, res in per.items()
    ]
    spectra = per[_arm(config.optim.temperature)][0]["spectra"]
    curves = {n.split("/")[1]: (list(range(1, len(s) + 1)), s) for n, s in spectra.items()}
    common.plot_curves(
        os.path.join(workdir, "sbvi_spectra.png"), curves, title="final μ per layer (seed 0)",
        xlabel="mode", ylabel="σ",
    )  # fmt: skip
    checks = _trend_checks(config, per, table)
    out = sweep.write_sweep_results(
        workdir, table, checks,
        title=f"SBVI rank recovery: teacher-student, true ranks {tuple(config.data.true_ranks)}",
        columns=["method", "friction (chosen)", "valid MSE", "test MSE", "ranks (per seed)",
                 "trainable params", "optimizer state (floats)"],
        command=sweep.command_line(COMMAND),
    )  # fmt: skip
    cols = [(k, k) for k in ("arm", "friction", "valid MSE", "ranks", "chosen")]
    with open(os.path.join(workdir, "results.md"), "a") as f:
        f.write(f"\n\nTuning (seed {seeds[0]}, validation):\n\n")
        f.write(sweep.markdown_table(tuning, cols, digits=5) + "\n")
    return out
