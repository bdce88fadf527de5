"""CASA (P18) on MiniLM: a LoRA trained on the source, put on a fine-tuned target, against merges.

See ``configs/casa.py`` for the setting. Per seed: train the target (full fine-tuning of the top
layers and a genre head: cross-entropy on noisy inputs + self-distillation of the source's pooled
features), a LoRA + play head on the source, and an oracle LoRA + play head on the target, each
through ``experiments.common.fit`` (resumable). Then every transfer method delivers top-layer
weights for the target (``lowrank_jax.merging`` does the merging; this module only picks
hyper-parameters on the validation split and evaluates). Each seed is a cell, stored by
:class:`experiments.common.sweep.CellStore` as ``cells/seed=<s>.json`` (a rerun reads a finished
seed back; its trainings live in ``seed_<s>/``); :mod:`experiments.common.casa_report` turns the
cells into ``results.md``, ``results.json`` and ``transfer.png``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import common
from experiments.common import casa_report, lowering, sweep
from lowrank_jax import adapters, data, merging, models
from lowrank_jax.data.shakespeare import GENRES, PLAYS
from lowrank_jax.merging.casa import casa_diagnostics
from lowrank_jax.models.bert import BertTopClassifier, split_encoder
from lowrank_jax.models.bert_prefix import encode_prefix, prefix_encoder

METHODS = ("direct", "source_revert", "task_arithmetic", "ties", "dare", "casa", "oracle")


def check_config(config: Any) -> None:
    """Validates ``config``; raises ``common.ConfigError`` naming the first bad key."""
    c = common
    c.check_nonnegative(config, "seed", integer=True)
    c.check_positive(config, "num_seeds", integer=True)
    for key in ("data.passage_chars", "data.seq_len", "data.per_play", "data.batch_size"):
        c.check_positive(config, key, integer=True)
    c.check_fraction(config, "data.valid_fraction", allow_zero=False)
    c.check_fraction(config, "data.test_fraction", allow_zero=False)
    plays = c.get_path(config, "data.lora_plays")
    if isinstance(plays, str) or len(plays) < 2 or set(plays) - set(PLAYS):
        raise c.ConfigError(
            f"config.data.lora_plays={plays!r} is invalid: at least 2 keys of "
            "lowrank_jax.data.shakespeare.PLAYS"
        )
    if not 1 <= c.get_path(config, "model.first_layer") < 6:
        raise c.ConfigError("config.model.first_layer must lie in [1, 6) (MiniLM has 6 layers)")
    for key in ("target.steps", "adapter.steps", "adapter.rank", "merge.rank"):
        c.check_positive(config, key, integer=True)
    for key in ("target.learning_rate", "adapter.learning_rate", "adapter.alpha"):
        c.check_positive(config, key)
    c.check_nonnegative(config, "target.noise")
    c.check_nonnegative(config, "target.distill_weight")
    for key in ("merge.ties", "merge.dare"):
        for density, scale in c.get_path(config, key):
            if not (0 < density <= 1 and scale > 0):
                raise c.ConfigError(f"config.{key}: (density in (0, 1], scale > 0) pairs")
    if c.get_path(config, "merge.ties_trim") not in ("global", "per_kernel"):
        raise c.ConfigError("config.merge.ties_trim must be 'global' or 'per_kernel'")
    for rot, scale in c.get_path(config, "merge.casa"):
        if not (rot > 0 and scale > 0):
            raise c.ConfigError("config.merge.casa: (rotation_threshold > 0, scale > 0) pairs")
    if not c.get_path(config, "merge.scales"):
        raise c.ConfigError("config.merge.scales must hold at least one scale")


# ----------------------------------------------------------------------------------------------
# Data: hidden states of the cached lower layers, genre and play labels.


@functools.lru_cache(maxsize=1)
def _hidden(passage_chars: int, per_play: int, seq_len: int, first_layer: int):
    """``(hidden (N, seq_len, d), genre (N,), play (N,))`` over all 35 plays (full-length only)."""
    bert_config, variables, tokenizer = models.load_minilm()
    ds = data.load_shakespeare(
        label="play", passage_chars=passage_chars, max_passages_per_play=per_play
    )
    genre = np.asarray([GENRES.index(PLAYS[ds.class_names[p]][0]) for p in ds.y])
    batch = models.tokenize(tokenizer, list(ds.x), max_len=seq_len)
    full = batch["attention_mask"].all(axis=1)
    ids = batch["input_ids"][full]
    hidden = encode_prefix(bert_config, variables, ids, first_layer=first_layer)
    return hidden, genre[full].astype(np.int32), ds.y[full], ds.class_names


def _task_splits(config: Any, seed: int) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    d = config.data
    hidden, genre, play, names = _hidden(
        d.passage_chars, d.per_play, d.seq_len, config.model.first_layer
    )
    lora_ids = [names.index(p) for p in d.lora_plays]
    on_lora = np.isin(play, lora_ids)
    relabel = np.searchsorted(np.sort(lora_ids), play[on_lora])
    tasks = {
        "genre": (np.arange(len(genre)), genre, GENRES),
        "play": (np.flatnonzero(on_lora), relabel.astype(np.int32), tuple(sorted(d.lora_plays))),
    }
    out = {}
    for task, (rows, y, classes) in tasks.items():
        parts = data.split(
            data.Dataset(rows, y, classes),
            seed=seed,
            valid_fraction=d.valid_fraction,
            test_fraction=d.test_fraction,
        )
        out[task] = {
            part: {"x": hidden[getattr(parts, part).x], "y": getattr(parts, part).y}
            for part in ("train", "valid", "test")
        }
    return out


# ----------------------------------------------------------------------------------------------
# Training (through common.fit).


def _fit(config, state, frozen, step, arrays, seed, workdir, name, steps, options):
    batches = data.BatchIterator(arrays, batch_size=config.data.batch_size, seed=seed)
    result = common.fit(
        state,
        frozen,
        step,
        batches,
        key=jax.random.key(seed),
        num_steps=steps,
        workdir=os.path.join(workdir, name),
        log_every=config.log.every,
        ckpt_every=steps,
        max_to_keep=1,
        progress=config.log.progress,
        description=name,
        options=options,
    )
    return jax.device_get(result.state)


def _target_setup(config, model, feats, source, x, key, *, std):
    """The target's train state (top layers + a fresh genre head) and its ``fit`` step:
    cross-entropy on inputs with noise ``config.target.noise * std`` + self-distillation of the
    source's features. ``x``: hidden states with a leading batch axis (arrays or abstract)."""
    init = model.init(key, jnp.zeros((1, *x.shape[1:]), jnp.float32))["params"]
    params = {**source, "head": init["head"]}
    tx = optax.adamw(config.target.learning_rate, weight_decay=0.0)
    noise, beta = config.target.noise * std, config.target.distill_weight

    def step(state, frozen, batch, key):
        x_noisy = batch["x"] + noise * jax.random.normal(key, batch["x"].shape)
        teacher = feats(frozen, batch["x"])

        def loss_fn(p):
            student = feats({k: v for k, v in p.items() if k != "head"}, x_noisy)
            logits = student @ p["head"]["kernel"] + p["head"]["bias"]  # the classifier's head
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            distill = jnp.mean(jnp.sum((student - teacher) ** 2, -1)) / jnp.mean(
                jnp.sum(teacher**2, -1)
            )
            return ce + beta * distill, (ce, distill)

        (loss, (ce, distill)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        new = optax.apply_updates(state["params"], updates)
        return {**state, "params": new, "opt_state": opt}, {"ce": ce, "distill": distill}

    return {"params": params, "opt_state": tx.init(params), "step": 0}, step


def _train_target(config, model, feats, source, splits, seed, workdir, options):
    """Full fine-tuning of the top layers + genre head: CE on noisy inputs + self-distillation."""
    x = splits["genre"]["train"]["x"]
    state, step = _target_setup(
        config, model, feats, source, x, jax.random.key(seed), std=float(np.std(x))
    )
    steps, train = config.target.steps, splits["genre"]["train"]
    out = _fit(config, state, source, step, train, seed, workdir, "target", steps, options)
    return out["params"]


def _lora_setup(config, model, body, x, seed):
    """The train state of a LoRA (on ``config.adapter.targets``) + a fresh head on frozen ``body``,
    and its ``fit`` step. ``x``: inputs with a leading batch axis (arrays or abstract)."""
    init = model.init(jax.random.key(seed + 1), jnp.zeros((1, *x.shape[1:]), jnp.float32))
    init = init["params"]
    spec = adapters.lora(rank=config.adapter.rank, alpha=config.adapter.alpha)
    variables = {"params": {**body, "head": init["head"]}}
    rules = [(t, spec) for t in config.adapter.targets]
    lora = adapters.init(jax.random.key(seed + 2), variables, rules)
    adapted = adapters.adapt(model.apply)
    tx = optax.adamw(config.adapter.learning_rate, weight_decay=0.0)

    def step(state, frozen, batch, key):
        del key

        def loss_fn(t):
            logits = adapted({"params": {**frozen, "head": t["head"]}}, t["lora"], batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        trained = {"lora": state["lora"], "head": state["head"]}
        loss, grads = jax.value_and_grad(loss_fn)(trained)
        updates, opt = tx.update(grads, state["opt_state"], trained)
        return {**state, **optax.apply_updates(trained, updates), "opt_state": opt}, {"loss": loss}

    trained = {"lora": lora, "head": init["head"]}
    return {**trained, "opt_state": tx.init(trained), "step": 0}, step


def _train_lora(config, model, body, arrays, seed, workdir, name, options):
    """LoRA (on ``config.adapter.targets``) + a fresh head on frozen ``body``; returns both."""
    state, step = _lora_setup(config, model, body, arrays["x"], seed)
    out = _fit(
        config, state, body, step, arrays, seed, workdir, name, config.adapter.steps, options
    )
    return out["lora"], out["head"]


# ----------------------------------------------------------------------------------------------
# Evaluation and the methods.


def _merged(body, delivered):
    return adapters.fold({"params": body}, delivered)["params"]


def _rank(delivered) -> int:
    """The largest LoRA rank in an adapter set (every merge states the rank it delivers)."""
    return max(int(a.kind.rank) for a in delivered.values())


def _candidates(config, source, target, lora, key):
    """``{method: [(hparams, top-layer weights, delivered adapter rank), ...]}``: each merge
    of ``[tau, lora]`` (``tau`` the target's task vector) delivered relative to ``tau``."""
    r, m = config.merge.rank, config.merge
    tau = merging.task_vector(
        {"params": target}, {"params": source}, targets=config.adapter.targets
    )
    pair, onto = [tau, lora], {"rank": r, "relative_to": tau}
    merges = {  # method: (hyper-parameter names, their candidates, merge(*values) -> adapters)
        "task_arithmetic": (
            ("scale",),
            [(s,) for s in m.scales],
            lambda s: merging.merge_task_arithmetic(pair, weights=(1.0, s), **onto),
        ),
        "ties": (
            ("density", "scale"),
            m.ties,
            lambda d, s: merging.merge_ties(
                pair, density=d, weights=(1.0, s), trim=m.ties_trim, **onto
            ),
        ),
        "dare": (
            ("density", "scale"),
            m.dare,
            lambda d, s: merging.merge_dare(pair, key, density=d, weights=(1.0, s), **onto),
        ),
        "casa": (
            ("rotation_threshold", "scale"),
            m.casa,
            lambda t, s: merging.casa(
                {"params": source}, {"params": target}, lora, rank=r, weight=s, rotation_threshold=t
            ),
        ),
    }
    out = {
        "direct": [({}, _merged(target, lora), _rank(lora))],
        "source_revert": [({}, _merged(source, lora), _rank(lora))],
    }
    for method, (names, grid, merge) in merges.items():
        delivered = [(dict(zip(names, values, strict=True)), merge(*values)) for values in grid]
        out[method] = [(hp, _merged(target, ads), _rank(ads)) for hp, ads in delivered]
    return out


def _evaluate(fns, body, play_head, genre_head, target_genre, norm_ref, split, splits):
    play, genre = splits["play"][split], splits["genre"][split]
    play_logits = fns["logits"]({**body, "head": play_head}, play["x"])
    genre_logits = fns["logits"]({**body, "head": genre_head}, genre["x"])
    norms = np.linalg.norm(fns["features"](body, play["x"]), axis=-1)
    pred = np.argmax(genre_logits, -1)
    out = {
        "play_accuracy": float(np.mean(np.argmax(play_logits, -1) == play["y"])),
        "genre_accuracy": float(np.mean(pred == genre["y"])),
        "norm": float(np.mean(norms)),
    }
    if target_genre is not None:
        out["genre_agreement"] = float(np.mean(pred == target_genre[split]))
    if norm_ref is not None:
        out["norm_inflation"] = out["norm"] / norm_ref[split]
    out["combined"] = 0.5 * (out["play_accuracy"] + out["genre_accuracy"])
    return out


def _models(config, bert_config):
    """``(genre_model, play_model, feats, logits)``: the top-layer classifiers of the two tasks,
    ``feats(body, x)`` (pooled top-layer features) and the jitted ``logits(params, x)`` (the
    genre or the play classifier, by the head's size)."""
    first, d = config.model.first_layer, bert_config.hidden_size
    genre_model = BertTopClassifier(bert_config, first, len(GENRES))
    play_model = BertTopClassifier(bert_config, first, len(config.data.lora_plays))
    feature_model = BertTopClassifier(bert_config, first, d)

    def feats(body, x):  # pooled top-layer features: the identity head's logits
        identity = {"kernel": jnp.eye(d), "bias": jnp.zeros(d)}
        return feature_model.apply({"params": {**body, "head": identity}}, x)

    @jax.jit
    def logits(params, x):
        n = params["head"]["bias"].shape[0]
        return (genre_model if n == 3 else play_model).apply({"params": params}, x)

    return genre_model, play_model, feats, logits


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The jitted programs of a seed on abstract inputs (no data, no weights read): the cached
    prefix encoder, the target's and the LoRA's ``fit`` steps, and the evaluation forwards."""
    check_config(config)
    mesh = common.make_mesh() if mesh is None else mesh
    bert_config, encoder = lowering.abstract_minilm()
    prefix_config, prefix_vars, top = split_encoder(bert_config, encoder, config.model.first_layer)
    genre_model, play_model, feats, logits = _models(config, bert_config)
    d, b = config.data, config.data.batch_size
    x = jax.ShapeDtypeStruct((b, d.seq_len, bert_config.hidden_size), jnp.float32)
    batch = {"x": x, "y": jax.ShapeDtypeStruct((b,), jnp.int32)}
    target, target_step = common.eval_shape_with_static(
        lambda source: _target_setup(
            config, genre_model, feats, source, x, jax.random.key(0), std=1.0
        ),
        top,
    )
    lora, lora_step = common.eval_shape_with_static(
        lambda body: _lora_setup(config, play_model, body, x, 0), top
    )
    eval_x = jax.ShapeDtypeStruct((config.eval.batch_size, *x.shape[1:]), jnp.float32)
    ids = jax.ShapeDtypeStruct((64, d.seq_len), jnp.int32)  # _hidden's chunks of 64 passages
    return [
        common.Step("prefix encoder", prefix_encoder(prefix_config), (prefix_vars, ids)),
        common.fit_step(target_step, target, top, batch, mesh=mesh, name="target"),
        common.fit_step(lora_step, lora, top, batch, mesh=mesh, name="lora"),
        common.Step("logits", logits, ({**top, "head": target["params"]["head"]}, eval_x)),
        common.Step("features", jax.jit(feats), (top, eval_x)),
    ]


def _run_seed(config, seed, *, workdir, bert_config, options):
    """One seed's cell: its trainings in ``<workdir>/seed_<seed>``, every method's test row."""
    logging.info("casa: seed %d", seed)
    workdir = os.path.join(workdir, f"seed_{seed}")
    splits = _task_splits(config, seed)
    _, _, top = split_encoder(*models.load_minilm()[:2], config.model.first_layer)
    source = jax.device_get(top)
    genre_model, play_model, feats, _logits = _models(config, bert_config)

    def batched(fn):
        def run(params, x):
            bs = config.eval.batch_size
            return np.concatenate(
                [np.asarray(fn(params, x[i : i + bs])) for i in range(0, len(x), bs)]
            )

        return run

    fns = {"logits": batched(_logits), "features": batched(jax.jit(feats))}
    target_all = _train_target(config, genre_model, feats, source, splits, seed, workdir, options)
    genre_head = target_all.pop("head")
    target = target_all
    lora, play_head = _train_lora(
        config, play_model, source, splits["play"]["train"], seed, workdir, "lora", options
    )
    oracle, oracle_head = _train_lora(
        config, play_model, target, splits["play"]["train"], seed, workdir, "oracle", options
    )

    target_genre = {s: np.argmax(fns["logits"]({**target, "head": genre_head}, splits["genre"][s]["x"]), -1) for s in ("valid", "test")}  # fmt: skip
    ref_body = _merged(source, lora)
    norm_ref = {s: float(np.mean(np.linalg.norm(fns["features"](ref_body, splits["play"][s]["x"]), axis=-1))) for s in ("valid", "test")}  # fmt: skip
    evaluate = functools.partial(_evaluate, fns, target_genre=target_genre, norm_ref=norm_ref, splits=splits)  # fmt: skip
    rows = {}
    for method, cands in _candidates(config, source, target, lora, jax.random.key(seed)).items():
        scores = [
            evaluate(body, play_head, genre_head, split="valid")["combined"] for _, body, _ in cands
        ]
        best = int(np.argmax(scores))
        hp, body, rank = cands[best]
        rows[method] = {**evaluate(body, play_head, genre_head, split="test"), "hparams": hp, "valid_combined": scores[best], "adapter_rank": rank}  # fmt: skip
    rows["oracle"] = {**evaluate(_merged(target, oracle), oracle_head, genre_head, split="test"), "hparams": {}, "adapter_rank": _rank(oracle)}  # fmt: skip
    rows["target_alone"] = evaluate(target, play_head, genre_head, split="test")
    rows["source_lora"] = evaluate(ref_body, play_head, genre_head, split="test")
    diag = casa_diagnostics({"params": source}, {"params": target}, lora)
    diagnostics = {
        k: float(np.mean([v[k] for v in diag.values()])) for k in casa_report.DIAGNOSTICS
    }
    return {"rows": rows, "diagnostics": diagnostics, "per_kernel": diag}


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs every seed (a finished one is read back) and writes the tables; returns the summary."""
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    check_config(config)
    bert_config = models.BertConfig.from_json(models.minilm_dir() / "config.json")
    cells = sweep.CellStore(workdir, options=options, log_metrics=False)
    seeds = range(config.seed, config.seed + config.num_seeds)
    kw = dict(workdir=workdir, bert_config=bert_config, options=options)
    results = [cells.get(f"seed={s}", functools.partial(_run_seed, config, s, **kw)) for s in seeds]
    return casa_report.write_report(config, workdir, results, methods=METHODS)
