"""PEFT parameterisations and initialisers: FrameFT (P10), LoRA-DA (P6) and SBVI (P8) studies.

``config.study`` picks the study; each is a sweep of many small runs (the paper's claims are
about trends over methods, budgets, ranks and seeds), trained with jitted ``lax.scan`` loops:

* ``"frameft"`` (specs §10): an MLP 64-256-256-10 pre-trained on sklearn digits, adapted to
  rotated digits with 300 examples; FrameFT (frame ``L = 2``, ``L = 8``, random-orthogonal and
  identity bases), FourierFT, VeRA and LoRA at matched per-layer budgets, and full fine-tuning.
  The learning rate of each method is picked on a validation split (seed 0), then 5 seeds run.
* ``"lora_da"`` (specs §6): an MLP 64-128-128-10 pre-trained on digits, adapted to rotated digits
  with 20% pixel noise from 300 examples; LoRA on the two hidden layers at ranks 1-8 from the
  vanilla, PiSSA, LoRA-GA, LoRA-One, EVA and LoRA-DA (β ∈ {0, .01, .03, .1}, and ``S = 32``)
  initialisations; Adam 1e-3 for 300 steps; loss after 10/50/300 steps, test accuracy, init time.
* ``"sbvi"`` (specs §8): teacher–student regression with per-layer true ranks (1, 4, 8); LoRA at
  fixed ranks, AdaLoRA and SBVI (``r_max = 16``); test MSE, recovered ranks, trainable parameters and
  optimiser-state size.

Outputs in the workdir: ``results.json`` (every cell; rerunning skips the cells already there, so an
interrupted sweep resumes), ``results.md`` (the tables, with the command), ``metrics.jsonl``
(one record per cell) and PNG plots. ``run`` returns the headline numbers.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from lowrank_jax import adapters, data, models, optim

STUDIES = ("frameft", "frameft_minilm", "lora_da", "sbvi")


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed (raises ``common.ConfigError``)."""
    c = common
    study = c.check_choice(config, "study", STUDIES)
    if study == "frameft_minilm":
        c.check_positive(config, "adapter.n_coeff", integer=True)
        c.check_positive(config, "schedule.num_steps", integer=True)
        return
    c.check_nonnegative(config, "seed", integer=True)
    c.check_positive(config, "eval.num_seeds", integer=True)
    c.check_positive(config, "schedule.num_steps", integer=True)
    c.check_positive(config, "data.batch_size", integer=True)
    c.check_positive(config, "data.num_train", integer=True)
    if study in ("frameft", "lora_da"):
        c.check_fraction(config, "data.noise", allow_zero=True)
        c.check_positive(config, "model.pretrain_steps", integer=True)
    if study == "frameft":
        for b in c.get_path(config, "adapter.budgets"):
            if not isinstance(b, int) or b < 1:
                raise c.ConfigError(f"config.adapter.budgets has {b!r}: budgets are positive ints")
    if study == "lora_da":
        for r in c.get_path(config, "adapter.ranks"):
            if not isinstance(r, int) or r < 1:
                raise c.ConfigError(f"config.adapter.ranks has {r!r}: ranks are positive ints")
    if study == "sbvi":
        ranks = c.get_path(config, "data.true_ranks")
        if len(ranks) != len(c.get_path(config, "model.features")) + 1:
            raise c.ConfigError(
                "config.data.true_ranks needs one rank per kernel (len(model.features) + 1)"
            )


# ----------------------------------------------------------------------------------------------
# Data: digits source and shifted target domains; the teacher-student problem.


def shifted_digits(x: np.ndarray, *, noise: float, seed: int) -> np.ndarray:
    """Rotates 8x8 digits by 90° and replaces a fraction ``noise`` of pixels by uniform noise."""
    rng = np.random.default_rng(seed)
    out = np.rot90(x, k=1, axes=(1, 2)).copy()
    mask = rng.random(out.shape) < noise
    out[mask] = rng.random(int(mask.sum()))
    return out.astype(np.float32)


def digits_domains(seed: int, *, num_train: int, noise: float, num_valid: int = 0):
    """``(source, target_train, target_valid, target_test)`` as ``(x, y)`` pairs.

    The digits are split 60/40 (stratified, fixed seed 0) into the source (original images) and
    the target pool (rotated + noise); each ``seed`` draws its ``num_train`` target training
    examples (and ``num_valid`` validation ones) from the pool, the rest is the target test set.
    """
    ds = data.load_digits()
    parts = data.split(ds, seed=0, valid_fraction=0.0, test_fraction=0.4)
    src = (np.asarray(parts.train.x, np.float32), np.asarray(parts.train.y))
    pool_x = shifted_digits(np.asarray(parts.test.x, np.float32), noise=noise, seed=1)
    pool_y = np.asarray(parts.test.y)
    order = np.random.default_rng([seed, 7]).permutation(len(pool_y))
    tr, va, te = np.split(order, [num_train, num_train + num_valid])
    pick = lambda idx: (pool_x[idx], pool_y[idx])
    return src, pick(tr), pick(va), pick(te)


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.lru_cache(maxsize=8)
def pretrain_mlp(features: tuple[int, ...], steps: int, seed: int = 0):
    """An MLP trained on the source digits: ``(model, variables, source train accuracy)``.

    Adam 1e-3, batch 64, label smoothing 0.1 (which keeps the logits moderate, so that the
    shifted domain starts at a finite loss rather than at a saturated, over-confident model).
    """
    (x, y), *_ = digits_domains(0, num_train=1, noise=0.0)
    x, y = jnp.asarray(x), jnp.asarray(y)
    model = models.MLP(features, 10)
    variables = model.init(jax.random.key(seed), x[:1])
    tx = optax.adam(1e-3)
    idx = np.random.default_rng(seed).integers(0, len(y), (steps, 64))
    smooth = optax.smooth_labels(jax.nn.one_hot(y, 10), 0.1)

    @jax.jit
    def train(v):
        def body(carry, i):
            v, s = carry
            g = jax.grad(
                lambda vv: optax.softmax_cross_entropy(model.apply(vv, x[i]), smooth[i]).mean()
            )(v)
            u, s = tx.update(g, s, v)
            return (optax.apply_updates(v, u), s), None

        (v, _), _ = jax.lax.scan(body, (v, tx.init(v)), jnp.asarray(idx))
        return v

    variables = train(variables)
    acc = float(jnp.mean(jnp.argmax(model.apply(variables, x), -1) == y))
    return model, variables, acc


# ----------------------------------------------------------------------------------------------
# A generic jitted training loop over (trainable, frozen) with a per-step full-train-loss trace.


def _batches(seed: int, n: int, batch_size: int, steps: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 11])
    per_epoch = max(n // batch_size, 1)
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    return order[: steps * batch_size].reshape(steps, batch_size)


@functools.partial(jax.jit, static_argnames=("loss_fn", "tx", "steps"))
def train_scan(trainable, frozen, train, idx, *, loss_fn, tx, steps):
    """``steps`` optimiser steps over minibatches ``idx``; returns (trainable, opt_state, trace).

    ``loss_fn(trainable, frozen, batch) -> scalar``; the trace is the full-training-set loss
    after each step (``trace[k-1]`` = loss after ``k`` steps).
    """
    del steps

    def body(carry, i):
        p, s = carry
        batch = jax.tree.map(lambda a: a[i], train)
        g = jax.grad(loss_fn)(p, frozen, batch)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return (p, s), loss_fn(p, frozen, train)

    (p, s), trace = jax.lax.scan(body, (trainable, tx.init(trainable)), idx)
    return p, s, trace


@functools.cache
def _adam(lr: float) -> optax.GradientTransformation:
    """One Adam per learning rate, so that jitted loops are compiled once per rate."""
    return optax.adam(lr)


def _accuracy(logits, y) -> float:
    return float(jnp.mean(jnp.argmax(logits, -1) == y))


def _state_size(tree: Any) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


# ----------------------------------------------------------------------------------------------
# Results bookkeeping: one JSON of cells, resumable.


class _Cells:
    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, "results.json")
        self.cells: dict[str, Any] = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.cells = json.load(f)
        self.writer = common.MetricWriter(workdir, start_step=len(self.cells), tensorboard=False)

    def get(self, key: str, fn: Callable[[], dict]) -> dict:
        if key not in self.cells:
            self.cells[key] = fn()
            common.write_json(self.path, self.cells)
            scalars = {
                f"{key}/{k}": v for k, v in self.cells[key].items() if isinstance(v, int | float)
            }
            self.writer.write(len(self.cells), scalars)
            logging.info("%s: %s", key, self.cells[key])
        return self.cells[key]


def _mean_sd(values) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def _pm(values, digits: int = 3) -> str:
    m, s = _mean_sd(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


# ----------------------------------------------------------------------------------------------
# Study 1: FrameFT vs FourierFT / VeRA / LoRA / full FT at matched budgets.


def _frameft_methods(config) -> list[tuple[str, int | None, Callable[[int], Any] | None]]:
    """(name, budget, spec factory) rows; ``budget=None`` for budget-free rows."""
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


def _lr_grid(config, name: str) -> tuple[float, ...]:
    """The learning rates tried for a method (coefficient methods need larger ones)."""
    if name == "full":
        return tuple(config.optim.lr_grid_full)
    if name.startswith("lora"):
        return tuple(config.optim.lr_grid_lora)
    return tuple(config.optim.lr_grid_coeff)


def _frameft_cell(config, name, make_spec, lr, seed, *, valid: bool) -> dict:
    model, variables, _ = pretrain_mlp(tuple(config.model.features), config.model.pretrain_steps)
    _, tr, va, te = digits_domains(
        seed,
        num_train=config.data.num_train,
        noise=config.data.noise,
        num_valid=config.data.num_valid,
    )
    ev = va if valid else te
    train = {"x": jnp.asarray(tr[0]), "y": jnp.asarray(tr[1])}
    idx = _batches(seed, len(tr[1]), config.data.batch_size, config.schedule.num_steps)
    tx = _adam(lr)
    if make_spec is None:  # full fine-tuning
        loss = _full_loss(model)
        p, _, trace = train_scan(
            variables, None, train, idx, loss_fn=loss, tx=tx, steps=config.schedule.num_steps
        )
        logits = model.apply(p, ev[0])
        n_params = adapters.count_params(variables)
        flops = None
    else:
        spec = make_spec()
        rules = [(config.adapter.targets, spec)]
        ad = adapters.init(jax.random.key(seed), variables, rules)
        loss = _adapter_loss(model)
        p, _, trace = train_scan(
            ad, variables, train, idx, loss_fn=loss, tx=tx, steps=config.schedule.num_steps
        )
        logits = adapters.adapt(model.apply)(variables, p, ev[0])
        n_params = adapters.count_params(ad)
        flops = None
        if isinstance(spec, adapters.FrameFT):
            flops = sum(spec.delta_flops(*v.matrix) for v in ad.values())
    return {
        "accuracy": _accuracy(logits, ev[1]),
        "final_train_loss": float(trace[-1]),
        "params": n_params,
        **({"delta_flops": flops} if flops is not None else {}),
    }


@functools.cache
def _adapter_loss(model):
    fwd = adapters.adapt(model.apply)

    def loss(ad, variables, batch):
        return _xent(fwd(variables, ad, batch["x"]), batch["y"])

    return loss


@functools.cache
def _full_loss(model):
    def loss(v, _, batch):
        return _xent(model.apply(v, batch["x"]), batch["y"])

    return loss


def run_frameft(config, workdir: str) -> dict:
    cells = _Cells(workdir)
    _, _, src_acc = pretrain_mlp(tuple(config.model.features), config.model.pretrain_steps)
    rows, table = _frameft_methods(config), []
    for name, budget, make in rows:
        # Learning rate picked on the validation split with seed 0.
        val = {
            lr: cells.get(f"{name}/lr={lr}/valid", functools.partial(
                _frameft_cell, config, name, make, lr, 0, valid=True))["accuracy"]
            for lr in _lr_grid(config, name)
        }  # fmt: skip
        lr = max(val, key=val.get)
        res = [
            cells.get(
                f"{name}/lr={lr}/seed={s}",
                functools.partial(_frameft_cell, config, name, make, lr, s, valid=False),
            )
            for s in range(config.seed, config.seed + config.eval.num_seeds)
        ]
        acc = [r["accuracy"] for r in res]
        table.append(
            {
                "method": name.split("@")[0],
                "budget/layer": budget if budget is not None else "",
                "trainable params": res[0]["params"],
                "lr": lr,
                "test accuracy": _pm(acc),
                "mean": float(np.mean(acc)),
                "ΔW FLOPs": res[0].get("delta_flops", ""),
            }
        )
    # Trend checks (specs §10 (4)).
    by = {(r["method"], r["budget/layer"]): r for r in table}
    budgets = list(config.adapter.budgets)
    checks = {}
    for b in budgets:
        fl2, fl8 = by[("frameft_L2", b)], by[("frameft_L8", b)]
        checks[f"L2≈FourierFT@{b} (|Δ|≤0.02)"] = (
            abs(fl2["mean"] - by[("fourierft", b)]["mean"]) <= 0.02
        )
        checks[f"frame≥identity@{b}"] = fl2["mean"] >= by[("frameft_identity", b)]["mean"] - 0.005
        checks[f"L8 loses ≤0.02@{b}"] = fl8["mean"] >= fl2["mean"] - 0.02
        checks[f"L8 FLOPs ratio@{b}"] = round(fl2["ΔW FLOPs"] / fl8["ΔW FLOPs"], 2)
    lora_min = min(
        (r for r in table if r["method"].startswith("lora")), key=lambda r: r["trainable params"]
    )
    below = [
        b
        for b in budgets
        if by[("frameft_L2", b)]["trainable params"] < lora_min["trainable params"]
    ]
    for b in below:
        for m in ("frameft_L2", "fourierft"):
            checks[
                f"{m}@{b} ({by[(m, b)]['trainable params']} params) > {lora_min['method']} "
                f"({lora_min['trainable params']})"
            ] = by[(m, b)]["mean"] > lora_min["mean"]
    full = by[("full", "")]["mean"]
    checks[f"frameft@{max(budgets)} within 0.03 of full FT"] = (
        by[("frameft_L2", max(budgets))]["mean"] >= full - 0.03
    )
    return _write_tables(
        workdir,
        config,
        table,
        checks,
        title="FrameFT vs baselines: rotated digits, MLP 64-256-256-10",
        columns=["method", "budget/layer", "trainable params", "lr", "test accuracy", "ΔW FLOPs"],
        extra={"source_accuracy": src_acc},
    )


# ----------------------------------------------------------------------------------------------
# Study 1b: FrameFT on the real pretrained MiniLM (Shakespeare genre), as lora_finetune's LoRA run.


def run_frameft_minilm(config, workdir: str) -> dict:
    """FrameFT on every attention and MLP kernel of MiniLM + a trained head, resumable via ``fit``.

    Same data, split, tokenisation, steps, schedule and head learning rate as
    ``configs/lora_finetune.py`` (the LoRA r=8 reference); the coefficients get their own
    learning rate (``optim.coeff_learning_rate``, FrameFT trains them with a much larger one).
    """
    d, o = config.data, config.optim
    bert_config, encoder_variables, tokenizer = models.load_minilm()
    ds = data.load_shakespeare(
        label="genre", passage_chars=d.passage_chars,
        max_passages_per_play=d.max_passages_per_play, seed=config.seed,
    )  # fmt: skip
    splits = data.split(
        ds, seed=config.seed, valid_fraction=d.valid_fraction, test_fraction=d.test_fraction
    )
    arrays = {}
    for part in ("train", "valid", "test"):
        sub = getattr(splits, part)
        arrays[part] = {**models.tokenize(tokenizer, list(sub.x), max_len=d.max_len), "y": sub.y}
    init_key, adapter_key, train_key = jax.random.split(jax.random.key(config.seed), 3)
    num_classes = len(ds.class_names)
    model = models.BertClassifier(bert_config, num_classes)
    variables = models.classifier_variables(init_key, encoder_variables, num_classes=num_classes)
    head, frozen = adapters.split_trainable(variables, (r"params/head/.*",))
    spec = adapters.frameft(config.adapter.n_coeff, l=config.adapter.l, scale=config.adapter.scale)
    ad = adapters.init(adapter_key, variables, [(t, spec) for t in config.adapter.targets])
    trained = {"params": head, "adapters": ad}

    def sched(peak):
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, config.schedule.warmup_steps, config.schedule.num_steps, 0.0
        )

    labels = {
        "params": jax.tree.map(lambda _: "head", head),
        "adapters": jax.tree.map(lambda _: "coeffs", ad),
    }
    tx = optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.multi_transform(
            {"head": optax.adamw(sched(o.learning_rate), weight_decay=0.0),
             "coeffs": optax.adamw(sched(o.coeff_learning_rate), weight_decay=0.0)},
            labels,
        ),
    )  # fmt: skip
    fwd = adapters.adapt(model.apply)

    def logits(tr, batch, *, train, key):
        params = adapters.combine(tr["params"], frozen)
        kw = {"deterministic": not train, **({"rngs": {"dropout": key}} if train else {})}
        return fwd(params, tr["adapters"], batch["input_ids"], batch["attention_mask"], **kw)

    def train_step(state, _, batch, key):
        def loss_fn(tr):
            lg = logits(tr, batch, train=True, key=key)
            return optax.softmax_cross_entropy_with_integer_labels(lg, batch["y"]).mean(), lg

        tr = {"params": state["params"], "adapters": state["adapters"]}
        (loss, lg), g = jax.value_and_grad(loss_fn, has_aux=True)(tr)
        upd, opt_state = tx.update(g, state["opt_state"], tr)
        tr = optax.apply_updates(tr, upd)
        acc = jnp.mean(jnp.argmax(lg, -1) == batch["y"])
        return {**state, **tr, "opt_state": opt_state}, {"loss": loss, "accuracy": acc}

    @jax.jit
    def eval_sums(tr, batch, weight):
        lg = logits(tr, batch, train=False, key=None)
        loss = optax.softmax_cross_entropy_with_integer_labels(lg, batch["y"])
        return jnp.sum(loss * weight), jnp.sum((jnp.argmax(lg, -1) == batch["y"]) * weight)

    def evaluate(state, part):
        arr, bs = arrays[part], config.eval.batch_size
        n, tot_l, tot_c = len(arr["y"]), 0.0, 0.0
        tr = {"params": state["params"], "adapters": state["adapters"]}
        for chunk, w in common.padded_batches(arr, bs):
            l_sum, c_sum = eval_sums(tr, chunk, w)
            tot_l, tot_c = tot_l + float(l_sum), tot_c + float(c_sum)
        return {f"{part}/loss": tot_l / n, f"{part}/accuracy": tot_c / n}

    state = {"params": head, "adapters": ad, "opt_state": tx.init(trained), "step": 0}
    batches = data.BatchIterator(arrays["train"], batch_size=d.batch_size, seed=config.seed)
    result = common.fit(
        state, frozen, train_step, batches, key=train_key, num_steps=config.schedule.num_steps,
        workdir=workdir, eval_fn=lambda s, _: evaluate(s, "valid"), eval_every=config.eval.every,
        log_every=config.log.every, ckpt_every=config.ckpt.every, max_to_keep=2,
        progress=config.log.progress, description="minilm/frameft",
    )  # fmt: skip
    if result.interrupted:
        return {"interrupted": True}
    final = {
        **result.last_eval,
        **evaluate(result.state, "test"),
        "trainable_params": adapters.count_params(trained),
        "adapter_params": adapters.count_params(ad),
        "step_time_s": result.step_time_s,
    }
    notes = (
        f"Command: `python -m experiments.train --config=configs/{config.study_config}`\n\n"
        "LoRA r=8 reference: `python -m experiments.train --config=configs/lora_finetune.py` "
        "(331,776 adapter + 1,155 head parameters)."
    )
    common.write_results_md(
        workdir, [{"method": f"FrameFT n={config.adapter.n_coeff}/kernel", **final}],
        title="FrameFT on MiniLM, Shakespeare genre", notes=notes,
    )  # fmt: skip
    return final


# ----------------------------------------------------------------------------------------------
# Study 2: LoRA-DA and the initialisers.


def _lora_da_inits(config) -> list[tuple[str, Callable]]:
    d = config.adapter
    rows = [("vanilla", None), ("pissa", adapters.pissa), ("lora_ga", adapters.lora_ga)]
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
                ),
            )
        )
    return rows


_UNMERGE = {"pissa", "lora_ga"}


@functools.cache
def _apply_fn(model):
    return model.apply


def _stat_loss(fwd, batch):
    return _xent(fwd(batch["x"]), batch["y"])


def _lora_da_cell(config, name, init_fn, rank, seed) -> dict:
    model, variables, _ = pretrain_mlp(tuple(config.model.features), config.model.pretrain_steps)
    _, tr, _, te = digits_domains(seed, num_train=config.data.num_train, noise=config.data.noise)
    train = {"x": jnp.asarray(tr[0]), "y": jnp.asarray(tr[1])}
    spec = adapters.lora(rank, alpha=config.adapter.alpha, rslora=config.adapter.rslora)
    rules = [(config.adapter.targets, spec)]
    key = jax.random.key(seed)

    def make():
        if init_fn is None:
            return adapters.init(key, variables, rules)
        if name == "pissa":
            return init_fn(key, variables, rules, train)
        return init_fn(
            key, variables, rules, train, apply_fn=_apply_fn(model), loss_fn=_stat_loss,
            **({"num_train": len(tr[1])} if name.startswith("lora_da") else {}),
        )  # fmt: skip

    ad = make()  # first call compiles; time a second one
    jax.block_until_ready(ad)
    t0 = time.perf_counter()
    ad = make()
    jax.block_until_ready(ad)
    init_s = time.perf_counter() - t0
    base = adapters.unmerge(variables, ad) if name in _UNMERGE else variables
    steps = config.schedule.num_steps
    idx = _batches(seed, len(tr[1]), config.data.batch_size, steps)
    tx = _adam(config.optim.learning_rate)
    kw = dict(loss_fn=_adapter_loss(model), tx=tx, steps=steps)
    train_scan(ad, base, train, idx, **kw)[2].block_until_ready()  # compile
    t0 = time.perf_counter()
    p, _, trace = train_scan(ad, base, train, idx, **kw)
    trace.block_until_ready()
    train_s = time.perf_counter() - t0
    init_loss = float(_adapter_loss(model)(ad, base, train))
    logits = adapters.adapt(model.apply)(base, p, te[0])
    out = {"loss@0": init_loss, "accuracy": _accuracy(logits, te[1]), "init_s": init_s}
    out["train_s"] = train_s
    for k in config.eval.loss_steps:
        out[f"loss@{k}"] = float(trace[min(k, steps) - 1])
    return out


def run_lora_da(config, workdir: str) -> dict:
    cells = _Cells(workdir)
    _, _, src_acc = pretrain_mlp(tuple(config.model.features), config.model.pretrain_steps)
    table, per = [], {}
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    for rank in config.adapter.ranks:
        for name, fn in _lora_da_inits(config):
            res = [
                cells.get(
                    f"r={rank}/{name}/seed={s}",
                    functools.partial(_lora_da_cell, config, name, fn, rank, s),
                )
                for s in seeds
            ]
            per[(rank, name)] = res
            row = {"rank": rank, "init": name}
            for k in ("loss@0", *(f"loss@{k}" for k in config.eval.loss_steps)):
                row[k] = _pm([r[k] for r in res])
            row["test accuracy"] = _pm([r["accuracy"] for r in res])
            row["init / train time"] = f"{np.mean([r['init_s'] / r['train_s'] for r in res]):.1%}"
            row["mean"] = float(np.mean([r["accuracy"] for r in res]))
            table.append(row)
    # Trend checks (specs §6 (4)).
    checks = {}
    main = f"lora_da_b{config.adapter.default_beta}"
    last = f"loss@{config.eval.loss_steps[0]}"
    for rank in config.adapter.ranks:
        acc = {
            n: float(np.mean([r["accuracy"] for r in per[(rank, n)]]))
            for n, _ in _lora_da_inits(config)
        }
        sd_one = _mean_sd([r["accuracy"] for r in per[(rank, "lora_one")]])[1]
        best = max(acc, key=acc.get)
        checks[f"r={rank}: best init"] = f"{best} ({acc[best]:.3f})"
        checks[f"r={rank}: LoRA-DA best or ties LoRA-One (1 sd)"] = bool(
            acc[main] >= max(acc.values()) - 1e-9 or acc[main] >= acc["lora_one"] - sd_one
        )
        early = {
            n: float(np.mean([r[last] for r in per[(rank, n)]]))
            for n in (main, "vanilla", "lora_ga")
        }
        checks[f"r={rank}: early loss LoRA-DA < vanilla, LoRA-GA"] = bool(
            early[main] < early["vanilla"] and early[main] < early["lora_ga"]
        )
    d = config.adapter
    if d.small_sample_betas and 0.0 in d.small_sample_betas:
        for rank in config.adapter.ranks:
            gain = lambda tag, rank=rank: (
                float(
                    np.mean([r["accuracy"] for r in per[(rank, f"lora_da_b{d.default_beta}{tag}")]])
                )
                - float(np.mean([r["accuracy"] for r in per[(rank, f"lora_da_b0.0{tag}")]]))
            )
            if f"lora_da_b{d.default_beta}_S{d.small_sample}" in dict(_lora_da_inits(config)):
                checks[f"r={rank}: β gain at S={d.small_sample} vs S=256"] = (
                    f"{gain(f'_S{d.small_sample}'):+.4f} vs {gain(''):+.4f}"
                )
    overhead = max(
        np.mean([r["init_s"] / r["train_s"] for r in per[(rank, main)]]) for rank in d.ranks
    )
    checks["LoRA-DA init overhead < 10% of training"] = bool(overhead < 0.10)
    _plot_lora_da(workdir, config, per)
    return _write_tables(
        workdir,
        config,
        table,
        checks,
        title="LoRA initialisers: rotated + noisy digits, MLP 64-128-128-10, 300 examples",
        columns=["rank", "init", "loss@0", *(f"loss@{k}" for k in config.eval.loss_steps),
                 "test accuracy", "init / train time"],
        extra={"source_accuracy": src_acc},
    )  # fmt: skip


def _plot_lora_da(workdir, config, per) -> None:
    rank = max(config.adapter.ranks)
    ks = [0, *config.eval.loss_steps]
    curves = {
        n: (ks, [float(np.mean([r[f"loss@{k}"] for r in res])) for k in ks])
        for (r, n), res in per.items()
        if r == rank
    }
    common.plot_curves(
        os.path.join(workdir, "init_loss.png"), curves, title=f"train loss, rank {rank}",
        ylabel="loss", logy=True,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Study 3: SBVI rank recovery in a teacher-student problem.


def teacher_student(config, seed: int):
    """A frozen random MLP teacher, the target with low-rank ΔW*_l, and noisy regression data.

    Returns ``(model, teacher_variables, target_variables, (x_train, y_train), (x_test, y_test))``;
    ``ΔW*_l = Σ_i s_i u_i v_iᵀ`` with ``true_ranks[l]`` modes of strengths ``geomspace(1, .5)``
    times the spectral norm of the teacher kernel.
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
    return (
        model,
        teacher,
        target,
        (x[: d.num_train], y[: d.num_train]),
        (x[d.num_train :], y[d.num_train :]),
    )


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


def _sbvi_cell(config, method: str, seed: int) -> dict:
    model, teacher, _, (xtr, ytr), (xte, yte) = teacher_student(config, seed)
    train = {"x": jnp.asarray(xtr), "y": jnp.asarray(ytr)}
    steps = config.schedule.num_steps
    idx = _batches(seed, len(ytr), config.data.batch_size, steps)
    targets = r"params/(dense_\d+|head)/kernel"
    o = config.optim
    key = jax.random.key(seed)
    if method.startswith("lora_r"):
        r = int(method[len("lora_r") :])
        head = min(r, config.model.num_outputs)  # the head is 128x10: its rank is capped at 10
        rules = [
            (r"params/head/kernel", adapters.lora(head, alpha=2.0 * head)),
            (targets, adapters.lora(r, alpha=2.0 * r)),
        ]
        ad = adapters.init(key, teacher, rules)
        tx, loss = _adam(o.lora_lr), _mse_loss(model)
    elif method == "adalora":
        r0 = config.adapter.r_max
        rules = [
            (r"params/head/kernel", adapters.spectral(min(r0, 10), init="adalora")),
            (targets, adapters.spectral(r0, init="adalora")),
        ]
        ad = adapters.init(key, teacher, rules)
        tx = optim.scale_by_adalora(
            inner=optax.adam(o.adalora_lr), target_rank=config.adapter.adalora_target_rank,
            total_steps=steps, init_warmup=steps // 10, final_warmup=steps // 4,
            mask_interval=10,
        )  # fmt: skip
        loss = _mse_loss(model, 0.1)
    else:
        r0 = config.adapter.r_max
        rules = [
            (r"params/head/kernel", adapters.spectral(min(r0, 10))),
            (targets, adapters.spectral(r0)),
        ]
        ad = adapters.init(key, teacher, rules)
        tx = optim.scale_by_sbvi(
            learning_rate=o.sbvi_lr, factor_learning_rate=o.sbvi_factor_lr,
            friction=o.friction, temperature=o.temperature,
            friction_warmup=int(o.friction_warmup * steps), anneal_steps=int(0.8 * steps),
            prune_start=int(o.prune_start * steps), prune_ratio=o.prune_ratio,
            seed=seed,
        )  # fmt: skip
        loss = _mse_loss(model)
    p, state, trace = train_scan(ad, teacher, train, idx, loss_fn=loss, tx=tx, steps=steps)
    pred = adapters.adapt(model.apply)(teacher, p, xte)
    mse = float(jnp.mean((pred - yte) ** 2))
    names = sorted(p)
    if method == "sbvi":
        found = optim.sbvi_ranks(state)
        ranks = [found[n] for n in names]
        spectra = {n: np.sort(np.asarray(p[n].factors["s"]))[::-1].tolist() for n in names}
    elif method == "adalora":
        found = optim.adalora_ranks(state)
        ranks = [found[n] for n in names]
        spectra = {n: np.sort(np.abs(np.asarray(p[n].factors["s"])))[::-1].tolist() for n in names}
    else:
        ranks, spectra = [], {}
        for n in names:
            delta = np.asarray(adapters.delta(p[n], teacher_kernel_shape(teacher, n)))
            ranks.append(_numeric_rank(delta, config.optim.prune_ratio))
            spectra[n] = np.linalg.svd(delta, compute_uv=False)[:16].tolist()
    order = [n for n in names if "dense" in n] + [n for n in names if "head" in n]
    by_name = dict(zip(names, ranks, strict=True))
    return {
        "test_mse": mse,
        "final_train_loss": float(trace[-1]),
        "ranks": [by_name[n] for n in order],
        "spectra": {n: spectra[n] for n in order},
        "params": adapters.count_params(ad),
        "opt_state": _state_size(state),
    }


def teacher_kernel_shape(variables, path: str) -> tuple[int, ...]:
    node = variables
    for k in path.split("/"):
        node = node[k]
    return tuple(node.shape)


def run_sbvi(config, workdir: str) -> dict:
    cells = _Cells(workdir)
    methods = [f"lora_r{r}" for r in config.adapter.lora_ranks] + ["adalora", "sbvi"]
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    per = {
        m: [cells.get(f"{m}/seed={s}", lambda m=m, s=s: _sbvi_cell(config, m, s)) for s in seeds]
        for m in methods
    }
    true = list(config.data.true_ranks)
    table = []
    for m, res in per.items():
        table.append(
            {
                "method": m,
                "test MSE": _pm([r["test_mse"] for r in res], 4),
                "ranks (per seed)": " ".join(str(tuple(r["ranks"])) for r in res),
                "trainable params": res[0]["params"],
                "optimizer state (floats)": res[0]["opt_state"],
                "mean": float(np.mean([r["test_mse"] for r in res])),
            }
        )
    sb = per["sbvi"]
    checks = {
        "SBVI ranks within ±1 of true (all seeds)": all(
            all(abs(a - b) <= 1 for a, b in zip(r["ranks"], true, strict=True)) for r in sb
        ),
    }
    gaps = []
    for r in sb:
        for _n, s in r["spectra"].items():
            kept = [v for v in s if v > 0]
            gaps.append(min(kept) if kept else 0.0)
    checks["spectral gap: smallest kept σ / largest pruned σ"] = (
        "pruned σ = 0 exactly; smallest kept σ = " + f"{min(gaps):.3f}"
    )
    sbvi_mse = np.mean([r["test_mse"] for r in sb])
    lora_rows = [r for r in table if r["method"].startswith("lora")]
    eligible = [r for r in lora_rows if r["trainable params"] <= per["sbvi"][0]["params"]]
    best = min(eligible, key=lambda r: r["mean"])
    checks[f"SBVI MSE ≤ best LoRA at ≤ its params ({best['method']})"] = bool(
        sbvi_mse <= best["mean"]
    )
    ada_mse = np.mean([r["test_mse"] for r in per["adalora"]])
    checks["SBVI MSE ≤ AdaLoRA"] = bool(sbvi_mse <= ada_mse * 1.0)
    checks["SBVI optimizer state < AdaLoRA's"] = bool(
        per["sbvi"][0]["opt_state"] < per["adalora"][0]["opt_state"]
    )
    _plot_spectra(workdir, sb[0], "sbvi")
    return _write_tables(
        workdir, config, table, checks,
        title=f"SBVI rank recovery: teacher-student, true ranks {tuple(true)}",
        columns=["method", "test MSE", "ranks (per seed)", "trainable params", "optimizer state (floats)"],
    )  # fmt: skip


def _plot_spectra(workdir: str, cell: dict, tag: str) -> None:
    curves = {n.split("/")[1]: (list(range(1, len(s) + 1)), s) for n, s in cell["spectra"].items()}
    common.plot_curves(
        os.path.join(workdir, f"{tag}_spectra.png"), curves, title="final σ per layer (seed 0)",
        xlabel="mode", ylabel="σ",
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------


def _write_tables(workdir, config, table, checks, *, title, columns, extra=None) -> dict:
    command = f"python -m experiments.train --config=configs/{config.study_config}"
    notes = (
        "Command: `"
        + command
        + "`\n\nTrend checks (specs):\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in checks.items())
    )
    if extra:
        notes += "\n\n" + "\n".join(f"- {k}: {v}" for k, v in extra.items())
    common.write_results_md(workdir, table, title=title, columns=columns, notes=notes)
    out = {"rows": len(table), **{k: v for k, v in checks.items()}, **(extra or {})}
    common.write_json(os.path.join(workdir, "summary.json"), {"table": table, "checks": checks})
    return {k: (v if isinstance(v, int | float | str | bool) else str(v)) for k, v in out.items()}


def run(config: Any, workdir: str) -> dict[str, Any]:
    """Runs ``config.study`` and returns its headline numbers and trend checks."""
    os.makedirs(workdir, exist_ok=True)
    study = {
        "frameft": run_frameft,
        "frameft_minilm": run_frameft_minilm,
        "lora_da": run_lora_da,
        "sbvi": run_sbvi,
    }[config.study]
    return study(config, workdir)
