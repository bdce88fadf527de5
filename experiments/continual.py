"""Continual learning with LoRA: SABER, GR-LoRA and the baselines on one task stream.

The family behind ``configs/saber.py`` and ``configs/gr_lora.py``. A frozen backbone (the top
layers of the pretrained MiniLM on cached hidden states, a ViT or an MLP pretrained on a base
session, or random features; streams: :mod:`experiments.common.continual_setup`, backbones:
:mod:`experiments.common.continual_backbones`; image benchmarks read on demand) learns a
stream of tasks with one LoRA branch per task on the kernels matching ``config.adapter.targets``
plus a shared linear head (trained on the current task's classes only: masked cross-entropy;
``config.head``: ``masked`` keeps it, ``aligned``/``prototype`` refit it from per-class feature
statistics after each task, :func:`~lowrank_jax.continual.with_head`).

The methods are library values (:mod:`lowrank_jax.continual`: :func:`~lowrank_jax.continual.saber`,
:func:`~lowrank_jax.continual.gr_lora`, :func:`~lowrank_jax.continual.sequential_lora`,
``o_lora``, ``inflora``, ``gpm_lora``, ``sd_lora``, ``joint``), built once from the config by
:func:`~experiments.common.continual_methods.make_method`; this module only orchestrates: for each task ``begin_task``,
``experiments.common.fit`` (masked cross-entropy plus the method's penalties), ``end_task``,
evaluate. ``joint`` is trained once on the union of all tasks (the upper bound; only the final row
of the accuracy matrix is meaningful). With ``config.search.trials > 0`` every method's learning
rate and knobs are first chosen on a validation split of the training tasks by the same random
search (:mod:`experiments.common.continual_search`; the choice goes into ``results.md`` and
``search.json``).

Every task's training lives in ``<workdir>/<method>/seed_<s>/task_<t>``: an interrupted run
resumes inside the task where it stopped, and the finished tasks are replayed from their final
checkpoints (consolidation is deterministic). A finished method × seed is stored as JSON in
``<workdir>/cells/`` (:class:`~experiments.common.sweep.CellStore`) and read back by a rerun
without replaying its tasks (delete the file to replay them); so a finished workdir grows in place
when a rerun appends seeds or methods (``seeds=1`` then ``seeds=3``: only seeds 1 and 2 run; any
other config change is refused). Outputs in the workdir:
``results.md`` (the table of all methods, mean ± sd over seeds), ``accuracy_matrices.json``,
``acc_matrix_<method>.png``, ``plasticity.png``, ``memory_fill.png``
(:mod:`experiments.common.continual_report`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments import common
from experiments.common import continual_report as report
from experiments.common import continual_search as search
from experiments.common import sweep
from experiments.common.continual_backbones import build_backbone
from experiments.common.continual_methods import HEADS, METHODS, make_method, program_steps
from experiments.common.continual_setup import (
    PROTOCOLS,
    Stream,
    check_setup,
    load_stream,
)
from lowrank_jax import continual, data
from lowrank_jax.continual.streams import training_arrays
from lowrank_jax.models.hf_vit import preprocessing

__all__ = [
    "METHODS",
    "build_backbone",
    "check_config",
    "load_stream",
    "make_method",
    "run",
    "steps",
]


def check_config(config: Any) -> None:
    """Validates ``config`` before anything is computed.

    Raises:
      experiments.common.ConfigError: naming the first bad key, its value and what is allowed.
    """
    c = common
    seeds = c.get_path(config, "seeds")
    if (
        isinstance(seeds, int | str)
        or not seeds
        or any(not isinstance(s, int) or s < 0 for s in seeds)
    ):
        raise c.ConfigError(
            f"config.seeds={seeds!r} is invalid: must be a non-empty tuple of ints >= 0, e.g. (0, 1, 2)"
        )
    methods = c.get_path(config, "methods")
    if isinstance(methods, str) or not methods:
        raise c.ConfigError(
            f"config.methods={methods!r} is invalid: must be a non-empty tuple of method names "
            f"from {', '.join(METHODS)}"
        )
    for m in methods:
        if m not in METHODS:
            raise c.ConfigError(
                f"config.methods has {m!r}: allowed values are {', '.join(METHODS)}"
            )
    check_setup(config)
    c.check_positive(config, "adapter.rank", integer=True)
    c.check_positive(config, "adapter.alpha")
    targets = c.get_path(config, "adapter.targets")
    if isinstance(targets, str) or not targets:
        raise c.ConfigError(
            f"config.adapter.targets={targets!r} is invalid: a non-empty tuple of regexes"
        )
    c.check_positive(config, "optim.learning_rate")
    c.check_nonnegative(config, "optim.grad_clip")
    c.check_nonnegative(config, "schedule.epochs_per_task", integer=True)
    if not config.schedule.epochs_per_task:
        c.check_positive(config, "schedule.steps_per_task", integer=True)
    m = config.method
    for key in ("memory_threshold", "saber.shared_threshold", "saber.specific_threshold"):
        v = c.get_path(m, key)
        if not 0 < v <= 1:
            raise c.ConfigError(f"config.method.{key}={v!r} is invalid: must lie in (0, 1]")
    c.check_positive(config, "method.memory_examples", integer=True)
    c.check_nonnegative(config, "method.o_lora.lambda_orth")
    c.check_nonnegative(config, "method.saber.lambda_align")
    c.check_nonnegative(config, "method.saber.gamma")
    if not 0 < m.saber.min_weight <= 1:
        raise c.ConfigError(
            f"config.method.saber.min_weight={m.saber.min_weight!r} is invalid: in (0, 1]"
        )
    c.check_choice(config, "method.saber.shared_mode", ("balanced", "mean"))
    c.check_nonnegative(config, "method.saber.energy_strength")
    c.check_nonnegative(config, "method.saber.recalibrate_steps", integer=True)
    c.check_nonnegative(config, "method.gr_lora.lambda_local")
    c.check_nonnegative(config, "method.gr_lora.lambda_global")
    c.check_nonnegative(config, "method.gr_lora.recycle_scale")
    c.check_positive(config, "method.gr_lora.ood_batch", integer=True)
    if "saber" in methods and config.adapter.rank < 2:
        raise c.ConfigError(
            "config.adapter.rank must be >= 2 for saber (half shared, half specific)"
        )
    c.check_choice(config, "head", HEADS)
    for h in c.get_path(config, "search.heads"):
        if h not in HEADS:
            raise c.ConfigError(
                f"config.search.heads has {h!r}: allowed values are {', '.join(HEADS)}"
            )
    c.check_choice(config, "method.heads.metric", ("euclidean", "cosine", "lda"))
    c.check_positive(config, "method.heads.align_learning_rate")
    c.check_positive(config, "method.heads.align_per_class", integer=True)
    c.check_nonnegative(config, "method.heads.align_steps", integer=True)
    c.check_nonnegative(config, "method.heads.ridge")
    c.check_positive(config, "method.heads.drift_bandwidth")
    if not 0 <= m.heads.shrinkage <= 1:
        raise c.ConfigError(
            f"config.method.heads.shrinkage={m.heads.shrinkage!r} is invalid: in [0, 1]"
        )
    c.check_positive(config, "eval.batch_size", integer=True)
    c.check_positive(config, "ckpt.max_to_keep", integer=True)
    c.check_positive(config, "log.every", integer=True)


def steps(config: Any, mesh: Any = None) -> list[common.Step]:
    """The run's jitted programs on abstract inputs (no data, no weights read):
    :func:`~experiments.common.continual_methods.program_steps` of a checked ``config``."""
    check_config(config)
    return program_steps(config, mesh)


# ----------------------------------------------------------------------------------------------
# One method on one stream.


def run_method(
    config: Any,
    name: str,
    seed: int,
    stream: Stream,
    model: Any,
    variables: Any,
    workdir: str,
    *,
    options: common.TrainOptions,
) -> dict[str, Any]:
    """Runs one method over the stream (every task through ``common.fit`` with ``options``);
    returns its accuracy matrix and diagnostics."""
    c = config
    num_tasks = len(stream.tasks)
    method = make_method(c, name, model.apply, stream.protocol, seed)
    state = method.init(variables)
    # (task index, tasks whose data it trains on); joint: everything at once
    joint = name == "joint"
    schedule = [(0, list(range(num_tasks)))] if joint else [(t, [t]) for t in range(num_tasks)]
    r = np.full((num_tasks, num_tasks), np.nan)
    out = {"selection_accuracy": [], "memory_fill": [], "recycled_fraction": [], "diagnostics": []}
    updates = []
    for t, tasks in schedule:
        x, y, batches = _training_data(c, stream, tasks, seed * 1000 + t)
        num_steps = _num_steps(c, len(y), len(tasks))
        classes = np.concatenate([stream.task_classes[s] for s in tasks])
        task = continual.Task(t, classes, x, y, stream.num_classes)
        key = jax.random.fold_in(jax.random.key(seed), t)
        trainable, frozen, tx = method.begin_task(state, key, task)
        # fit donates the state: copy it so the continual state's arrays stay alive
        fit_state = {"trainable": trainable, "opt_state": tx.init(trainable)}
        fit_state = {**jax.tree.map(jnp.copy, fit_state), "step": 0}
        label = "all tasks" if joint else f"task {t + 1}/{num_tasks}"
        result = common.fit(
            fit_state,
            frozen,
            continual.make_train_step(method, tx),
            batches,
            key=jax.random.fold_in(jax.random.key(seed), 7919 + t),
            num_steps=num_steps,
            workdir=os.path.join(workdir, f"task_{t}"),
            log_every=c.log.every,
            ckpt_every=num_steps,
            max_to_keep=c.ckpt.max_to_keep,
            progress=c.log.progress,
            description=f"{name} seed {seed} {label}",
            options=options,
        )
        if result.interrupted:
            return {"interrupted": True}
        # host copies: with several processes fit's arrays span all of them (fully replicated)
        state = method.end_task(state, jax.device_get(result.state["trainable"]), frozen, task)
        measures = report.task_measures(state, result.state["opt_state"])
        out["recycled_fraction"] += measures["recycled_fraction"]
        out["memory_fill"] += measures["memory_fill"]
        updates.append(measures["update"])
        out["diagnostics"].append(method.diagnostics(state))
        accs, selection = continual.evaluate_stream(
            method, state, stream, num_tasks - 1 if joint else t, batch_size=c.eval.batch_size
        )
        r[-1 if joint else t, : len(accs)] = accs
        out["selection_accuracy"].append(selection)
    if not joint:
        out["update_cosine"] = report.cosines(updates)
    return {"R": r, "interrupted": False, **out}


def _training_data(config: Any, stream: Stream, tasks: list[int], seed: int) -> tuple[Any, ...]:
    """``(x, y, batches)`` of ``tasks``: the inputs a method reads (arrays, or the images read on
    demand of an image benchmark) and resumable training batches ``{"x", "y", "mask"}``."""
    if isinstance(stream.tasks[tasks[0]]["train"]["x"], data.ImageRows):
        pre = preprocessing(config.model.checkpoint)
        batches = continual.train_batches(
            stream, tasks, batch_size=config.data.batch_size, seed=seed, mean=pre.mean, std=pre.std
        )
        x = data.ImageRows.concatenate([stream.tasks[s]["train"]["x"] for s in tasks])
        return x, np.concatenate([stream.tasks[s]["train"]["y"] for s in tasks]), batches
    arrays = training_arrays(stream, tasks)
    batches = data.BatchIterator(arrays, batch_size=config.data.batch_size, seed=seed)
    return arrays["x"], arrays["y"], batches


def _num_steps(config: Any, num_examples: int, num_tasks: int) -> int:
    """A task's steps: ``schedule.epochs_per_task`` epochs of full batches, or
    ``schedule.steps_per_task`` (times the tasks trained at once)."""
    epochs = config.schedule.epochs_per_task
    if epochs:
        return epochs * max(1, num_examples // config.data.batch_size)
    return config.schedule.steps_per_task * num_tasks


def _finished(cells: sweep.CellStore, key: str, compute: Any) -> dict[str, Any]:
    """The output of ``compute()`` (a :func:`run_method`), stored in ``cells`` under ``key`` once
    finished and read back from there by a rerun; an interrupted output is returned, not stored."""
    if key not in cells:
        out = compute()
        if out["interrupted"]:
            return out
        cells.get(key, lambda: jax.tree.map(lambda v: np.asarray(v).tolist(), out))
    out = dict(cells.get(key, dict))  # what a rerun reads back, the first run too
    out["R"] = np.asarray(out["R"], np.float64)
    return out


# ----------------------------------------------------------------------------------------------
# The run.

# Config keys a finished workdir may grow by appending entries (experiments.train checks it):
# every method x seed is its own run, stored in cells/, and the validation search runs on the
# first seed only, which appending keeps.
GROWABLE = ("seeds", "methods")


def run(config: Any, workdir: str, options: common.TrainOptions | None = None) -> dict[str, Any]:
    """Runs every method of ``config.methods`` for every seed; writes and prints the table.

    Returns:
      ``{"benchmark", "table": {method: {metric: mean}}, "interrupted"}``.
    """
    check_config(config)
    options = common.TrainOptions.from_config(config, workdir) if options is None else options
    bench = config.data.benchmark
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in config.methods}
    chosen: dict[str, dict[str, Any]] = {}  # the validation search's choice per method
    finished = sweep.CellStore(workdir, options=options, log_metrics=False)
    for seed in config.seeds:
        stream = load_stream(config, seed)
        model, variables = build_backbone(
            config, stream, seed, os.path.join(workdir, f"seed_{seed}"), options=options
        )
        searching = config.search.trials or config.search.heads
        for name in config.methods if searching and seed == config.seeds[0] else ():
            chosen[name] = search.search(
                config,
                name,
                stream,
                functools.partial(
                    run_method,
                    name=name,
                    seed=seed,
                    model=model,
                    variables=variables,
                    options=options,
                ),
                workdir,
                options=options,
            )
            if chosen[name] is None:
                return {"benchmark": bench, "interrupted": True}
        for name in config.methods:
            out = _finished(
                finished,
                f"{name}/seed={seed}",
                functools.partial(
                    run_method,
                    search.apply_values(config, chosen.get(name, {}).get("values", {})),
                    name,
                    seed,
                    stream,
                    model,
                    variables,
                    os.path.join(workdir, name, f"seed_{seed}"),
                    options=options,
                ),
            )
            if out["interrupted"]:
                return {"benchmark": bench, "interrupted": True}
            out["summary"] = report.summary(out["R"], final_row_only=name == "joint")
            records[name].append(out)
            logging.info("%s seed %d: %s", name, seed, out["summary"])
    notes = report.notes(config, chosen, workdir, protocol=PROTOCOLS[bench])
    table = report.write_continual_outputs(
        workdir, records, title=f"Continual learning on {bench}", notes=notes
    )
    return {"benchmark": bench, "table": table, "interrupted": False}
