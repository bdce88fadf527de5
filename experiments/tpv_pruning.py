"""P19: TPV stability, JBR pruning without fine-tuning, and TPV for model selection (specs §19 (4)).

* ``pruning``: per seed, an MLP on sklearn digits trained with ``sweep.train_scan``; each
  criterion of ``lowrank_jax.analysis.pruning`` prunes hidden neurons to ``target_ratio`` in
  ``steps`` steps (``prune_iteratively``, scores recomputed on the current masked model, no
  fine-tuning); test accuracy after every step. Every criterion sees the same number of scoring
  examples (``num_batches × batch_size``; exact TPV: ``tpv_examples``).
* ``pruning_cnn``: the same pruning study on a small CNN (``lowrank_jax.models.CNN``: conv
  channels and dense units pruned by the same criteria code, one global ranking) trained on a
  subset of real MNIST, test accuracy on the MNIST test split.
* ``stability``: one-hidden-layer students on synthetic teachers (the paper's setting is
  synthetic here); TPV_train / TPV_test for quantisation and label noise.
* ``selection``: digits with noisy training labels, a weight-decay × label-smoothing grid;
  Spearman correlation between the training-set label-noise TPV and the clean test loss.

The methods live in ``lowrank_jax.analysis``; this module wires data, training and reports.
Finished cells live in ``<workdir>/cells``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from experiments import common
from experiments.common import sweep
from lowrank_jax import analysis, data
from lowrank_jax.analysis.pruning import score_exact_tpv, score_taylor, sequential_groups
from lowrank_jax.analysis.tpv import quantization_variance, tpv_label_noise, trace_heff
from lowrank_jax.models import CNN, MLP

PARTS = ("pruning", "pruning_cnn", "stability", "selection")
CRITERIA = ("random", "l1", "taylor", "jacobian", "jbr", "exact_tpv")


def check_config(config: Any) -> None:
    """Validates ``config`` (raises ``common.ConfigError``)."""
    c = common
    for p in config.parts:
        if p not in PARTS:
            raise c.ConfigError(f"config.parts holds {p!r}: use {', '.join(PARTS)}")
    for k in config.pruning.criteria:
        if k not in CRITERIA:
            raise c.ConfigError(f"config.pruning.criteria holds {k!r}: use {', '.join(CRITERIA)}")
    keys = ("schedule.num_steps", "data.batch_size", "pruning.num_seeds", "pruning.steps")
    keys += ("cnn.num_train", "cnn.num_test", "cnn.num_steps", "cnn.eval_chunk")
    for key in keys:
        c.check_positive(config, key, integer=True)
    if not 0 < config.pruning.target_ratio < 1:
        raise c.ConfigError("config.pruning.target_ratio must lie in (0, 1)")
    c.check_fraction(config, "selection.label_noise")


@functools.cache
def _tx(lr: float, wd: float) -> optax.GradientTransformation:
    return optax.adamw(lr, weight_decay=wd) if wd else sweep.adam(lr)


@functools.cache
def _loss(model: Any, kind: str):
    def loss(params, _, batch):
        out = model.apply(params, batch["x"])
        if kind == "mse":
            return jnp.mean((out[:, 0] - batch["y"]) ** 2)
        return jnp.mean(optax.softmax_cross_entropy(out, batch["t"]))

    return loss


def _train_step(name, model, train, *, kind, steps, batch_size, lr, wd=0.0) -> common.Step:
    """:func:`_train`'s ``train_scan`` on abstract ``train`` arrays (for lowering)."""
    params = jax.eval_shape(lambda k, x: model.init(k, x[:1]), jax.random.key(0), train["x"])
    idx = jax.ShapeDtypeStruct((steps, min(batch_size, train["x"].shape[0])), jnp.int32)
    return sweep.train_scan_step(
        name, params, None, train, idx, loss_fn=_loss(model, kind), tx=_tx(lr, wd), trace=False
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """On abstract inputs (no data): each selected part's ``train_scan`` and the pruning parts'
    chunked test forward. (The pruning scores and TPV estimates jit inside the library.)"""
    del mesh  # the sweep's programs run on one device
    check_config(config)
    spec, c, o = jax.ShapeDtypeStruct, config, config.optim
    digits_n = _DIGITS - c.data.num_test
    digits = {"x": spec((digits_n, *_DIGIT_SHAPE), jnp.float32), "t": spec((digits_n, 10), jnp.float32)}  # fmt: skip
    kw = dict(kind="ce", steps=c.schedule.num_steps, batch_size=c.data.batch_size, lr=o.learning_rate)  # fmt: skip
    out = []
    mlp = MLP(tuple(c.model.features), 10)
    if "pruning" in c.parts:
        out.append(_train_step("pruning MLP", mlp, digits, **kw))
        params = jax.eval_shape(mlp.init, jax.random.key(0), jnp.zeros((1, *_DIGIT_SHAPE)))
        x = spec((c.data.num_test, *_DIGIT_SHAPE), jnp.float32)
        out.append(common.Step("pruning MLP test", _batched_apply(mlp, c.data.num_test), (params, x)))  # fmt: skip
    if "pruning_cnn" in c.parts:
        n, cnn = c.cnn.num_train, CNN(tuple(c.cnn.channels), tuple(c.cnn.features), 10)
        train = {"x": spec((n, 28, 28, 1), jnp.float32), "t": spec((n, 10), jnp.float32)}
        out.append(_train_step("pruning CNN", cnn, train, **{**kw, "steps": c.cnn.num_steps}))
        params = jax.eval_shape(cnn.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
        x = spec((c.cnn.num_test, 28, 28, 1), jnp.float32)
        out.append(common.Step("pruning CNN test", _batched_apply(cnn, c.cnn.eval_chunk), (params, x)))  # fmt: skip
    if "stability" in c.parts:
        s = c.stability
        for d in s.dims:
            for w in s.widths:
                n = max(s.n_trains)
                train = {"x": spec((n, d), jnp.float32), "y": spec((n,), jnp.float32)}
                out.append(_train_step(f"stability d={d} w={w}", MLP((w,), 1), train, kind="mse", steps=s.steps, batch_size=64, lr=o.learning_rate))  # fmt: skip
    if "selection" in c.parts:
        for wd in c.selection.weight_decays:
            out.append(_train_step(f"selection wd={wd}", mlp, digits, **kw, wd=wd))
    return out


# The sklearn digits: 1,797 images of 8x8.
_DIGITS, _DIGIT_SHAPE = 1797, (8, 8, 1)


def _train(model, key, train, *, kind, steps, batch_size, lr, wd=0.0, seed=0, options):
    params = model.init(key, train["x"][:1])
    idx = sweep.batch_indices(seed, len(train["x"]), min(batch_size, len(train["x"])), steps)
    params, _, _ = sweep.train_scan(
        params,
        None,
        train,
        jnp.asarray(idx),
        loss_fn=_loss(model, kind),
        tx=_tx(lr, wd),
        trace=False,
        options=options,
    )
    return params


def _digits_split(seed: int, num_test: int):
    ds = data.load_digits()
    perm = np.random.default_rng([seed, 5]).permutation(len(ds.y))
    te, tr = perm[:num_test], perm[num_test:]
    return (ds.x[tr], ds.y[tr]), (ds.x[te], ds.y[te])


_score_taylor = jax.jit(score_taylor, static_argnums=(0, 4))
_score_jac = jax.jit(analysis.score_jacobian, static_argnums=(0, 4))
_score_tpv = jax.jit(score_exact_tpv, static_argnums=(0, 3), static_argnames="chunk")


@functools.cache
def _batched_apply(model: Any, chunk: int):
    """Jitted ``(params, x (n, ...)) -> logits (n, K)``, ``chunk`` inputs per forward pass."""

    @jax.jit
    def apply(q, x):
        n, pad = x.shape[0], (-x.shape[0]) % chunk
        xs = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, chunk, *x.shape[1:])
        out = jax.lax.map(lambda b: model.apply(q, b), xs)
        return out.reshape(-1, out.shape[-1])[:n]

    return apply


def _accuracy_fn(model, x, y, chunk: int):
    """``params -> test accuracy`` (jitted, ``chunk`` test inputs per forward pass)."""
    apply, x, y = _batched_apply(model, chunk), jnp.asarray(x), jnp.asarray(y)
    return lambda q: jnp.mean(jnp.argmax(apply(q, x), -1) == y)


def _prune_all(config, model, params, groups, xtr, ytr, acc, seed, chunk) -> dict:
    """Every criterion of ``config.pruning`` prunes ``params``; accuracy after each step."""
    p = config.pruning
    key = jax.random.key(seed)
    bs, nb = config.data.batch_size, p.num_batches
    rng = np.random.default_rng([seed, 9])
    pick = rng.choice(len(ytr), nb * bs, replace=False)
    xb = jnp.asarray(xtr[pick]).reshape(nb, bs, *xtr.shape[1:])
    yb = jnp.asarray(ytr[pick]).reshape(nb, bs)
    xj, yj = analysis.confident_pseudo_labels(
        _batched_apply(model, chunk), params, jnp.asarray(xtr), key=jax.random.fold_in(key, 1),
        num_batches=nb, batch_size=bs, threshold=p.confidence,
    )  # fmt: skip
    xt = jnp.asarray(xtr[pick[: p.tpv_examples]])
    fns = {
        "random": lambda q, m, s: analysis.score_random(jax.random.fold_in(key, 100 + s), m),
        "l1": lambda q, m, s: analysis.score_l1(q, groups),
        "taylor": lambda q, m, s: _score_taylor(
            model.apply, q, xb.reshape(-1, *xb.shape[2:]), yb.reshape(-1), groups
        ),
        "jacobian": lambda q, m, s: _score_jac(model.apply, q, xb, yb, groups),
        "jbr": lambda q, m, s: _score_jac(model.apply, q, xj, yj, groups),
        "exact_tpv": lambda q, m, s: _score_tpv(model.apply, q, xt, groups, chunk=p.tpv_chunk),
    }
    out = {"acc_dense": float(acc(params))}
    for name in p.criteria:
        hist = analysis.prune_iteratively(
            params, groups, fns[name], target_ratio=p.target_ratio, steps=p.steps
        )
        out[name] = [float(acc(analysis.apply_masks(params, m, groups))) for m in hist]
        out[f"alive_{name}"] = {k: int(v.sum()) for k, v in hist[-1].items()}
    return out


def pruning_cell(config: Any, seed: int, options: common.TrainOptions) -> dict:
    """Trains one MLP on digits and prunes it with every criterion; test accuracy per step."""
    (xtr, ytr), (xte, yte) = _digits_split(seed, config.data.num_test)
    model = MLP(tuple(config.model.features), 10)
    train = {"x": jnp.asarray(xtr), "t": jax.nn.one_hot(ytr, 10)}
    params = _train(
        model, jax.random.key(seed), train, kind="ce", steps=config.schedule.num_steps,
        batch_size=config.data.batch_size, lr=config.optim.learning_rate, seed=seed,
        options=options,
    )  # fmt: skip
    acc = _accuracy_fn(model, xte, yte, len(yte))
    groups = analysis.mlp_groups(params)
    return _prune_all(config, model, params, groups, xtr, ytr, acc, seed, len(xtr))


def pruning_cnn_cell(config: Any, seed: int, options: common.TrainOptions) -> dict:
    """Trains one CNN on an MNIST subset and prunes channels and units with every criterion."""
    c = config.cnn
    tr, te = data.load_mnist("train"), data.load_mnist("test")
    idx = np.random.default_rng([seed, 11]).permutation(len(tr.y))[: c.num_train]
    xtr, ytr = tr.x[idx], tr.y[idx]
    model = CNN(tuple(c.channels), tuple(c.features), 10)
    train = {"x": jnp.asarray(xtr), "t": jax.nn.one_hot(ytr, 10)}
    params = _train(
        model, jax.random.key(seed), train, kind="ce", steps=c.num_steps,
        batch_size=config.data.batch_size, lr=config.optim.learning_rate, seed=seed,
        options=options,
    )  # fmt: skip
    acc = _accuracy_fn(model, te.x[: c.num_test], te.y[: c.num_test], c.eval_chunk)
    groups = sequential_groups(params)
    return _prune_all(config, model, params, groups, xtr, ytr, acc, seed, c.eval_chunk)


def stability_cell(
    config: Any, teacher: str, d: int, width: int, n: int, options: common.TrainOptions
) -> dict:
    """TPV_train / TPV_test (quantisation and label noise) of one trained student."""
    s = config.stability
    kx, kt, kn, ks, kr = jax.random.split(jax.random.key(1000 * d + 10 * width + n), 5)
    x = jax.random.normal(kx, (n + s.num_test, d))
    if teacher == "linear":
        f = x @ jax.random.normal(kt, (d,)) / np.sqrt(d)
    else:
        w1 = jax.random.normal(kt, (d, 16)) / np.sqrt(d)
        f = jax.nn.relu(x @ w1) @ jax.random.normal(jax.random.fold_in(kt, 1), (16,)) / 4
    y = f + 0.1 * jax.random.normal(kn, f.shape)
    model = MLP((width,), 1)
    train = {"x": x[:n], "y": y[:n]}
    lr = config.optim.learning_rate
    params = _train(
        model, ks, train, kind="mse", steps=s.steps, batch_size=64, lr=lr, options=options
    )

    def apply1(q, xi):
        return model.apply(q, xi[None])[0]

    xtr, xte = x[:n], x[n:]
    tr_h, te_h = (float(trace_heff(apply1, params, a)) for a in (xtr, xte))
    sq = float(quantization_variance(params, bits=s.bits))
    ln = {
        name: float(
            tpv_label_noise(
                apply1,
                params,
                xtr,
                xe,
                key=kr,
                sigma=s.sigma,
                num_runs=s.refits,
                steps=s.refit_steps,
                learning_rate=0.01,
            )
        )  # fmt: skip
        for name, xe in (("train", xtr), ("test", xte))
    }
    loss = _loss(model, "mse")
    return {
        "quant_train": sq * tr_h, "quant_test": sq * te_h, "quant_ratio": tr_h / te_h,
        "label_train": ln["train"], "label_test": ln["test"],
        "label_ratio": ln["train"] / ln["test"],
        "train_mse": float(loss(params, None, train)),
        "test_mse": float(loss(params, None, {"x": xte, "y": y[n:]})),
    }  # fmt: skip


def selection_cell(config: Any, wd: float, smoothing: float, options: common.TrainOptions) -> dict:
    """Training-set label-noise TPV and clean test loss of one recipe on noisy digits."""
    s = config.selection
    (xtr, ytr), (xte, yte) = _digits_split(config.seed, config.data.num_test)
    rng = np.random.default_rng([config.seed, 3])
    flip = rng.uniform(size=len(ytr)) < s.label_noise
    noisy = np.where(flip, rng.integers(0, 10, len(ytr)), ytr)
    t = jax.nn.one_hot(noisy, 10) * (1 - smoothing) + smoothing / 10
    model = MLP(tuple(config.model.features), 10)
    train = {"x": jnp.asarray(xtr), "t": t}
    params = _train(
        model, jax.random.key(config.seed), train, kind="ce", steps=config.schedule.num_steps,
        batch_size=config.data.batch_size, lr=config.optim.learning_rate, wd=wd, options=options,
    )  # fmt: skip

    def apply1(q, xi):
        return model.apply(q, xi[None])[0]

    tpv = tpv_label_noise(
        apply1, params, jnp.asarray(xtr[: s.tpv_examples]), key=jax.random.key(7),
        sigma=s.sigma, num_runs=s.refits, steps=s.refit_steps, learning_rate=0.01,
    )  # fmt: skip
    logits = model.apply(params, xte)
    return {
        "tpv_train": float(tpv),
        "test_loss": float(
            optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(yte)).mean()
        ),
        "test_acc": float(jnp.mean(jnp.argmax(logits, -1) == yte)),
        "train_loss_noisy": float(
            optax.softmax_cross_entropy_with_integer_labels(
                model.apply(params, xtr), jnp.asarray(noisy)
            ).mean()
        ),
    }


def _pruning_report(workdir, cells, p, part, title):
    sparsity = [p.target_ratio * s / p.steps for s in range(1, p.steps + 1)]
    cols = sorted(
        {min(max(round(r * p.steps / p.target_ratio), 1), p.steps) - 1 for r in p.report_at}
    )
    curves, rows = {}, []
    for name in p.criteria:
        acc = np.array([c[name] for c in cells])  # (seeds, steps)
        curves[name] = (sparsity, acc.mean(0).tolist())
        row = {"criterion": name}
        for j in cols:
            row[f"acc@{sparsity[j]:.0%}"] = sweep.format_mean_sd(acc[:, j] * 100, 1)
        rows.append(row)
    common.plot_curves(
        os.path.join(workdir, f"{part}_accuracy.png"), curves, title=f"{title}: pruning without fine-tuning",
        xlabel="fraction of prunable units pruned", ylabel="test accuracy",
    )  # fmt: skip
    final = {n: float(np.mean([c[n][-1] for c in cells])) * 100 for n in p.criteria}
    checks = []
    if {"jbr", "jacobian"} <= set(final):
        checks.append(sweep.check(f"{part}: JBR within 1 point of Jacobian-with-labels at the target", abs(final["jbr"] - final["jacobian"]) <= 1.0, f"{final['jbr']:.1f} vs {final['jacobian']:.1f}"))  # fmt: skip
    base = [k for k in ("l1", "taylor", "random") if k in final]
    if "jbr" in final and base:
        checks.append(sweep.check(f"{part}: JBR at least as good as L1/Taylor/random at the target", all(final["jbr"] >= final[k] for k in base), ", ".join(f"{k}: {final[k]:.1f}" for k in base)))  # fmt: skip
    if {"jbr", "exact_tpv"} <= set(final):
        checks.append(sweep.check(f"{part}: JBR close to exact TPV (within 2 points)", abs(final["jbr"] - final["exact_tpv"]) <= 2.0, f"{final['jbr']:.1f} vs {final['exact_tpv']:.1f}"))  # fmt: skip
    dense = sweep.format_mean_sd([c["acc_dense"] * 100 for c in cells], 1)
    return rows, checks, {f"{part}: dense accuracy": dense}


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict:
    """Runs the selected parts; writes results.md, summary.json, plots."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    common.write_config_json(workdir, config)
    store = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    bar = not config.log.progress
    rows, checks, extra = [], [], {}
    cells_of = {
        "pruning": (pruning_cell, "digits MLP"),
        "pruning_cnn": (pruning_cnn_cell, "MNIST CNN"),
    }
    for part, (cell_fn, title) in cells_of.items():
        if part not in config.parts:
            continue
        p = config.pruning
        cells = [
            store.get(f"{part}/seed={s}", lambda s=s, f=cell_fn: f(config, s, options))
            for s in tqdm.trange(config.seed, config.seed + p.num_seeds, disable=bar, desc=part)
        ]
        r, c, e = _pruning_report(workdir, cells, p, part, title)
        rows += [{"part": part, **x} for x in r]
        checks += c
        extra.update(e)
    if "stability" in config.parts:
        s = config.stability
        grid = [
            (t, d, w, n) for t in s.teachers for d in s.dims for w in s.widths for n in s.n_trains
        ]
        st = []
        for t, d, w, n in tqdm.tqdm(grid, disable=bar, desc="stability"):
            cell = store.get(f"stability/{t}/d={d}/w={w}/n={n}", lambda a=(t, d, w, n): stability_cell(config, *a, options))  # fmt: skip
            st.append({"teacher": t, "d": d, "width": w, "n_train": n, **cell})
        for n in s.n_trains:
            sel = [x for x in st if x["n_train"] == n]
            for form in ("quant", "label"):
                inside = np.mean([0.8 <= x[f"{form}_ratio"] <= 1.25 for x in sel])
                extra[f"stability/{form}/n={n}: share of ratios in [0.8, 1.25]"] = round(
                    float(inside), 3
                )
        big = [x for x in st if x["n_train"] >= 100]
        small = [x for x in st if x["n_train"] == min(s.n_trains)]
        share = np.mean([0.8 <= x["quant_ratio"] <= 1.25 for x in big]) if big else float("nan")
        checks.append(sweep.check("quantisation TPV_train/TPV_test in [0.8, 1.25] for most configs with n_train >= 100", bool(share > 0.5), f"share {share:.2f}"))  # fmt: skip
        share_s = np.mean([0.8 <= x["quant_ratio"] <= 1.25 for x in small])
        checks.append(sweep.check("the ratio degrades at the smallest n_train", bool(share_s < share), f"share {share_s:.2f}"))  # fmt: skip
        common.write_json(os.path.join(workdir, "stability.json"), st)
        common.write_results_md(workdir, st, title="TPV stability", filename="stability.md")
    if "selection" in config.parts:
        s = config.selection
        sel = [
            {
                "weight_decay": wd,
                "smoothing": ls,
                **store.get(
                    f"selection/wd={wd}/ls={ls}",
                    lambda wd=wd, ls=ls: selection_cell(config, wd, ls, options),
                ),
            }  # fmt: skip
            for wd in tqdm.tqdm(s.weight_decays, disable=bar, desc="selection")
            for ls in s.smoothings
        ]
        from scipy.stats import spearmanr

        rho = float(spearmanr([x["tpv_train"] for x in sel], [x["test_loss"] for x in sel])[0])
        extra["selection: Spearman(TPV_train, test loss)"] = round(rho, 3)
        checks.append(sweep.check("selection: Spearman(label-noise TPV_train, test loss) > 0", bool(rho > 0), f"{rho:.3f} over {len(sel)} recipes"))  # fmt: skip
        common.write_results_md(workdir, sel, title="TPV model selection", filename="selection.md")
    store.close()
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k != "part", k != "criterion", k))
    return sweep.write_sweep_results(
        workdir, rows, checks, title="P19 TPV and JBR pruning", columns=cols,
        command=sweep.command_line("python -m experiments.train --config=configs/tpv.py"), extra=extra,
    )  # fmt: skip
