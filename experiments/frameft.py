"""FrameFT vs FourierFT, VeRA, LoRA and full fine-tuning at matched budgets (P10, specs §10).

An MLP 64-256-256-10 pre-trained on sklearn digits is adapted to rotated digits from 300
examples (:mod:`experiments.common.digits_shift`); FrameFT (frame ``L = 2``, ``L = 8``,
random-orthogonal and identity bases), FourierFT and VeRA at matched per-layer budgets, LoRA and
full fine-tuning. Each method's learning rate is picked on a validation split (seed 0), then
``eval.num_seeds`` seeds run on the test split. Every (method, lr, seed) is one cell of the shared
sweep helper (:mod:`experiments.common.sweep`): trained by one ``lax.scan``, stored in
``<workdir>/cells/`` (a rerun skips finished cells).

Outputs: ``results.md`` (table and trend checks, with the command), ``summary.json``,
``metrics.jsonl`` (one record per cell) and ``cells/``. FrameFT on the pretrained MiniLM is
``experiments/lora_finetune.py`` with ``adapter.kind = "frameft"`` (``configs/frameft.py:minilm``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.common import digits_shift, sweep
from lowrank_jax import adapters

__all__ = ["check_config", "methods", "run", "run_cell"]

COMMAND = "python -m experiments.train --config=configs/frameft.py"


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    sweep.check_config(config)
    c.check_positive(config, "data.num_valid", integer=True)
    c.check_fraction(config, "data.noise", allow_zero=True)
    c.check_positive(config, "model.pretrain_steps", integer=True)
    for name in ("adapter.budgets", "adapter.lora_ranks"):
        c.check_positive_ints(config, name)
    for name in ("optim.lr_grid_coeff", "optim.lr_grid_lora", "optim.lr_grid_full"):
        if not c.get_path(config, name):
            raise c.ConfigError(f"config.{name} is empty: give at least one learning rate")


def methods(config: Any) -> list[tuple[str, int | None, Callable[[], Any] | None]]:
    """``(name, budget, spec factory)`` rows; ``budget=None`` for budget-free rows, no factory
    for full fine-tuning."""
    a = config.adapter
    rows = []
    for b in a.budgets:
        rows += [
            (f"frameft_L2@{b}", b, lambda b=b: adapters.frameft(b, l=2, scale=a.frame_scale)),
            (f"frameft_L8@{b}", b, lambda b=b: adapters.frameft(b, l=8, scale=a.frame_scale)),
            (
                f"frameft_random@{b}",
                b,
                lambda b=b: adapters.frameft(b, basis="random", scale=a.frame_scale),
            ),
            (
                f"frameft_identity@{b}",
                b,
                lambda b=b: adapters.frameft(b, basis="identity", scale=a.frame_scale),
            ),
            (f"fourierft@{b}", b, lambda b=b: adapters.fourierft(b, scale=a.fourier_scale)),
            (f"vera@{b}", b, lambda b=b: adapters.vera(b)),
        ]
    for r in a.lora_ranks:
        rows.append((f"lora_r{r}", None, lambda r=r: adapters.lora(r, alpha=2.0 * r)))
    rows.append(("full", None, None))
    return rows


def _lr_grid(config: Any, name: str) -> tuple[float, ...]:
    """The learning rates tried for a method (coefficient methods need larger ones)."""
    if name == "full":
        return tuple(config.optim.lr_grid_full)
    if name.startswith("lora"):
        return tuple(config.optim.lr_grid_lora)
    return tuple(config.optim.lr_grid_coeff)


@functools.cache
def _full_loss(model):
    def loss(v, _, batch):
        return digits_shift.xent(model.apply(v, batch["x"]), batch["y"])

    return loss


def run_cell(
    config: Any, make_spec, lr: float, seed: int, *, valid: bool, options: common.TrainOptions
) -> dict[str, Any]:
    """Trains one method at one learning rate and seed (``train_scan`` with the run's
    ``options``); its accuracy on the valid or test split.

    Returns ``{"accuracy", "final_train_loss", "params"}`` and, for FrameFT, ``"delta_flops"``
    (the multiply-adds of forming ``ΔW`` over the adapted kernels).
    """
    model, variables, _ = digits_shift.source_model(config, options)
    _, tr, va, te = digits_shift.digits_domains(
        seed, num_train=config.data.num_train, noise=config.data.noise,
        num_valid=config.data.num_valid,
    )  # fmt: skip
    ev = va if valid else te
    train = {"x": jnp.asarray(tr[0]), "y": jnp.asarray(tr[1])}
    idx = sweep.batch_indices(seed, len(tr[1]), config.data.batch_size, config.schedule.num_steps)
    tx, out = sweep.adam(lr), {}
    if make_spec is None:  # full fine-tuning
        p, _, trace = sweep.train_scan(
            variables, None, train, idx, loss_fn=_full_loss(model), tx=tx, options=options
        )
        logits = model.apply(p, ev[0])
        n_params = adapters.count_params(variables)
    else:
        spec = make_spec()
        ad = adapters.init(jax.random.key(seed), variables, [(config.adapter.targets, spec)])
        loss = digits_shift.adapter_loss(model)
        p, _, trace = sweep.train_scan(
            ad, variables, train, idx, loss_fn=loss, tx=tx, options=options
        )
        logits = adapters.adapt(model.apply)(variables, p, ev[0])
        n_params = adapters.count_params(ad)
        if isinstance(spec, adapters.FrameFT):
            out["delta_flops"] = sum(spec.delta_flops(*a.matrix) for a in ad.values())
    return {
        "accuracy": digits_shift.accuracy(logits, ev[1]),
        "final_train_loss": float(trace[-1]),
        "params": n_params,
        **out,
    }


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The source MLP's pre-training and every method's ``train_scan`` (at its first learning
    rate), on abstract inputs (no data)."""
    del mesh  # the sweep's programs run on one device
    check_config(config)
    model, variables, pretrain = digits_shift.pretrain_step(config)
    out = [pretrain]
    for name, _, make in methods(config):
        lr = _lr_grid(config, name)[0]
        if make is None:
            spec, n = jax.ShapeDtypeStruct, config.data.num_train
            train = {"x": spec((n, 8, 8, 1), jnp.float32), "y": spec((n,), jnp.int32)}
            idx = spec((config.schedule.num_steps, config.data.batch_size), jnp.int32)
            out.append(sweep.train_scan_step(name, variables, None, train, idx, loss_fn=_full_loss(model), tx=sweep.adam(lr)))  # fmt: skip
            continue
        rules = [(config.adapter.targets, make())]
        ad = jax.eval_shape(lambda v, rules=rules: adapters.init(jax.random.key(0), v, rules), variables)  # fmt: skip
        out.append(digits_shift.adapter_scan_step(name, config, model, ad, variables, lr=lr))
    return out


def _trend_checks(config: Any, table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """specs §10 (4): frame vs FourierFT and identity, L = 8 vs L = 2, vs LoRA and full FT."""
    by = {(r["method"], r["budget/layer"]): r for r in table}
    budgets = list(config.adapter.budgets)
    checks = []
    for b in budgets:
        fl2, fl8 = by[("frameft_L2", b)], by[("frameft_L8", b)]
        gap = abs(fl2["mean"] - by[("fourierft", b)]["mean"])
        checks.append(sweep.check(f"L2≈FourierFT@{b} (|Δ|≤0.02)", gap <= 0.02))
        ident = by[("frameft_identity", b)]["mean"]
        checks.append(sweep.check(f"frame≥identity@{b}", fl2["mean"] >= ident - 0.005))
        checks.append(sweep.check(f"L8 loses ≤0.02@{b}", fl8["mean"] >= fl2["mean"] - 0.02))
        ratio = round(fl2["ΔW FLOPs"] / fl8["ΔW FLOPs"], 2)
        checks.append(sweep.check(f"L8 FLOPs ratio@{b}", ratio))
    loras = [r for r in table if r["method"].startswith("lora")]
    lora_min = min(loras, key=lambda r: r["trainable params"])
    n_min = lora_min["trainable params"]
    for b in [b for b in budgets if by[("frameft_L2", b)]["trainable params"] < n_min]:
        for m in ("frameft_L2", "fourierft"):
            row = by[(m, b)]
            name = f"{m}@{b} ({row['trainable params']} params) > {lora_min['method']} ({n_min})"
            checks.append(sweep.check(name, row["mean"] > lora_min["mean"]))
    full = by[("full", "")]["mean"]
    top = by[("frameft_L2", max(budgets))]["mean"]
    checks.append(sweep.check(f"frameft@{max(budgets)} within 0.03 of full FT", top >= full - 0.03))
    return checks


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs (or resumes) every cell; writes the table and trend checks; returns the headlines."""
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    os.makedirs(workdir, exist_ok=True)
    cells = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    _, _, src_acc = digits_shift.source_model(config, options)
    table = []
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    for name, budget, make in methods(config):
        # The learning rate is picked on the validation split with seed 0.
        val = {
            lr: cells.get(
                f"{name}/lr={lr}/valid",
                functools.partial(run_cell, config, make, lr, 0, valid=True, options=options),
            )["accuracy"]
            for lr in _lr_grid(config, name)
        }
        lr = max(val, key=val.get)
        res = [
            cells.get(
                f"{name}/lr={lr}/seed={s}",
                functools.partial(run_cell, config, make, lr, s, valid=False, options=options),
            )
            for s in seeds
        ]
        acc = [r["accuracy"] for r in res]
        table.append(
            {
                "method": name.split("@")[0],
                "budget/layer": budget if budget is not None else "",
                "trainable params": res[0]["params"],
                "lr": lr,
                "test accuracy": sweep.format_mean_sd(acc),
                "mean": float(np.mean(acc)),
                "ΔW FLOPs": res[0].get("delta_flops", ""),
            }
        )
    cells.close()
    return sweep.write_sweep_results(
        workdir, table, _trend_checks(config, table),
        title="FrameFT vs baselines: rotated digits, MLP 64-256-256-10",
        columns=["method", "budget/layer", "trainable params", "lr", "test accuracy", "ΔW FLOPs"],
        command=sweep.command_line(COMMAND),
        extra={"source_accuracy": src_acc},
    )  # fmt: skip
