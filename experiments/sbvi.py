"""SBVI rank discovery vs fixed-rank LoRA and AdaLoRA in a teacher-student problem (P8, specs §8).

A frozen random tanh MLP (the teacher) is the base model; the target adds ``ΔW*_l`` of known
ranks ``data.true_ranks`` to its kernels; regression on noisy Gaussian inputs. Methods: LoRA at
fixed ranks (Adam), AdaLoRA (:func:`lowrank_jax.optim.scale_by_adalora`) and SBVI
(:func:`lowrank_jax.optim.scale_by_sbvi`, ``adapter.r_max`` modes); reported: test MSE, recovered
ranks per layer, trainable parameters and optimizer-state size. Every (method, seed) is one cell
of :mod:`experiments.common.sweep` (``<workdir>/cells/``; a rerun skips finished cells).

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

__all__ = ["check_config", "run", "run_cell", "teacher_student"]

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
            mse = mse + orth_weight * optim.adalora_orthogonality(ad)
        return mse

    return loss


def _numeric_rank(delta: np.ndarray, ratio: float) -> int:
    s = np.linalg.svd(delta, compute_uv=False)
    return int(np.sum(s > ratio * s[0])) if s[0] > 0 else 0


def _state_size(tree: Any) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def _method(config: Any, method: str, teacher: Any, key: jax.Array, steps: int, seed: int):
    """``(adapters, optimizer, orthogonality weight)`` of ``"lora_r<k>"``, ``"adalora"``, ``"sbvi"``."""
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
        learning_rate=o.sbvi_lr, factor_learning_rate=o.sbvi_factor_lr, friction=o.friction,
        temperature=o.temperature, friction_warmup=int(o.friction_warmup * steps),
        anneal_steps=int(0.8 * steps), prune_start=int(o.prune_start * steps),
        prune_ratio=o.prune_ratio, seed=seed,
    )  # fmt: skip
    return adapters.init(key, teacher, rules), tx, 0.0


def run_cell(config: Any, method: str, seed: int) -> dict[str, Any]:
    """Trains one method on one seed's teacher-student problem.

    Returns ``{"test_mse", "final_train_loss", "ranks" (per layer, hidden first), "spectra"
    (final σ per layer), "params", "opt_state" (floats in the optimizer state)}``; the ranks are
    SBVI's / AdaLoRA's active modes, or LoRA's numeric rank (σ > ``optim.prune_ratio`` σ₁).
    """
    model, teacher, _, (xtr, ytr), (xte, yte) = teacher_student(config, seed)
    train = {"x": jnp.asarray(xtr), "y": jnp.asarray(ytr)}
    steps = config.schedule.num_steps
    idx = sweep.batch_indices(seed, len(ytr), config.data.batch_size, steps)
    ad, tx, orth = _method(config, method, teacher, jax.random.key(seed), steps, seed)
    loss = _mse_loss(model, orth) if orth else _mse_loss(model)
    p, state, trace = sweep.train_scan(ad, teacher, train, idx, loss_fn=loss, tx=tx)
    pred = adapters.adapt(model.apply)(teacher, p, xte)
    names = sorted(p)
    if method in ("sbvi", "adalora"):  # σ ≥ 0 for SBVI; AdaLoRA's Λ has signs
        found = (optim.sbvi_ranks if method == "sbvi" else optim.adalora_ranks)(state)
        ranks = [found[n] for n in names]
        sigma = {n: np.asarray(p[n].factors["s"]) for n in names}
        if method == "adalora":
            sigma = {n: np.abs(v) for n, v in sigma.items()}
        spectra = {n: np.sort(v)[::-1].tolist() for n, v in sigma.items()}
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
        "final_train_loss": float(trace[-1]),
        "ranks": [by_name[n] for n in order],
        "spectra": {n: spectra[n] for n in order},
        "params": adapters.count_params(ad),
        "opt_state": _state_size(state),
    }


def _trend_checks(config: Any, per: dict, table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """specs §8 (4): ranks recovered, pruned modes exactly 0, MSE and state vs LoRA, AdaLoRA."""
    true, sb = list(config.data.true_ranks), per["sbvi"]
    within = all(all(abs(a - b) <= 1 for a, b in zip(r["ranks"], true, strict=True)) for r in sb)
    checks = [sweep.check("SBVI ranks within ±1 of true (all seeds)", within)]
    gaps = []
    for r in sb:
        for s in r["spectra"].values():
            kept = [v for v in s if v > 0]
            gaps.append(min(kept) if kept else 0.0)
    checks.append(
        sweep.check(
            "spectral gap: smallest kept σ / largest pruned σ",
            f"pruned σ = 0 exactly; smallest kept σ = {min(gaps):.3f}",
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
    return checks


def run(config: Any, workdir: str) -> dict[str, Any]:
    """Runs (or resumes) every cell; writes the table, trend checks and plot; returns headlines."""
    os.makedirs(workdir, exist_ok=True)
    cells = sweep.CellStore(workdir, resume=config.ckpt.resume)
    methods = [f"lora_r{r}" for r in config.adapter.lora_ranks] + ["adalora", "sbvi"]
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    per = {
        m: [cells.get(f"{m}/seed={s}", functools.partial(run_cell, config, m, s)) for s in seeds]
        for m in methods
    }
    cells.close()
    table = [
        {
            "method": m,
            "test MSE": sweep.format_mean_sd([r["test_mse"] for r in res], 4),
            "ranks (per seed)": " ".join(str(tuple(r["ranks"])) for r in res),
            "trainable params": res[0]["params"],
            "optimizer state (floats)": res[0]["opt_state"],
            "mean": float(np.mean([r["test_mse"] for r in res])),
        }
        for m, res in per.items()
    ]
    spectra = per["sbvi"][0]["spectra"]
    curves = {n.split("/")[1]: (list(range(1, len(s) + 1)), s) for n, s in spectra.items()}
    common.plot_curves(
        os.path.join(workdir, "sbvi_spectra.png"), curves, title="final σ per layer (seed 0)",
        xlabel="mode", ylabel="σ",
    )  # fmt: skip
    return sweep.write_sweep_results(
        workdir, table, _trend_checks(config, per, table),
        title=f"SBVI rank recovery: teacher-student, true ranks {tuple(config.data.true_ranks)}",
        columns=["method", "test MSE", "ranks (per seed)", "trainable params",
                 "optimizer state (floats)"],
        command=sweep.command_line(COMMAND),
    )  # fmt: skip
