"""LoRA-DA vs the LoRA initialisers on a shifted digits domain (P6, specs §6).

An MLP 64-128-128-10 pre-trained on sklearn digits is adapted to rotated digits with 20% pixel
noise from 300 examples (:mod:`experiments.common.digits_shift`); LoRA on the two hidden layers
at ranks ``adapter.ranks`` from the vanilla, PiSSA, LoRA-GA, LoRA-One, EVA and LoRA-DA
(``adapter.betas``, and from ``adapter.small_sample`` examples) initialisations
(:mod:`lowrank_jax.adapters`); Adam for ``schedule.num_steps`` steps. Reported per cell: the
training loss at 0 and after ``eval.loss_steps`` steps, test accuracy, and the initialisation's
time relative to training. Every (rank, init, seed) is one cell of
:mod:`experiments.common.sweep` (``<workdir>/cells/``; a rerun skips finished cells).

Outputs: ``results.md`` (table and trend checks, with the command), ``summary.json``,
``metrics.jsonl``, ``init_loss.png`` (training loss vs steps at the largest rank) and ``cells/``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.common import digits_shift, sweep
from lowrank_jax import adapters

__all__ = ["check_config", "initializers", "run", "run_cell"]

COMMAND = "python -m experiments.train --config=configs/lora_da.py"
_UNFOLD = {"pissa", "lora_ga"}  # initialisers that move W: train on the residual base


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    sweep.check_config(config)
    c.check_fraction(config, "data.noise", allow_zero=True)
    c.check_positive(config, "model.pretrain_steps", integer=True)
    c.check_positive_ints(config, "adapter.ranks")
    # Step counts beyond schedule.num_steps report the final loss.
    c.check_positive_ints(config, "eval.loss_steps")
    if c.get_path(config, "adapter.default_beta") not in c.get_path(config, "adapter.betas"):
        raise c.ConfigError("config.adapter.default_beta must be one of config.adapter.betas")


def initializers(config: Any) -> list[tuple[str, Callable | None]]:
    """``(name, initialiser)`` rows; ``None`` is ``adapters.init`` (vanilla LoRA, and PiSSA as
    ``lora(init="pissa")``)."""
    d = config.adapter
    rows = [("vanilla", None), ("pissa", None), ("lora_ga", adapters.lora_ga)]
    rows += [("lora_one", adapters.lora_one), ("eva", adapters.eva)]
    for beta in d.betas:
        rows.append((f"lora_da_b{beta}", functools.partial(adapters.lora_da, beta=beta)))
    for g in d.extra_gammas:  # the recipe's γ = 1024 scales the initial factors down by 1/√γ
        rows.append(
            (
                f"lora_da_b{d.default_beta}_g{g:g}",
                functools.partial(adapters.lora_da, beta=d.default_beta, gamma=g),
            )
        )
        rows.append((f"lora_one_g{g:g}", functools.partial(adapters.lora_one, gamma=g)))
    for damp in d.extra_dampings:  # δ = 1e-6 lets badly estimated directions dominate Z⁻¹, F⁻¹
        g = d.extra_gammas[0] if d.extra_gammas else 1024.0
        rows.append(
            (
                f"lora_da_b{d.default_beta}_g{g:g}_d{damp:g}",
                functools.partial(adapters.lora_da, beta=d.default_beta, gamma=g, damping=damp),
            )
        )
    for beta in d.small_sample_betas:
        rows.append(
            (
                f"lora_da_b{beta}_S{d.small_sample}",
                functools.partial(
                    adapters.lora_da,
                    beta=beta,
                    num_grad_examples=d.small_sample,
                    num_fisher_examples=d.small_sample,
                ),  # fmt: skip
            )
        )
    return rows


@functools.cache
def _apply_fn(model):
    return model.apply


def _stat_loss(fwd, batch):
    return digits_shift.xent(fwd(batch["x"]), batch["y"])


def _rules(config: Any, rank: int, init: str = "kaiming") -> list[tuple[Any, Any]]:
    a = config.adapter
    return [(a.targets, adapters.lora(rank, alpha=a.alpha, rslora=a.rslora, init=init))]


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """On abstract inputs (no data): the source MLP's pre-training and, per rank, the adapters'
    ``train_scan`` (the same program after every initialiser; the initialisers run eagerly, some
    with host-side choices, e.g. EVA's rank allocation)."""
    del mesh  # the sweep's programs run on one device
    check_config(config)
    model, variables, pretrain = digits_shift.pretrain_step(config)
    key, out = jax.random.key(0), [pretrain]
    for rank in config.adapter.ranks:
        rules = _rules(config, rank)
        ad = jax.eval_shape(lambda v, rules=rules: adapters.init(key, v, rules), variables)
        lr = config.optim.learning_rate
        out.append(digits_shift.adapter_scan_step(f"r={rank} train", config, model, ad, variables, lr=lr))  # fmt: skip
    return out


def run_cell(
    config: Any, name: str, init_fn, rank: int, seed: int, *, options: common.TrainOptions
) -> dict[str, Any]:
    """One initialiser at one rank and seed: losses along training, test accuracy, timings
    (``train_scan`` with the run's ``options``)."""
    model, variables, _ = digits_shift.source_model(config, options)
    _, tr, _, te = digits_shift.digits_domains(
        seed, num_train=config.data.num_train, noise=config.data.noise
    )
    train = {"x": jnp.asarray(tr[0]), "y": jnp.asarray(tr[1])}
    rules = _rules(config, rank)
    key = jax.random.key(seed)

    def make():
        if init_fn is None:
            init = "pissa" if name == "pissa" else "kaiming"
            return adapters.init(key, variables, _rules(config, rank, init=init))
        return init_fn(
            key, variables, rules, train, apply_fn=_apply_fn(model), loss_fn=_stat_loss,
            **({"num_train": len(tr[1])} if name.startswith("lora_da") else {}),
        )  # fmt: skip

    ad = make()  # the first call compiles; time a second one
    jax.block_until_ready(ad)
    t0 = time.perf_counter()
    ad = make()
    jax.block_until_ready(ad)
    init_s = time.perf_counter() - t0
    base = adapters.unfold(variables, ad) if name in _UNFOLD else variables
    steps = config.schedule.num_steps
    idx = sweep.batch_indices(seed, len(tr[1]), config.data.batch_size, steps)
    kw = dict(loss_fn=digits_shift.adapter_loss(model), tx=sweep.adam(config.optim.learning_rate))
    sweep.train_scan(ad, base, train, idx, **kw, options=options)[2].block_until_ready()  # compile
    t0 = time.perf_counter()
    p, _, trace = sweep.train_scan(ad, base, train, idx, **kw, options=options)
    trace.block_until_ready()
    train_s = time.perf_counter() - t0
    logits = adapters.adapt(model.apply)(base, p, te[0])
    out = {
        "loss@0": float(digits_shift.adapter_loss(model)(ad, base, train)),
        "accuracy": digits_shift.accuracy(logits, te[1]),
        "init_s": init_s,
        "train_s": train_s,
    }
    for k in config.eval.loss_steps:
        out[f"loss@{k}"] = float(trace[min(k, steps) - 1])
    return out


def _mean(res: list[dict[str, Any]], key: str) -> float:
    return float(np.mean([r[key] for r in res]))


def _trend_checks(config: Any, per: dict) -> list[dict[str, Any]]:
    """specs §6 (4): LoRA-DA best (or within 1 sd of LoRA-One), a lower early loss, β at small
    S, and an initialisation overhead below 10% of training."""
    d, checks = config.adapter, []
    main = f"lora_da_b{d.default_beta}"
    early_key = f"loss@{config.eval.loss_steps[0]}"
    names = [n for n, _ in initializers(config)]
    for rank in d.ranks:
        acc = {n: _mean(per[(rank, n)], "accuracy") for n in names}
        sd_one = sweep.mean_sd([r["accuracy"] for r in per[(rank, "lora_one")]])[1]
        best = max(acc, key=acc.get)
        checks.append(sweep.check(f"r={rank}: best init", f"{best} ({acc[best]:.3f})"))
        ok = acc[main] >= max(acc.values()) - 1e-9 or acc[main] >= acc["lora_one"] - sd_one
        checks.append(sweep.check(f"r={rank}: LoRA-DA best or ties LoRA-One (1 sd)", bool(ok)))
        early = {n: _mean(per[(rank, n)], early_key) for n in (main, "vanilla", "lora_ga")}
        ok = early[main] < early["vanilla"] and early[main] < early["lora_ga"]
        checks.append(sweep.check(f"r={rank}: early loss LoRA-DA < vanilla, LoRA-GA", bool(ok)))
    small = f"_S{d.small_sample}"
    if 0.0 in d.small_sample_betas and f"{main}{small}" in names:
        for rank in d.ranks:

            def gain(tag, rank=rank):
                return _mean(per[(rank, f"{main}{tag}")], "accuracy") - _mean(
                    per[(rank, f"lora_da_b0.0{tag}")], "accuracy"
                )

            checks.append(
                sweep.check(
                    f"r={rank}: β gain at S={d.small_sample} vs S=256",
                    f"{gain(small):+.4f} vs {gain(''):+.4f}",
                )
            )
    overhead = max(np.mean([r["init_s"] / r["train_s"] for r in per[(k, main)]]) for k in d.ranks)
    checks.append(sweep.check("LoRA-DA init overhead < 10% of training", bool(overhead < 0.10)))
    return checks


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs (or resumes) every cell; writes the table, trend checks and plot; returns headlines."""
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    os.makedirs(workdir, exist_ok=True)
    cells = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    _, _, src_acc = digits_shift.source_model(config, options)
    table, per = [], {}
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    loss_cols = ["loss@0", *(f"loss@{k}" for k in config.eval.loss_steps)]
    for rank in config.adapter.ranks:
        for name, fn in initializers(config):
            res = [
                cells.get(
                    f"r={rank}/{name}/seed={s}",
                    functools.partial(run_cell, config, name, fn, rank, s, options=options),
                )
                for s in seeds
            ]
            per[(rank, name)] = res
            row = {"rank": rank, "init": name}
            for k in loss_cols:
                row[k] = sweep.format_mean_sd([r[k] for r in res])
            row["test accuracy"] = sweep.format_mean_sd([r["accuracy"] for r in res])
            row["init / train time"] = f"{np.mean([r['init_s'] / r['train_s'] for r in res]):.1%}"
            row["mean"] = _mean(res, "accuracy")
            table.append(row)
    cells.close()
    _plot(workdir, config, per)
    return sweep.write_sweep_results(
        workdir, table, _trend_checks(config, per),
        title="LoRA initialisers: rotated + noisy digits, MLP 64-128-128-10, 300 examples",
        columns=["rank", "init", *loss_cols, "test accuracy", "init / train time"],
        command=sweep.command_line(COMMAND), extra={"source_accuracy": src_acc},
    )  # fmt: skip


def _plot(workdir: str, config: Any, per: dict) -> None:
    rank = max(config.adapter.ranks)
    ks = [0, *config.eval.loss_steps]
    curves = {
        n: (ks, [_mean(res, f"loss@{k}") for k in ks]) for (r, n), res in per.items() if r == rank
    }
    common.plot_curves(
        os.path.join(workdir, "init_loss.png"), curves, title=f"train loss, rank {rank}",
        ylabel="loss", logy=True,
    )  # fmt: skip
