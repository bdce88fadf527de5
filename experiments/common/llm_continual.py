r"""Continual fine-tuning over data files, one task per file (``llm_sft`` with ``continual.method``).

``--config.data.train=a.jsonl,b.jsonl,c.jsonl --config.continual.method=saber`` learns the files
in order with a method of :mod:`lowrank_jax.continual` (``saber`` P1, ``gr_lora`` P2, ``o_lora``,
``inflora``, ``sd_lora``, ``sequential``: ``sequential_lora``) on the decoder's stacked projection
kernels (``adapter.targets``; per-layer memories, as ``tests/models/test_decoder_continual.py``
checks). A packed row travels as one int array ``x`` ``(b, 4, T)`` (tokens, segment ids,
positions, loss mask; :func:`encode`) so that the methods' ``apply_fn(variables, x)`` and their
layer-input captures read whole rows; the objective is the mean next-token loss of the row's
targets plus the method's penalties. The method's "head" (trained with every task, consolidated
by ``end_task``) is the final RMSNorm's scale (:data:`HEAD_PATH`): the vocabulary head stays
frozen, as the base does. Class-based parts of the methods have no meaning for a language model
and are off: SABER's head recalibration (``recalibrate_steps=0``) and GR-LoRA's synthetic OOD
inputs (``lambda_local = lambda_global = 0``); GR-LoRA is evaluated with each file's own module
(the task id is the file; a file not learned yet: the last learned one's module), the others
with their consolidated model.

Each task trains through ``common.fit`` in ``<workdir>/task_<t>`` (``schedule.num_steps`` steps),
so a rerun resumes and replays the finished tasks from their last checkpoints. After each task
every file's validation loss is measured: ``losses[t][j]`` (nats per target token), and before
any task ``before[j]``. Forgetting of task ``j < T−1`` is ``losses[T−1][j] − min_{j≤t<T−1}
losses[t][j]`` (the rise from its best loss; Chaudhry et al.'s definition on losses), 0 for the
last task; the mean is ``continual.forgetting(−losses)``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments import common
from experiments.common.llm_sft_steps import save_merged
from lowrank_jax import continual, data
from lowrank_jax.adapters.paths import set_path
from lowrank_jax.data import text

METHODS = ("saber", "gr_lora", "o_lora", "inflora", "sd_lora", "sequential")
HEAD_PATH = "params/model/norm"  # what every method trains with each task besides its adapters
_CHANNELS = ("tokens", "segment_ids", "positions", "loss_mask")


def encode(packed: dict[str, np.ndarray]) -> np.ndarray:
    """Packed rows (``data.pack``) as one int32 array ``(N, 4, T)`` in the order of ``_CHANNELS``."""
    return np.stack([np.asarray(packed[k], np.int32) for k in _CHANNELS], axis=1)


def make_apply(model: Any) -> Any:
    """``apply_fn(variables, x) -> logits (b, T, V)`` of an encoded batch (:func:`encode`)."""

    def apply_fn(variables, x):
        return model.apply(variables, x[:, 0], segment_ids=x[:, 1], positions=x[:, 2])

    return apply_fn


def row_loss(logits: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(total, count)`` of the next-token loss over the targets of encoded rows ``x``."""
    return text.next_token_loss(logits, x[:, 0], x[:, 3].astype(jnp.float32))


def make_method(config: Any, model: Any) -> continual.ContinualMethod:
    """``continual.method`` with the config's adapter rank, alpha, targets, learning rate and
    clipping (module docstring for what is switched off)."""
    c, a = config.continual, config.adapter
    apply_fn = make_apply(model)
    kw = dict(
        targets=tuple(a.targets),
        rank=a.rank,
        alpha=a.alpha,
        head_path=HEAD_PATH,
        learning_rate=config.optim.learning_rate,
        grad_clip=config.optim.grad_clip,
    )
    memory = dict(memory_threshold=c.memory_threshold, memory_examples=c.memory_examples)
    factories = {
        "sequential": lambda: continual.sequential_lora(apply_fn, **kw),
        "o_lora": lambda: continual.o_lora(apply_fn, **kw, lambda_orth=c.lambda_orth),
        "inflora": lambda: continual.inflora(apply_fn, **kw, **memory),
        "sd_lora": lambda: continual.sd_lora(apply_fn, **kw),
        "saber": lambda: continual.saber(
            apply_fn, **kw, recalibrate_steps=0, memory_examples=c.memory_examples
        ),
        "gr_lora": lambda: continual.gr_lora(
            apply_fn, **kw, **memory, lambda_local=0.0, lambda_global=0.0
        ),
    }
    return factories[c.method]()


def make_train_step(method: continual.ContinualMethod, tx: optax.GradientTransformation) -> Any:
    """``step(state, frozen, batch, key)`` for ``fit``: the mean next-token loss of ``batch["x"]``
    under ``method.apply`` plus ``method.loss``; state ``{"trainable", "opt_state", "step"}``."""

    def step(state, frozen, batch, key):
        def loss_fn(tr):
            total, count = row_loss(method.apply(tr, frozen, batch["x"]), batch["x"])
            nll = total / jnp.maximum(count, 1.0)
            return nll + method.loss(tr, frozen, batch, key), (nll, count)

        (loss, (nll, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        new = {**state, "trainable": trainable, "opt_state": opt_state}
        return new, {"loss": loss, "nll": nll, "target_tokens": count}

    return step


_row_sums = jax.jit(row_loss)


def mean_loss(logits_fn: Any, x: np.ndarray, batch_size: int) -> float:
    """Mean next-token loss over encoded rows ``x`` with ``logits_fn(xb)``; the last batch is
    padded with copies of its first row whose loss mask is zeroed (one compiled shape)."""
    total = count = 0.0
    for start in range(0, len(x), batch_size):
        xb = x[start : start + batch_size]
        if len(xb) < batch_size:
            pad = np.repeat(xb[:1], batch_size - len(xb), axis=0)
            pad[:, 3] = 0
            xb = np.concatenate([xb, pad])
        t, n = _row_sums(logits_fn(xb), jnp.asarray(xb))
        total, count = total + float(t), count + float(n)
    return total / max(count, 1.0)


def forgetting(losses: np.ndarray) -> list[float]:
    """Per task ``j``: ``losses[T−1, j] − min_{j≤t<T−1} losses[t, j]`` (0 for the last)."""
    last = len(losses) - 1
    return [
        float(losses[last, j] - losses[j:last, j].min()) if j < last else 0.0
        for j in range(last + 1)
    ]


def run(
    config: Any,
    workdir: str,
    options: common.TrainOptions,
    model: Any,
    variables: Any,
    tasks: list[dict[str, Any]],
) -> dict[str, Any]:
    """Learns ``tasks`` (``{"name", "train", "valid"}``, packed rows) in order (module docstring).

    Returns:
      ``{"task_names", "valid_loss_before" (per task), "task_losses" (T × T), "final_losses",
      "forgetting" (per task), "mean_forgetting", "valid_loss_after" (mean final), "state",
      "interrupted"}``; ``state`` the method's :class:`~lowrank_jax.continual.ContinualState`.
    """
    method = make_method(config, model)
    valid = [encode(t["valid"]) for t in tasks]
    b = config.eval.batch_size
    plain = jax.jit(make_apply(model))
    before = [mean_loss(lambda xb: plain(variables, xb), x, b) for x in valid]
    state, n = method.init(variables), len(tasks)
    losses = np.full((n, n), np.nan)
    for t, spec in enumerate(tasks):
        x = encode(spec["train"])
        task = continual.Task(t, np.array([t]), x, np.full(len(x), t, np.int32), n)
        key = jax.random.fold_in(jax.random.key(config.seed), t)
        trainable, frozen, tx = method.begin_task(state, key, task)
        # fit donates its state: copies, so that the continual state's arrays stay alive
        fit_state = {"trainable": trainable, "opt_state": tx.init(trainable)}
        fit_state = {**jax.tree.map(jnp.copy, fit_state), "step": 0}
        result = common.fit(
            fit_state,
            frozen,
            make_train_step(method, tx),
            data.BatchIterator(
                {"x": x}, batch_size=config.data.batch_size, seed=config.seed * 1000 + t
            ),
            key=jax.random.fold_in(jax.random.key(config.seed + 1), t),
            num_steps=config.schedule.num_steps,
            workdir=os.path.join(workdir, f"task_{t}"),
            **common.fit_options(config),
            description=f"{config.continual.method} task {t + 1}/{n} ({spec['name']})",
            options=options,
        )
        if result.interrupted:
            return {"interrupted": True}
        state = method.end_task(state, jax.device_get(result.state["trainable"]), frozen, task)
        for j, xv in enumerate(valid):
            task_id = min(j, t)  # a task not learned yet: the last learned one's (GR-LoRA)
            logits = lambda xb, i=task_id, s=state: method.predict(s, xb, task_id=i)[0]  # noqa: E731
            losses[t, j] = mean_loss(logits, xv, b)
    forgets = forgetting(losses)
    return {
        "task_names": [t["name"] for t in tasks],
        "valid_loss_before": before,
        "task_losses": losses.tolist(),
        "final_losses": losses[-1].tolist(),
        "forgetting": forgets,
        "mean_forgetting": continual.forgetting(-losses),
        "valid_loss_after": float(losses[-1].mean()),
        "state": state,
        "interrupted": False,
    }


def steps(config: Any, model: Any, variables: Any, mesh: Any) -> list[common.Step]:
    """The first task's ``fit`` step on abstract inputs (``variables`` abstract too)."""
    method = make_method(config, model)
    shape = (config.data.batch_size, len(_CHANNELS), config.data.max_length)
    x = np.zeros(shape, np.int32)  # a stand-in first task (never read)
    task = continual.Task(0, np.array([0]), x, np.zeros(len(x), np.int32), 2)

    def first_task(v):
        trainable, frozen, tx = method.begin_task(method.init(v), jax.random.key(0), task)
        return (trainable, frozen, tx.init(trainable)), tx

    (trainable, frozen, opt_state), tx = common.eval_shape_with_static(first_task, variables)
    state = {"trainable": trainable, "opt_state": opt_state, "step": 0}
    batch = {"x": jax.ShapeDtypeStruct(shape, jnp.int32)}
    name = f"continual {config.continual.method}"
    return [
        common.fit_step(make_train_step(method, tx), state, frozen, batch, mesh=mesh, name=name)
    ]


def check_config(config: Any) -> None:
    """The continual options (raises ``common.ConfigError``)."""
    c = common
    c.check_choice(config, "continual.method", METHODS)
    a = config.adapter
    if (a.method, a.init, a.base) != ("lora", "kaiming", "float32"):
        raise c.ConfigError(
            f"config.continual.method={config.continual.method!r} trains the method's own LoRA "
            "branches on a float32 base: use --config.adapter.method=lora, adapter.init=kaiming "
            f"and adapter.base=float32 (got {a.method!r}, {a.init!r}, {a.base!r})"
        )
    if config.continual.method == "saber" and a.rank < 2:
        raise c.ConfigError("config.adapter.rank must be >= 2 for SABER (half shared, half own)")
    c.check_positive(config, "continual.memory_examples", integer=True)
    c.check_fraction(config, "continual.memory_threshold", allow_zero=False)
    c.check_nonnegative(config, "continual.lambda_orth")


def finish(
    config: Any, workdir: str, files: dict[str, str], mc: Any, result: dict[str, Any]
) -> dict[str, Any]:
    """Writes ``results.md`` (per task: loss before, right after its task, final, forgetting)
    and, with ``export.merged``, ``<workdir>/merged`` (the consolidated model; GR-LoRA's
    per-task modules are not in it); returns the run's metrics (:func:`run`'s, less ``state``)."""
    if result["interrupted"]:
        return {"interrupted": True}
    state = result.pop("state")
    losses = np.asarray(result["task_losses"])
    rows = [
        {
            "task": name,
            "before": result["valid_loss_before"][j],
            "after its task": losses[j, j],
            "final": losses[-1, j],
            "forgetting": result["forgetting"][j],
        }
        for j, name in enumerate(result["task_names"])
    ]
    m = config.continual.method
    notes = (
        f"{m} over {len(rows)} training sources in order (one task each, "
        f"{config.schedule.num_steps} steps of {config.data.batch_size} packed rows), LoRA r="
        f"{config.adapter.rank} on `{'`, `'.join(config.adapter.targets)}`, checkpoint "
        f"`{files['checkpoint']}`. Validation loss in nats per target token of each task's "
        "validation rows; forgetting = final loss minus the task's best loss before the last "
        f"task; mean forgetting {result['mean_forgetting']:.4g}. Loss matrix (row t: after "
        f"task t): {np.round(losses, 4).tolist()}."
    )
    common.write_results_md(workdir, rows, title=f"Continual fine-tuning ({m})", notes=notes)
    if config.export.merged and jax.process_index() == 0:
        result["merged_dir"] = os.path.join(workdir, "merged")
        variables = set_path(jax.device_get(state.params), HEAD_PATH, state.head)
        save_merged(config, result["merged_dir"], files["checkpoint"], mc, variables)
    return result
