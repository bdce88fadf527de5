"""Extra-Merge (P5) on a character-level GPT trained on Shakespeare, against LAWA, EMA, ExPO, WSD.

For each optimizer (AdamW, Muon) and seed, ``run`` trains the char-GPT of ``lowrank_jax.models``
at a constant learning rate through ``experiments.common.fit``, keeping the checkpoints of the
last ``schedule.window_fraction`` of training (``schedule.num_checkpoints`` of them); a second run
branches off the constant run at the window's start (its checkpoint is copied, ``fit`` resumes
from it) and decays the learning rate linearly to 0 over the same window (a real WSD decay).
The saved checkpoints are read back lazily (``CheckpointSequence``) and merged with
``lowrank_jax.merging``: last checkpoint, LAWA, EMA, ExPO, Extra-Merge with α from a forward-only
line search on the validation split, and Extra-Merge with the default α (no data). Every merge's
hyper-parameter (LAWA window, EMA decay, ExPO α, Extra-Merge window and α) is chosen on the
validation split; test loss is reported.

Each (optimizer, seed) is a cell, stored by :class:`experiments.common.sweep.CellStore` as
``cells/<opt>_s<seed>.json`` (a rerun reads a finished cell back; its trainings live in
``runs/<opt>_s<seed>/{const,wsd}``, fit's workdirs, deleted once the cell is stored unless
``ckpt.keep_runs``). Writes ``config.json``, ``results.md``/``results.json`` and
``loss_vs_alpha_<opt>.png``.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common import sweep
from experiments.common.checkpoint_reader import CheckpointSequence, saved_steps
from lowrank_jax import data, merging, models
from lowrank_jax.merging import averaging

__all__ = ["check_config", "run"]

OPTIMIZERS = ("adamw", "muon")


def check_config(config: Any) -> None:
    """Validates ``config``; raises ``common.ConfigError`` naming the bad key."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    c.check_positive(config, "num_seeds", integer=True)
    for name in config.optim.names:
        if name not in OPTIMIZERS:
            raise c.ConfigError(f"config.optim.names has {name!r}: allowed are {OPTIMIZERS}")
    for path in ("data.seq_len", "data.batch_size", "data.max_passages_per_play"):
        c.check_positive(config, path, integer=True)
    for path in ("model.dim", "model.depth", "model.heads", "eval.batch_size"):
        c.check_positive(config, path, integer=True)
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    c.check_fraction(config, "data.test_fraction", allow_zero=False)
    c.check_fraction(config, "schedule.window_fraction", allow_zero=False)
    steps = c.check_positive(config, "schedule.num_steps", integer=True)
    n = c.check_positive(config, "schedule.num_checkpoints", integer=True)
    window_steps = round(config.schedule.window_fraction * steps)
    if window_steps % n:
        raise c.ConfigError(
            f"schedule.window_fraction * num_steps = {window_steps} steps must be divisible by "
            f"schedule.num_checkpoints={n} (one checkpoint every window/N steps)"
        )
    if c.check_nonnegative(config, "schedule.warmup_steps", integer=True) >= steps - window_steps:
        raise c.ConfigError("schedule.warmup_steps must end before the merge window starts")
    for w in (*config.merge.extra_windows, *config.merge.lawa_windows, *config.merge.rho_windows):
        if not 1 <= w < n:
            raise c.ConfigError(f"merge windows must be in [1, {n - 1}]; got {w}")
    for b in config.merge.ema_decays:
        if not 0 <= b < 1:
            raise c.ConfigError(f"config.merge.ema_decays has {b}: must be in [0, 1)")
    c.check_positive(config, "merge.alpha_step")
    c.check_positive(config, "merge.sketch_dim", integer=True)


# ----------------------------------------------------------------------------------------------
# Data, model, optimizer.


def load_text(config: Any) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """Character sequences (n, T + 1) of the First Folio, split by passage; the vocabulary."""
    dataset = data.load_shakespeare(
        label="play",
        passage_chars=config.data.seq_len + 1,
        max_passages_per_play=config.data.max_passages_per_play,
        seed=0,
    )
    vocab = tuple(sorted(set("".join(dataset.x))))
    table = {ch: i for i, ch in enumerate(vocab)}
    splits = data.split(
        dataset,
        seed=0,
        valid_fraction=config.data.valid_fraction,
        test_fraction=config.data.test_fraction,
    )
    encode = lambda xs: np.asarray([[table[ch] for ch in s] for s in xs], np.int32)  # noqa: E731
    return {k: encode(getattr(splits, k).x) for k in ("train", "valid", "test")}, vocab


def _schedule(config: Any, name: str, *, decay: bool) -> optax.Schedule:
    """Warmup, then constant; with ``decay`` a linear decay to 0 over the merge window (WSD)."""
    peak = config.optim.learning_rates[OPTIMIZERS.index(name)]
    steps = config.schedule.num_steps
    start = steps - round(config.schedule.window_fraction * steps)
    warm = optax.linear_schedule(0.0, peak, max(config.schedule.warmup_steps, 1))
    tail = optax.linear_schedule(peak, 0.0 if decay else peak, steps - start)
    flat = optax.constant_schedule(peak)
    return optax.join_schedules([warm, flat, tail], [config.schedule.warmup_steps, start])


def _optimizer(config: Any, name: str, *, decay: bool) -> optax.GradientTransformation:
    lr = _schedule(config, name, decay=decay)
    wd = config.optim.weight_decay
    if name == "adamw":
        tx = optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=wd)
    else:
        adam_lr = _schedule(config, "adamw", decay=decay)
        tx = optax.contrib.muon(
            lr, weight_decay=wd, adam_learning_rate=adam_lr, adam_b2=0.95, adam_weight_decay=wd
        )
    return optax.chain(optax.clip_by_global_norm(1.0), tx)


def _lm_loss(model: Any, params: Any, seqs: jax.Array) -> jax.Array:
    logits = model.apply({"params": params}, seqs[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()


def _loss_chunk(model: Any):
    """The jitted ``chunk(params, x, weight)``: the weighted sum of per-sequence losses."""

    @jax.jit
    def chunk(params, x, weight):
        logits = model.apply({"params": params}, x[:, :-1])
        per_seq = optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean(-1)
        return jnp.sum(per_seq * weight)

    return chunk


def make_loss_fn(model: Any, seqs: np.ndarray, *, batch_size: int):
    """params -> mean next-character loss (nats) over all of ``seqs``, forward passes only."""
    chunk = _loss_chunk(model)
    chunks = list(common.padded_batches({"x": seqs, "y": np.zeros(len(seqs))}, batch_size))

    def loss_fn(params):
        return sum(float(chunk(params, c["x"], w)) for c, w in chunks) / len(seqs)

    return loss_fn


# ----------------------------------------------------------------------------------------------
# One optimizer and seed: train (constant and WSD), then merge.


def _lm_step(model: Any, tx: optax.GradientTransformation):
    """The ``fit`` step of the character LM: next-character cross-entropy, ``tx``'s update."""

    def step(state, frozen, batch, key):
        del frozen, key
        loss, grads = jax.value_and_grad(lambda p: _lm_loss(model, p, batch["x"]))(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {"loss": loss}

    return step


def _model(config: Any, vocab_size: int) -> Any:
    m = config.model
    return models.CharGPT(vocab_size, m.dim, m.depth, m.heads, config.data.seq_len)


# The lowering's vocabulary size: the run's is the number of distinct characters in the text it
# reads; only the sizes of the embedding and the output layer depend on it.
_NOMINAL_VOCAB = 80


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The ``fit`` steps (constant and WSD schedules per optimizer) and the evaluation chunk, on
    abstract inputs (no text read; a nominal vocabulary of 80 characters)."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    model = _model(config, _NOMINAL_VOCAB)
    seq = config.data.seq_len + 1
    x = jax.ShapeDtypeStruct((config.data.batch_size, seq), jnp.int32)
    params = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, seq - 1), jnp.int32))["params"], jax.random.key(0)
    )
    out = []
    for name in config.optim.names:
        for decay in (False, True):
            tx = _optimizer(config, name, decay=decay)
            state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": 0}
            label = f"{name}/{'wsd' if decay else 'const'}"
            out.append(common.fit_step(_lm_step(model, tx), state, None, {"x": x}, mesh=mesh, name=label))  # fmt: skip
    b = config.eval.batch_size
    chunk = (params, jax.ShapeDtypeStruct((b, seq), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32))  # fmt: skip
    return [*out, common.Step("eval chunk", _loss_chunk(model), chunk)]


def _train(config, model, arrays, name, seed, workdir, *, decay, phases, options):
    """Trains through ``common.fit`` in ``phases`` = ((until_step, ckpt_every), ...): each phase
    resumes from the previous one's checkpoint, so the interval can tighten in the window."""
    tx = _optimizer(config, name, decay=decay)

    def init_state():  # fresh each phase: fit donates the state it is given
        params = model.init(jax.random.key(seed), arrays["train"][:1, :-1])["params"]
        return {"params": params, "opt_state": tx.init(params), "step": 0}

    keep = config.schedule.num_checkpoints + 1
    step = _lm_step(model, tx)
    for until, every in phases:
        result = common.fit(
            init_state(),
            None,
            step,
            data.BatchIterator(
                {"x": arrays["train"]}, batch_size=config.data.batch_size, seed=seed
            ),
            key=jax.random.key(seed),
            num_steps=until,
            workdir=workdir,
            log_every=min(config.log.every, until),
            ckpt_every=every,
            max_to_keep=keep,
            progress=config.log.progress,
            description=f"{name}/s{seed}/{'wsd' if decay else 'const'}",
            options=options,
        )
    return result


def _best(losses: dict[Any, float]) -> tuple[Any, float]:
    key = min(losses, key=losses.get)
    return key, losses[key]


def _cell(config, model, arrays, name, seed, root, options) -> dict[str, Any]:
    const_dir = os.path.join(root, "const")
    wsd_dir = os.path.join(root, "wsd")
    n = config.schedule.num_checkpoints
    total = config.schedule.num_steps
    start = total - round(config.schedule.window_fraction * total)
    every = (total - start) // n
    train = functools.partial(_train, config, model, arrays, name, seed, options=options)
    const = train(const_dir, decay=False, phases=((start, start), (total, every)))
    steps = saved_steps(os.path.join(const_dir, "checkpoints"))[-(n + 1) :]
    if steps[0] != start:
        raise RuntimeError(f"expected checkpoints from step {start} on in {const_dir}: {steps}")
    # WSD: branch off the constant run at the window's start, decay over the window.
    branch = os.path.join(wsd_dir, "checkpoints", str(steps[0]))
    if not os.path.exists(os.path.join(wsd_dir, "checkpoints")):
        shutil.copytree(os.path.join(const_dir, "checkpoints", str(steps[0])), branch)
    wsd = train(wsd_dir, decay=True, phases=((total, total),))

    ckpt_dir = os.path.join(const_dir, "checkpoints")
    ckpts = list(CheckpointSequence(ckpt_dir, target=const.state, steps=steps[1:]))  # θ_1 ... θ_N
    valid = make_loss_fn(model, arrays["valid"], batch_size=config.eval.batch_size)
    test = make_loss_fn(model, arrays["test"], batch_size=config.eval.batch_size)
    m = config.merge
    key = jax.random.key(seed)
    chosen: dict[str, tuple[str, Any]] = {"last": ("", ckpts[-1])}
    lawa = {w: merging.lawa(ckpts, window=w) for w in m.lawa_windows}
    lawa_valid = {w: valid(p) for w, p in lawa.items()}
    w, _ = _best(lawa_valid)
    chosen["LAWA"] = (f"W={w}", lawa[w])
    ema = {b: merging.ema(ckpts, decay=b) for b in m.ema_decays}
    b, _ = _best({b: valid(p) for b, p in ema.items()})
    chosen["EMA"] = (f"decay={b}", ema[b])
    expo = {a: averaging.expo(ckpts[-2], ckpts[-1], alpha=a) for a in m.expo_alphas}
    a, _ = _best({a: valid(p) for a, p in expo.items()})
    chosen["ExPO"] = (f"alpha={a}", expo[a])
    curves, searches = {}, {}
    for w in m.extra_windows:
        line = merging.extra_merge_line(ckpts, window=w, key=key, sketch_dim=m.sketch_dim)
        grid = np.arange(0.0, 4 * merging.default_alpha(w) + 1e-9, m.alpha_step)
        searches[w] = (line, merging.line_search(valid, line, alphas=grid))
        curves[str(w)] = {"alpha": grid.tolist(), "valid_loss": searches[w][1].losses.tolist()}
    w = min(searches, key=lambda w: searches[w][1].best_loss)
    line, search = searches[w]
    chosen["Extra-Merge(α*)"] = (f"W={w}, alpha={search.best_alpha}", line.at(search.best_alpha))
    w0 = max(m.extra_windows)
    chosen["Extra-Merge(default α)"] = (
        f"W={w0}, alpha={merging.default_alpha(w0)}",
        searches[w0][0].at(merging.default_alpha(w0)),
    )
    chosen["WSD decay"] = ("", wsd.state["params"])
    sketch = searches[w0][0].sketch
    rho = {f"rho1_W{w}": merging.trajectory_pca(sketch, window=w).rho1 for w in m.rho_windows}
    return {
        "optimizer": name,
        "seed": seed,
        **rho,
        "sketch_exact": bool(sketch.exact),
        "test": {k: test(p) for k, (_, p) in chosen.items()},
        "valid": {k: valid(p) for k, (_, p) in chosen.items()},
        "lawa_valid": {str(w): v for w, v in lawa_valid.items()},
        "choice": {k: c for k, (c, _) in chosen.items()},
        "alpha_curves": curves,
        "rates": {str(w): float(searches[w][0].pca.rate) for w in searches},
    }


# ----------------------------------------------------------------------------------------------
# The run.

METHODS = ("last", "EMA", "LAWA", "ExPO", "Extra-Merge(α*)", "Extra-Merge(default α)", "WSD decay")


def _summary(config, cells) -> tuple[list[dict], list[str]]:
    rows, checks = [], []
    for name in config.optim.names:
        group = [c for c in cells if c["optimizer"] == name]
        if not group:
            continue
        row = {"optimizer": name}
        for r in config.merge.rho_windows:
            vals = np.asarray([c[f"rho1_W{r}"] for c in group])
            row[f"ρ₁ W={r}"] = f"{vals.mean():.3f} ± {vals.std():.3f}"
        for meth in METHODS:
            vals = np.asarray([c["test"][meth] for c in group])
            row[meth] = f"{vals.mean():.4f} ± {vals.std():.4f}"
        rows.append(row)
        em = np.asarray([c["test"]["Extra-Merge(α*)"] for c in group])
        beats = sum(
            (e < c["test"]["LAWA"]) and (e < c["test"]["EMA"])
            for e, c in zip(em, group, strict=True)
        )
        rho_m = np.mean([c[f"rho1_W{max(config.merge.rho_windows)}"] for c in group])
        rho_r = np.mean([c[f"rho1_W{min(config.merge.rho_windows)}"] for c in group])
        alphas = [float(c["choice"]["Extra-Merge(α*)"].split("alpha=")[1]) for c in group]
        need = max(1, len(group) - 1)
        checks += [
            f"- {name}: ρ₁(merged, W={max(config.merge.rho_windows)}) = {rho_m:.3f} vs raw "
            f"{rho_r:.3f}: {'reproduced' if rho_m > 0.9 and rho_m > rho_r else 'NOT reproduced'}"
            " (ρ₁ > 0.9 and above raw).",
            f"- {name}: Extra-Merge(α*) below LAWA and EMA on {beats}/{len(group)} seeds: "
            f"{'reproduced' if beats >= need else 'NOT reproduced'} (needs {need}).",
            f"- {name}: best α per seed {alphas}: "
            f"{'> 0 on every seed' if min(alphas) > 0 else 'α* = 0 on some seed'}.",
        ]
    return rows, checks


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Trains, merges and evaluates every (optimizer, seed); writes the tables and plots."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    workdir = os.fspath(workdir)
    arrays, vocab = load_text(config)
    logging.info(
        "char-LM data: %s, vocabulary %d", {k: v.shape for k, v in arrays.items()}, len(vocab)
    )
    model = _model(config, len(vocab))
    store = sweep.CellStore(workdir, options=options, log_metrics=False)
    cells = []
    for seed in range(config.seed, config.seed + config.num_seeds):  # seed-major: a partial
        for name in config.optim.names:  # run covers every optimizer equally
            root = os.path.join(workdir, "runs", f"{name}_s{seed}")
            cell = functools.partial(_cell, config, model, arrays, name, seed, root, options)
            cells.append(store.get(f"{name}_s{seed}", cell))
            if not config.ckpt.keep_runs:  # the cell is stored: its trainings are not needed
                shutil.rmtree(root, ignore_errors=True)
    rows, checks = _summary(config, cells)
    for name in config.optim.names:
        group = [c for c in cells if c["optimizer"] == name]
        curves = {}
        for w in config.merge.extra_windows:
            alphas = group[0]["alpha_curves"][str(w)]["alpha"]
            ys = np.mean(
                [
                    np.asarray(c["alpha_curves"][str(w)]["valid_loss"]) - c["valid"]["last"]
                    for c in group
                ],
                axis=0,
            )
            curves[f"W={w}"] = (alphas, ys.tolist())
        common.plot_curves(
            os.path.join(workdir, f"loss_vs_alpha_{name}.png"),
            curves,
            title=f"Extra-Merge θ(α) = M_N + α v u, {name}: valid loss − last checkpoint's",
            xlabel="α (checkpoint intervals)",
            ylabel="Δ valid loss (nats/char)",
        )
    notes = (
        "Test loss in nats per character, mean ± std over seeds; hyper-parameters of every "
        "merge chosen on the validation split.\n\n" + "\n".join(checks)
    )
    common.write_results_md(
        workdir, rows, title="Extra-Merge on char-level Shakespeare", notes=notes
    )
    common.write_json(os.path.join(workdir, "results.json"), {"rows": rows, "cells": cells})
    return {"rows": rows, "checks": checks, "interrupted": False}
