"""GIST vs LESS, raw cosine and random targeted data selection with LoRA (P11, specs §11).

Per seed: warm up LoRA on a random ``warmup.fraction`` of the pool (``warmup.epochs`` epochs,
one checkpoint and its Adam state per epoch); score the pool with every method of
``lowrank_jax.selection`` (factorised per-example LoRA gradients, chunked); keep the top
``select.fraction``; fine-tune LoRA from the base on each selection with one fixed recipe and
evaluate on the target's test split. Data, model and base pre-training come from
``data.name``: ``"shakespeare"`` (``selection.make_shakespeare_pool``; char-GPT pre-trained with
``experiments.common.fit``; target: the Histories) or ``"synthetic"``
(``selection.make_synthetic_pool``; MLP). Each seed's selection and each (method, seed) fine-tune
is a cell of :mod:`experiments.common.sweep` (a rerun skips finished cells); ``cells/`` and
``metrics.jsonl``. :mod:`experiments.common.gist_report` writes ``results.md``, ``summary.json``
and ``spectrum.png`` (cumulative energy of the validation-gradient spectrum). Diagnostic (specs §11
(4a)): the off-diagonal energy ratio of the gradient second moment, LoRA factors vs an equal-size
random subset of full-parameter gradients (:func:`selection.lora_vs_full_offdiag`), on the
validation set and on ``select.offdiag_pool`` pool examples, at the last warm-up checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from experiments.common import gist_report as report
from experiments.common import sweep
from experiments.common.digits_shift import adapter_loss, xent
from experiments.common.evaluation import padded_means
from lowrank_jax import adapters, data, models, selection
from lowrank_jax.data.shakespeare import PLAYS
from lowrank_jax.selection.diagnostics import lora_vs_full_offdiag

__all__ = ["check_config", "run"]

METHODS = ("random", "less", "gist", "gist_diag", "cosine", "oracle", "full")


def check_config(config: Any) -> None:
    """Validates ``config``; raises ``common.ConfigError`` naming the bad key."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    name = c.check_choice(config, "data.name", ("shakespeare", "synthetic"))
    keys = (
        ("data.seq_len", "data.pretrain_per_play", "data.pool_per_play", "data.val_per_play")
        + ("data.test_per_play", "model.dim", "model.depth", "model.heads")
        if name == "shakespeare"
        else ("data.num_pool", "data.num_test", "data.num_pretrain")
    )
    for k in keys + ("data.batch_size", "model.pretrain_steps", "model.pretrain_batch"):
        c.check_positive(config, k, integer=True)
    for k in ("adapter.rank", "warmup.epochs", "warmup.batch_size", "select.less_dim"):
        c.check_positive(config, k, integer=True)
    for k in ("select.chunk_size", "select.gist_diag_k", "eval.num_seeds", "select.offdiag_pool"):
        c.check_positive(config, k, integer=True)
    c.check_positive_ints(config, "schedule.eval_steps")
    for k in ("warmup.fraction", "select.fraction", "data.distractor_fraction"):
        c.check_fraction(config, k, allow_zero=k == "data.distractor_fraction")
    for k in ("optim.learning_rate", "warmup.learning_rate", "model.pretrain_lr"):
        c.check_positive(config, k)
    bad = [m for m in config.select.methods if m not in METHODS]
    if bad or not config.select.methods:
        raise c.ConfigError(f"config.select.methods has {bad}: choose from {METHODS}")
    c.check_positive_ints(config, "select.gist_ks")


# ----------------------------------------------------------------------------------------------
# The task: base model, pool, few-shot validation set with subtasks, test set.


class Task(NamedTuple):
    variables: Any  # frozen base {"params": ...}
    rules: list
    example_loss: Any  # (adapters, variables, one example) -> scalar
    batch_loss: Any  # (adapters, variables, batch) -> scalar
    pool: dict  # arrays with a leading pool axis
    pool_kind: np.ndarray  # 0 target, 1 distractor, 2 other
    val: dict
    val_subtask: np.ndarray
    num_subtasks: int
    test: dict
    evaluate: Any  # (adapters, arrays) -> {"loss", ("accuracy")}


@functools.cache
def _gpt_loss(model):
    """``(adapters, variables, batch) -> scalar``: the adapted char-GPT's next-character loss."""
    fwd = adapters.adapt(model.apply)
    return lambda ad, v, batch: xent(fwd(v, ad, batch["x"][:, :-1]), batch["x"][:, 1:])


@functools.cache
def _example_loss(batch_loss):
    """``(adapters, variables, one example) -> scalar``: ``batch_loss`` on a batch of one."""
    return lambda ad, v, ex: batch_loss(ad, v, jax.tree.map(lambda a: a[None], ex))


@functools.cache
def _eval_sums(batch_loss, accuracy_fn=None):
    """The jitted ``sums(ad, variables, chunk, w)``: weighted per-example loss (and accuracy)
    sums of a chunk. ``accuracy_fn(ad, variables, chunk) -> (b,)``."""

    @jax.jit
    def sums(ad, variables, chunk, w):
        per = jax.vmap(functools.partial(_example_loss(batch_loss), ad, variables))
        out = {"loss": jnp.sum(per(chunk) * w)}
        if accuracy_fn is not None:
            out["accuracy"] = jnp.sum(accuracy_fn(ad, variables, chunk) * w)
        return out

    return sums


def _make_evaluate(batch_loss, variables, *, accuracy_fn=None, batch_size=256):
    sums = _eval_sums(batch_loss, accuracy_fn)
    return lambda ad, arrays: padded_means(
        lambda chunk, w: sums(ad, variables, chunk, w), arrays, batch_size
    )


def _shakespeare_task(config: Any, workdir: str, options: common.TrainOptions) -> Task:
    d = config.data
    p = selection.make_shakespeare_pool(
        config.seed, seq_len=d.seq_len, pretrain_per_play=d.pretrain_per_play,
        pool_per_play=d.pool_per_play, val_per_play=d.val_per_play,
        test_per_play=d.test_per_play, distractor_fraction=d.distractor_fraction,
        corrupt_fraction=d.corrupt_fraction,
    )  # fmt: skip
    model = _char_gpt(config, len(p.vocab))
    tx, step = _pretrain_step(config, model)
    params = model.init(jax.random.key(config.seed), p.pretrain_x[:1, :-1])["params"]
    result = common.fit(
        {"params": params, "opt_state": tx.init(params), "step": 0}, None, step,
        data.BatchIterator({"x": p.pretrain_x}, batch_size=config.model.pretrain_batch, seed=0),
        key=jax.random.key(0), num_steps=config.model.pretrain_steps,
        workdir=os.path.join(workdir, "base"), log_every=config.log.every,
        ckpt_every=config.model.pretrain_steps, progress=config.log.progress,
        description="base char-GPT", options=options,
    )  # fmt: skip
    variables = {"params": jax.device_get(result.state["params"])}
    batch_loss = _gpt_loss(model)
    return Task(
        variables, [(t, _lora(config)) for t in config.adapter.targets], _example_loss(batch_loss),
        batch_loss, {"x": p.pool_x}, p.pool_kind, {"x": p.val_x}, p.val_subtask,
        len(p.subtasks), _with_y({"x": p.test_x}),
        _make_evaluate(batch_loss, variables, batch_size=config.eval.batch_size),
    )  # fmt: skip


def _char_gpt(config: Any, vocab_size: int) -> Any:
    m = config.model
    return models.CharGPT(vocab_size, m.dim, m.depth, m.heads, config.data.seq_len)


def _pretrain_step(config: Any, model: Any):
    """``(tx, step)``: the base char-GPT's optimizer and ``fit`` step (next-character loss)."""
    tx = optax.adamw(config.model.pretrain_lr, b2=0.95, weight_decay=0.1)

    def step(state, frozen, batch, key):
        del frozen, key

        def loss(p):
            logits = model.apply({"params": p}, batch["x"][:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["x"][:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, {"loss": value}  # fmt: skip

    return tx, step


# The lowering's character vocabulary (the run's is the text's distinct characters: only the
# embedding's and the output layer's sizes depend on it).
_NOMINAL_VOCAB = 80


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted programs on abstract inputs (no data read): the base model's training (char-GPT
    through ``fit``, or the MLP's ``train_scan``), the LoRA warm-up and fine-tuning scans and the
    evaluation. (The selection pipelines jit inside ``lowrank_jax.selection``.)"""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    d, key, spec = config.data, jax.random.key(0), jax.ShapeDtypeStruct
    out = []
    if d.name == "shakespeare":
        model = _char_gpt(config, _NOMINAL_VOCAB)
        tx, step = _pretrain_step(config, model)
        x = spec((1, d.seq_len), jnp.int32)
        params = jax.eval_shape(lambda k: model.init(k, jnp.zeros(x.shape, x.dtype))["params"], key)
        state = {"params": params, "opt_state": jax.eval_shape(tx.init, params), "step": 0}
        batch = {"x": spec((config.model.pretrain_batch, d.seq_len + 1), jnp.int32)}
        out.append(common.fit_step(step, state, None, batch, mesh=mesh, name="base char-GPT"))
        variables, batch_loss = {"params": params}, _gpt_loss(model)
        n_pool = len(PLAYS) * d.pool_per_play
        pool = {"x": spec((n_pool + round(d.distractor_fraction * n_pool), d.seq_len + 1), jnp.int32)}  # fmt: skip
        accuracy = None
    else:
        dim = inspect.signature(selection.make_synthetic_pool).parameters["dim"].default
        model = models.MLP(tuple(config.model.features), 10)
        variables = jax.eval_shape(model.init, key, jnp.zeros((1, dim)))
        pre = {"x": spec((d.num_pretrain, dim), jnp.float32), "y": spec((d.num_pretrain,), jnp.int32)}  # fmt: skip
        idx = spec((config.model.pretrain_steps, config.model.pretrain_batch), jnp.int32)
        out.append(sweep.train_scan_step("base MLP", variables, None, pre, idx, loss_fn=_full_mlp_loss(model),
                                         tx=sweep.adam(config.model.pretrain_lr), trace=False))  # fmt: skip
        batch_loss = adapter_loss(model)
        pool = {"x": spec((d.num_pool, dim), jnp.float32), "y": spec((d.num_pool,), jnp.int32)}
        accuracy = _mlp_accuracy(model)
    lora = jax.eval_shape(lambda v: adapters.init(key, v, [(t, _lora(config)) for t in config.adapter.targets]), variables)  # fmt: skip
    n, b = pool["x"].shape[0], config.warmup.batch_size
    per_epoch = max(b, round(config.warmup.fraction * n)) // b
    tx_warm, _ = _warmup_tx(config.warmup.learning_rate, per_epoch * config.warmup.epochs)
    warm_state = jax.eval_shape(tx_warm.init, lora)
    out.append(sweep.train_scan_step("LoRA warm-up", lora, variables, pool, spec((per_epoch, b), jnp.int32),
                                     loss_fn=batch_loss, tx=tx_warm, trace=False, opt_state=warm_state))  # fmt: skip
    tx_fine = sweep.adam(config.optim.learning_rate)
    first = min(config.schedule.eval_steps)
    out.append(sweep.train_scan_step("LoRA fine-tuning", lora, variables, pool,
                                     spec((first, config.data.batch_size), jnp.int32),
                                     loss_fn=batch_loss, tx=tx_fine, trace=False))  # fmt: skip
    chunk = {k: spec((config.eval.batch_size, *v.shape[1:]), v.dtype) for k, v in pool.items()}
    chunk.setdefault("y", spec((config.eval.batch_size,), jnp.int32))
    w = spec((config.eval.batch_size,), jnp.float32)
    out.append(common.Step("eval", _eval_sums(batch_loss, accuracy), (lora, variables, chunk, w)))
    return out


def _synthetic_task(config: Any, options: common.TrainOptions) -> Task:
    d = config.data
    s = selection.make_synthetic_pool(
        config.seed, num_pool=d.num_pool, noisy=d.distractor_fraction, num_test=d.num_test,
        num_pretrain=d.num_pretrain,
    )  # fmt: skip
    model = models.MLP(tuple(config.model.features), 10)
    variables = model.init(jax.random.key(config.seed), jnp.asarray(s.pretrain_x[:1]))
    pre = {"x": jnp.asarray(s.pretrain_x), "y": jnp.asarray(s.pretrain_y)}
    idx = sweep.batch_indices(0, len(s.pretrain_y), config.model.pretrain_batch,
                              config.model.pretrain_steps)  # fmt: skip
    variables, _, _ = sweep.train_scan(
        variables, None, pre, jnp.asarray(idx), loss_fn=_full_mlp_loss(model),
        tx=sweep.adam(config.model.pretrain_lr), trace=False, options=options,
    )  # fmt: skip
    batch_loss, acc = adapter_loss(model), _mlp_accuracy(model)
    kind = np.asarray([0, 1, 2])[s.pool_kind]
    return Task(
        variables, [(t, _lora(config)) for t in config.adapter.targets], _example_loss(batch_loss),
        batch_loss, {"x": s.pool_x, "y": s.pool_y}, kind, {"x": s.val_x, "y": s.val_y},
        s.val_subtask, int(s.val_subtask.max()) + 1, {"x": s.test_x, "y": s.test_y},
        _make_evaluate(batch_loss, variables, accuracy_fn=acc, batch_size=config.eval.batch_size),
    )  # fmt: skip


@functools.cache
def _mlp_accuracy(model):
    fwd = adapters.adapt(model.apply)
    return lambda ad, v, b: (jnp.argmax(fwd(v, ad, b["x"]), -1) == b["y"]).astype(jnp.float32)


@functools.cache
def _full_mlp_loss(model):
    return lambda v, _, batch: xent(model.apply(v, batch["x"]), batch["y"])


def _lora(config: Any):
    return adapters.lora(config.adapter.rank, alpha=config.adapter.alpha)


# ----------------------------------------------------------------------------------------------
# Selection: warm-up checkpoints, gradient features, scores.


@functools.cache
def _warmup_tx(lr: float, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    return selection.warmup_optimizer(lr, num_steps=steps)  # one per (lr, steps): compiled once


def _warmup(config: Any, task: Task, seed: int, pool: Any, options: common.TrainOptions) -> list:
    """LoRA warmed up on a random slice of the pool: one checkpoint (and Adam state) per epoch."""
    rng = np.random.default_rng([seed, 5])
    n, b = len(task.pool_kind), config.warmup.batch_size
    warm = rng.choice(n, max(b, round(config.warmup.fraction * n)), replace=False)
    per_epoch = len(warm) // b
    tx, sched = _warmup_tx(config.warmup.learning_rate, per_epoch * config.warmup.epochs)
    rows = sweep.batch_indices(seed, len(warm), b, per_epoch * config.warmup.epochs)
    ad = adapters.init(jax.random.key(seed + 1), task.variables, task.rules)
    ckpts, opt_state = [], None
    for e in range(config.warmup.epochs):
        steps = range(e * per_epoch, (e + 1) * per_epoch)
        ad, opt_state, _ = sweep.train_scan(ad, task.variables, pool, jnp.asarray(warm[rows[steps]]),
                                            loss_fn=task.batch_loss, tx=tx, trace=False,
                                            opt_state=opt_state, options=options)  # fmt: skip
        weight = float(np.mean([sched(i) for i in steps]))
        ckpts.append(selection.warmup_checkpoint(ad, opt_state, weight=weight))
    return ckpts


def _select(config: Any, task: Task, seed: int, options: common.TrainOptions) -> dict[str, Any]:
    """Warm-up, then every method's selected pool indices, selection time and storage."""
    s, n = config.select, len(task.pool_kind)
    pool = jax.tree.map(jnp.asarray, task.pool)
    ckpts = _warmup(config, task, seed, pool, options)
    last = ckpts[-1]
    common_args = (task.example_loss, last.trainable, task.variables, pool, task.val)
    kw = {"num_subtasks": task.num_subtasks, "chunk_size": s.chunk_size}
    ks = [k for k in s.gist_ks if k <= len(task.val_subtask)]
    dk = min(s.gist_diag_k, len(task.val_subtask))
    runs = {  # name -> (scores (n,) or {k: (n,)}, bytes stored per example)
        "less": (lambda: selection.less_pipeline(
            task.example_loss, ckpts, task.variables, pool, task.val, task.val_subtask,
            key=jax.random.key(seed + 2), dim=s.less_dim, **kw), (s.less_dim, len(ckpts))),
        "gist": (lambda: selection.gist_pipeline(*common_args, task.val_subtask, ks=ks, **kw), None),
        "gist_diag": (lambda: selection.gist_pipeline(
            *common_args, task.val_subtask, ks=(dk,), nu=last.nu, **kw)[dk], (dk, 1)),
        "cosine": (lambda: selection.cosine_pipeline(*common_args, chunk_size=s.chunk_size),
                   (len(last.mu), 1)),
    }  # fmt: skip
    nbytes = lambda d, c=1: selection.feature_storage_bytes(dim=d, num_checkpoints=c)  # noqa: E731
    sel = {}
    for name, (fn, size) in runs.items():
        if name in s.methods:
            t0 = time.perf_counter()
            scores = jax.block_until_ready(fn())
            secs = time.perf_counter() - t0
            for k, sc in scores.items() if name == "gist" else [(None, scores)]:
                sel[name if k is None else f"gist_k{k}"] = {
                    "indices": selection.select_top(sc, fraction=s.fraction), "time_s": secs,
                    "bytes": nbytes(*size) if k is None else nbytes(k)}  # fmt: skip
    rng, m = np.random.default_rng([seed, 6]), max(1, round(s.fraction * n))
    target = np.flatnonzero(task.pool_kind == 0)
    refs = {"random": rng.choice(n, m, False), "oracle": rng.choice(target, min(m, len(target)), False),
            "full": np.arange(n)}  # fmt: skip
    sel.update(
        {k: {"indices": v, "time_s": 0.0, "bytes": 0} for k, v in refs.items() if k in s.methods}
    )
    for v in sel.values():
        v["indices"] = np.asarray(v["indices"]).tolist()
    g_val = selection.gradient_features(task.example_loss, last.trainable, task.variables, task.val)
    return {"methods": sel, "spectrum": np.asarray(jnp.linalg.svd(g_val, compute_uv=False)).tolist(),
            "num_params": len(last.mu), "less_paper_bytes": nbytes(s.less_paper_dim, len(ckpts))}  # fmt: skip


def _offdiag(config: Any, task: Task, seed: int, options: common.TrainOptions) -> dict[str, Any]:
    """Specs §11 (4a): off-diagonal energy of LoRA vs full-parameter gradients, at the last
    warm-up checkpoint (the same as the selection's), on the validation set and a pool sample."""
    pool = jax.tree.map(jnp.asarray, task.pool)
    last, n = _warmup(config, task, seed, pool, options)[-1], len(task.pool_kind)
    sub = np.random.default_rng([seed, 7]).choice(n, min(n, config.select.offdiag_pool), False)
    sets = (("val", task.val), ("pool", jax.tree.map(lambda a: a[sub], pool)))
    return {name: lora_vs_full_offdiag(task.example_loss, last.trainable, task.variables,
                                                 ex, key=jax.random.key(seed + 7),
                                                 chunk_size=config.select.chunk_size)
            for name, ex in sets}  # fmt: skip


def _finetune(
    config: Any, task: Task, chosen: list[int], seed: int, options: common.TrainOptions
) -> dict[str, Any]:
    """LoRA from the base on ``chosen``; target metrics after each of ``schedule.eval_steps``."""
    chosen = np.asarray(chosen)
    ad = adapters.init(jax.random.key(seed + 3), task.variables, task.rules)
    stops = sorted(config.schedule.eval_steps)
    rows = chosen[sweep.batch_indices(seed, len(chosen), config.data.batch_size, stops[-1])]
    pool = jax.tree.map(jnp.asarray, task.pool)
    out, opt_state, start = {}, None, 0
    for stop in stops:  # constant-rate Adam continued segment by segment = one run
        ad, opt_state, _ = sweep.train_scan(ad, task.variables, pool, jnp.asarray(rows[start:stop]),
                                            loss_fn=task.batch_loss, opt_state=opt_state,
                                            tx=sweep.adam(config.optim.learning_rate), trace=False,
                                            options=options)  # fmt: skip
        test, val = task.evaluate(ad, task.test), task.evaluate(ad, _with_y(task.val))
        out[str(stop)] = {f"test_{k}": v for k, v in test.items()} | {"valid_loss": val["loss"]}
        start = stop
    kinds = np.bincount(task.pool_kind[chosen], minlength=3) / len(chosen)
    return {"at": out, "target_share": float(kinds[0]), "distractor_share": float(kinds[1])}


def _with_y(arrays):
    return arrays if "y" in arrays else {**arrays, "y": np.zeros(len(arrays["x"]), np.int32)}


# ----------------------------------------------------------------------------------------------
# The run.


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs (or resumes) every cell; writes the table and trend checks; returns the headlines."""
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    os.makedirs(workdir, exist_ok=True)
    text = config.data.name == "shakespeare"
    task = _shakespeare_task(config, workdir, options) if text else _synthetic_task(config, options)
    base = task.evaluate(adapters.init(jax.random.key(0), task.variables, task.rules), task.test)
    cells = sweep.CellStore(workdir, options=options, resume=config.ckpt.resume)
    seeds = range(config.seed, config.seed + config.eval.num_seeds)
    res: dict[str, list] = {}
    sels = []
    for seed in seeds:
        sel = cells.get(
            f"select/seed={seed}", functools.partial(_select, config, task, seed, options)
        )
        sels.append({**sel, "offdiag": cells.get(f"offdiag/seed={seed}",
                                                 functools.partial(_offdiag, config, task, seed, options))})  # fmt: skip
        for name, v in sel["methods"].items():
            cell = cells.get(f"{name}/seed={seed}",
                             functools.partial(_finetune, config, task, v["indices"], seed, options))  # fmt: skip
            res.setdefault(name, []).append({**cell, "time_s": v["time_s"], "bytes": v["bytes"]})
    cells.close()
    return report.write_results(config, workdir, res, sels, base)
