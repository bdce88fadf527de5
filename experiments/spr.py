r"""P13 SPR: prompts for a frozen multimodal transformer under missing modalities, against the
probe, MAP, MSP and DCP-like prompts, with SPR's ablations (configs/spr.py describes the study).

``run(config, workdir)``, per seed:

1. splits the UCI Multiple Features digits (two views = two modalities; stratified
   train/valid/test), standardises every view with the training statistics;
2. pre-trains a ``prompts.MultimodalTransformer`` on complete training pairs through
   ``experiments.common.fit`` (checkpointed under ``<workdir>/pretrain-seed<s>/``) and freezes it;
   a missing modality then enters it as a blank input (zero standardised features, tokens kept in
   the attention, as MAP), and for the arms ``<method>:drop`` of ``missing.drop_methods`` its
   tokens are masked out of the attention instead (the ablation);
3. per method and learning rate of ``optim.learning_rates``: trains the method's prompts and the
   head (initialised from the pre-trained head) for ``schedule.prompt_steps`` AdamW steps at the
   missing-both rate ``missing.train_rate`` (``sweep.train_scan``; the rate lives in the optimizer
   state, so one compilation serves the grid); keeps the rate with the best validation macro-F1
   (validation at the same missing rate);
4. evaluates test macro-F1 at every ``missing.test_rates`` (missing-both patterns drawn once per
   seed and rate, shared by all arms) and per missing type (all complete, all without view 0,
   all without view 1).

Each (seed, arm) is a cell (``cells/<key>.json``; a rerun reads finished cells back).
:mod:`experiments.common.spr_report` writes ``results.md`` / ``summary.json`` (mean and 95%
t-interval over seeds, the trend checks of specs.md §13) and ``f1_vs_missing_rate.png``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from experiments import common
from experiments.common import spr_report as report
from experiments.common import sweep
from lowrank_jax import data, prompts
from lowrank_jax.adapters import count_params
from lowrank_jax.data.multiview import MULTIPLE_FEATURES_VIEWS
from lowrank_jax.prompts import training
from lowrank_jax.prompts.backbone import MISSING_INPUTS
from lowrank_jax.prompts.methods import (
    PromptMethod,
    dcp_prompts,
    map_prompts,
    modality_prompts,
    no_prompts,
)
from lowrank_jax.prompts.missing import sample_missing
from lowrank_jax.prompts.training import init_trainable, prompted_logits, split_head

__all__ = ["GROWABLE", "METHODS", "arms", "check_config", "run"]

METHODS = ("probe", "map", "msp", "dcp", "spr", "spr-gif", "spr-lfr", "spr-cfs")
# A workdir may be resumed with more seeds appended (cells are keyed by seed and arm).
GROWABLE = ("seeds",)


def arms(config: Any) -> dict[str, tuple[str, str]]:
    """``{arm name: (method, missing_input)}``: every method with the blank missing input, then
    ``<method>:drop`` for each of ``missing.drop_methods`` (missing tokens masked out instead)."""
    out = {m: (m, "blank") for m in config.methods}
    return {**out, **{f"{m}:drop": (m, "drop") for m in config.missing.drop_methods}}


def check_config(config: Any) -> None:
    """Validates the config before anything is computed."""
    c = common
    seeds = c.get_path(config, "seeds")
    if not seeds or any(not isinstance(s, int) or s < 0 for s in seeds):
        raise c.ConfigError(f"config.seeds={seeds!r} is invalid: a non-empty tuple of ints >= 0")
    methods = c.get_path(config, "methods")
    if not methods or any(m not in METHODS for m in methods) or len(set(methods)) < len(methods):
        raise c.ConfigError(
            f"config.methods={methods!r} is invalid: a non-empty tuple of distinct names from "
            f"{METHODS}"
        )
    drop = c.get_path(config, "missing.drop_methods")
    if any(m not in METHODS for m in drop) or len(set(drop)) < len(drop):
        raise c.ConfigError(
            f"config.missing.drop_methods={drop!r} is invalid: distinct names from {METHODS}"
        )
    views = c.get_path(config, "data.views")
    if len(views) < 2 or any(v not in MULTIPLE_FEATURES_VIEWS for v in views):
        raise c.ConfigError(
            f"config.data.views={views!r} is invalid: two or more of "
            f"{tuple(MULTIPLE_FEATURES_VIEWS)}"
        )
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    c.check_fraction(config, "data.test_fraction", allow_zero=False)
    for key in ("dim", "depth", "heads", "mlp_dim", "tokens"):
        c.check_positive(config, f"model.{key}", integer=True)
    heads = config.model.heads
    c.check_divisible(config, "model.dim", heads, why=f"model.heads={heads} (heads split d)")
    for key in ("layers", "tokens", "bottleneck", "hidden"):
        c.check_positive(config, f"prompt.{key}", integer=True)
    if config.prompt.layers > config.model.depth:
        raise c.ConfigError(
            f"config.prompt.layers={config.prompt.layers} is invalid: at most model.depth="
            f"{config.model.depth}"
        )
    rates = c.get_path(config, "missing.test_rates")
    named = [("missing.train_rate", c.get_path(config, "missing.train_rate"))]
    named += [(f"missing.test_rates[{i}]", r) for i, r in enumerate(rates)]
    for key, value in named:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise c.ConfigError(f"config.{key}={value!r} is invalid: a missing rate in [0, 1]")
    if not rates:
        raise c.ConfigError("config.missing.test_rates=() is invalid: give at least one rate")
    for key in ("pretrain_steps", "prompt_steps", "batch_size"):
        c.check_positive(config, f"schedule.{key}", integer=True)
    c.check_positive(config, "optim.pretrain_learning_rate")
    c.check_nonnegative(config, "optim.weight_decay")
    c.check_nonnegative(config, "optim.prompt_weight_decay")
    lrs = c.get_path(config, "optim.learning_rates")
    if not lrs or any(not isinstance(x, int | float) or x <= 0 for x in lrs):
        raise c.ConfigError(f"config.optim.learning_rates={lrs!r} is invalid: positive numbers")
    c.check_positive(config, "log.every", integer=True)


# ----------------------------------------------------------------------------------------------
# Data, backbone, methods.


def _splits(config: Any, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """``{"train"|"valid"|"test": {"x0", "x1", ..., "y"}}``, standardised by the train split."""
    mv = data.load_multiple_features(config.data.views)
    index = data.Dataset(np.arange(len(mv.y)), mv.y, mv.class_names)
    parts = data.split(
        index,
        seed=seed,
        valid_fraction=config.data.valid_fraction,
        test_fraction=config.data.test_fraction,
    )
    train_idx = parts.train.x
    stats = [(v[train_idx].mean(0), v[train_idx].std(0) + 1e-6) for v in mv.views]
    out = {}
    for name in ("train", "valid", "test"):
        idx = getattr(parts, name).x
        arrays = {
            f"x{i}": (v[idx] - m) / s
            for i, (v, (m, s)) in enumerate(zip(mv.views, stats, strict=True))
        }
        out[name] = {**{k: a.astype(np.float32) for k, a in arrays.items()}, "y": mv.y[idx]}
    return out


def _model(
    config: Any, widths: tuple[int, ...], missing_input: str = "blank"
) -> prompts.MultimodalTransformer:
    m = config.model
    return prompts.MultimodalTransformer(
        tuple(f"x{i}" for i in range(len(widths))),
        widths,
        (m.tokens,) * len(widths),
        dim=m.dim,
        depth=m.depth,
        heads=m.heads,
        mlp_dim=m.mlp_dim,
        num_classes=10,
        missing_input=missing_input,
    )


def _features(batch: dict[str, Any], num: int) -> dict[str, Any]:
    return {f"x{i}": batch[f"x{i}"] for i in range(num)}


def _pretrain_step(config: Any, model):
    """``(tx, step)``: the backbone's optimizer and ``fit`` step (cross-entropy, complete pairs)."""
    num = len(config.data.views)
    tx = optax.adamw(config.optim.pretrain_learning_rate, weight_decay=config.optim.weight_decay)

    def step(state, frozen, batch, key):
        del frozen, key

        def loss(p):
            logits = model.apply({"params": p}, _features(batch, num))
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, g = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = tx.update(g, state["opt_state"], state["params"])
        new = optax.apply_updates(state["params"], updates)
        return {**state, "params": new, "opt_state": opt_state}, {"loss": value}

    return tx, step


def _pretrainer(config: Any, model, options: common.TrainOptions):
    """``pretrain(arrays, seed, workdir)``: the backbone trained on complete pairs through
    ``common.fit``. Its step and forward are built once, so later seeds reuse the compilations."""
    num = len(config.data.views)
    tx, step = _pretrain_step(config, model)
    init, apply = jax.jit(model.init), jax.jit(model.apply)

    def pretrain(arrays, seed: int, workdir: str) -> dict[str, Any]:
        params = init(jax.random.key(seed), _features(arrays["train"], num))["params"]
        valid = arrays["valid"]

        def evaluate(state, frozen):
            del frozen
            logits = apply({"params": state["params"]}, _features(valid, num))
            return {"valid/accuracy": float(np.mean(np.argmax(logits, -1) == valid["y"]))}

        steps = config.schedule.pretrain_steps
        result = common.fit(
            {"params": params, "opt_state": tx.init(params), "step": 0},
            None,
            step,
            data.BatchIterator(arrays["train"], batch_size=config.schedule.batch_size, seed=seed),
            key=jax.random.key(seed + 1),
            num_steps=steps,
            workdir=os.path.join(workdir, f"pretrain-seed{seed}"),
            eval_fn=evaluate,
            log_every=min(config.log.every, steps),
            ckpt_every=max(1, steps // 4),
            description=f"pre-train seed {seed}",
            options=options,
        )
        return {"params": result.state["params"], "complete_valid_accuracy": result.last_eval}

    return pretrain


def _method(config: Any, name: str, num_modalities: int) -> PromptMethod:
    """The library's method value for a config name (``spr-gif``: SPR without GIF)."""
    if name == "probe":
        return no_prompts(num_modalities=num_modalities)
    kw = dict(
        num_modalities=num_modalities,
        num_layers=config.prompt.layers,
        num_tokens=config.prompt.tokens,
        dim=config.model.dim,
    )
    if name == "map":
        return map_prompts(**kw)
    if name == "msp":
        return modality_prompts(**kw)
    if name == "dcp":
        return dcp_prompts(**kw, bottleneck=config.prompt.bottleneck)
    off = {m: False for m in name.split("-")[1:]}
    return prompts.spr_prompts(**kw, hidden=config.prompt.hidden, **off)


@functools.cache
def _adamw(weight_decay: float) -> optax.GradientTransformation:
    """AdamW whose learning rate is a state entry, so one compilation serves the whole grid."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=weight_decay)


# ----------------------------------------------------------------------------------------------
# One cell: a method on one seed, its learning rate chosen on validation.


def _with_missing(arrays, missing) -> dict[str, Any]:
    return {**arrays, "missing": np.asarray(missing)}


def _cell(config, ctx, method, fns, seed: int, options: common.TrainOptions) -> dict[str, Any]:
    loss_fn, logits_fn = fns
    num = len(config.data.views)
    train, valid = ctx["train"], ctx["valid"]
    tx = _adamw(config.optim.prompt_weight_decay)
    idx = sweep.batch_indices(
        seed, len(train["y"]), config.schedule.batch_size, config.schedule.prompt_steps
    )

    def macro_f1(trainable, split):
        logits = logits_fn(trainable, ctx["frozen"], _features(split, num), split["missing"])
        return training.macro_f1(np.argmax(logits, -1), split["y"], num_classes=10)

    trials = []
    for lr in config.optim.learning_rates:
        trainable = init_trainable(jax.random.key(seed), method, ctx["head"])
        opt_state = tx.init(trainable)
        opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
        trainable, _, _ = sweep.train_scan(
            trainable, ctx["frozen"], train, idx, loss_fn=loss_fn, tx=tx, trace=False,
            opt_state=opt_state, options=options,
        )  # fmt: skip
        trials.append((macro_f1(trainable, valid), lr, trainable))
    best_f1, best_lr, trainable = max(trials, key=lambda t: t[0])
    out = {
        "pretrain_valid_accuracy": ctx["pretrain_valid_accuracy"],
        "learning_rate": best_lr,
        "valid_f1": {str(lr): f for f, lr, _ in trials},
        "trainable_params": count_params(trainable),
        "prompt_params": count_params(trainable["prompts"]),
    }
    for name, split in ctx["tests"].items():
        out[name] = macro_f1(trainable, split)
    return out


def _context(config, arrays, pre, seed) -> dict[str, Any]:
    """Frozen backbone, head, and the missing patterns of every split (shared by all methods)."""
    num = len(config.data.views)
    frozen, head = split_head(pre["params"])
    key = jax.random.key(10_000 + seed)

    def pattern(split, rate, kind, i):
        n = len(arrays[split]["y"])
        k = jax.random.fold_in(key, i)
        return sample_missing(k, n, num_modalities=num, rate=rate, kind=kind)

    rate = config.missing.train_rate
    ctx = {
        "frozen": frozen,
        "head": head,
        "pretrain_valid_accuracy": pre["complete_valid_accuracy"].get("valid/accuracy", np.nan),
        "train": _with_missing(arrays["train"], pattern("train", rate, "both", 0)),
        "valid": _with_missing(arrays["valid"], pattern("valid", rate, "both", 1)),
        "tests": {},
    }
    for i, r in enumerate(config.missing.test_rates):
        ctx["tests"][f"f1@{r:g}"] = _with_missing(arrays["test"], pattern("test", r, "both", 2 + i))
    ctx["tests"]["complete"] = _with_missing(arrays["test"], pattern("test", 0.0, "complete", 0))
    for i, view in enumerate(config.data.views):
        ctx["tests"][f"no_{view}"] = _with_missing(arrays["test"], pattern("test", 1.0, i, 0))
    return ctx


def _method_fns(model: Any, method: PromptMethod, num: int):
    """``(loss_fn, logits)`` of a method: the ``train_scan`` loss and the jitted forward
    ``logits(trainable, frozen, features, missing)``; one of each per method, compiled once."""
    fwd = functools.partial(prompted_logits, model, method=method)
    return (
        lambda t, f, b: optax.softmax_cross_entropy_with_integer_labels(
            fwd(f, t, features=_features(b, num), missing=b["missing"]), b["y"]
        ).mean(),
        jax.jit(lambda t, f, x, mi: fwd(f, t, features=x, missing=mi)),
    )


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The backbone's ``fit`` step and validation forward, and every method's ``train_scan`` and
    forward, on abstract inputs (no data read; split sizes from the 2,000 examples and the
    configured fractions)."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    num, spec, key = len(config.data.views), jax.ShapeDtypeStruct, jax.random.key(0)
    widths = tuple(MULTIPLE_FEATURES_VIEWS[v][1] for v in config.data.views)
    model = _model(config, widths)
    total, d = 2000, config.data  # the UCI Multiple Features digits

    def arrays(n: int, missing: bool = False) -> dict[str, Any]:
        out = {f"x{i}": spec((n, w), jnp.float32) for i, w in enumerate(widths)}
        out["y"] = spec((n,), jnp.int32)
        return {**out, "missing": spec((n, num), jnp.bool_)} if missing else out

    n_valid, n_test = round(total * d.valid_fraction), round(total * d.test_fraction)
    n_train = total - n_valid - n_test
    tx, step = _pretrain_step(config, model)
    params = jax.eval_shape(lambda k, x: model.init(k, x)["params"], key, _features(arrays(1), num))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": 0}
    out = [
        common.fit_step(step, state, None, arrays(config.schedule.batch_size), mesh=mesh, name="backbone"),
        common.Step("backbone valid", jax.jit(model.apply), ({"params": params}, _features(arrays(n_valid), num))),
    ]  # fmt: skip
    frozen, head = jax.eval_shape(split_head, params)
    missing = np.asarray(sample_missing(key, 2, num_modalities=num, rate=0.5, kind="both"))  # fmt: skip
    tx = _adamw(config.optim.prompt_weight_decay)
    models = {mode: _model(config, widths, mode) for mode in MISSING_INPUTS}
    for m, (name, mode) in arms(config).items():
        method = _method(config, name, num)
        loss_fn, logits = _method_fns(models[mode], method, num)
        trainable = jax.eval_shape(lambda h, method=method: init_trainable(key, method, h), head)  # fmt: skip
        opt_state = jax.eval_shape(tx.init, trainable)
        train = {**arrays(n_train), "missing": spec((n_train, *missing.shape[1:]), missing.dtype)}
        idx = spec((config.schedule.prompt_steps, config.schedule.batch_size), jnp.int32)
        out.append(sweep.train_scan_step(m, trainable, frozen, train, idx, loss_fn=loss_fn, tx=tx, trace=False, opt_state=opt_state))  # fmt: skip
        test = _features(arrays(n_test), num), spec((n_test, *missing.shape[1:]), missing.dtype)
        out.append(common.Step(f"{m} logits", logits, (trainable, frozen, *test)))
    return out


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    store = sweep.CellStore(workdir, options=options)
    num = len(config.data.views)
    methods = {arm: (_method(config, m, num), mode) for arm, (m, mode) in arms(config).items()}
    model, fns = None, {}
    bar = tqdm(total=len(config.seeds) * len(methods), desc="spr cells", disable=None)
    for seed in config.seeds:
        keys = {m: f"seed={seed}/{m}" for m in methods}
        if all(k in store for k in keys.values()):
            for k in keys.values():
                store.get(k, dict)  # read back
            bar.update(len(keys))
            continue
        arrays = _splits(config, seed)
        if model is None:
            widths = tuple(arrays["train"][f"x{i}"].shape[1] for i in range(num))
            models = {mode: _model(config, widths, mode) for mode in MISSING_INPUTS}
            model = models["blank"]  # pre-trained on complete pairs: both modes agree there
            pretrain = _pretrainer(config, model, options)
            fns = {
                m: _method_fns(models[mode], method, num) for m, (method, mode) in methods.items()
            }
        pre = pretrain(arrays, seed, workdir)
        ctx = _context(config, arrays, pre, seed)
        for m, (method, _) in methods.items():
            cell = functools.partial(_cell, config, ctx, method, fns[m], seed, options)
            store.get(keys[m], cell)
            bar.update()
    bar.close()
    store.close()
    return report.write_results(config, workdir, store.cells)
