"""Grid sweeps of many small cells: a resumable cell store, a ``lax.scan`` trainer, reporting.

A study whose claim is a trend over methods, budgets, ranks and seeds (KGE, FrameFT, LoRA-DA,
SBVI) runs hundreds of *cells*, each a few hundred optimiser steps on a small model: too small
for :func:`experiments.common.fit` (a checkpoint per cell would cost more than the cell). The
shared pieces:

* :class:`CellStore`: ``cells.get(key, fn)`` returns the stored metrics of a finished cell or runs
  ``fn()`` and persists its result atomically as ``<workdir>/cells/<key>.json``, so an interrupted
  sweep resumes by rerunning the same command (finished cells are read back, never recomputed);
* :func:`train_scan`: ``steps`` optimiser steps of a ``(trainable, frozen)`` pair over minibatch
  indices, one jitted ``lax.scan`` (compiled once per loss, optimizer and shape), with the
  full-training-set loss after every step; :func:`batch_indices` draws the epochs' minibatches;
  :func:`train_epochs` drives a library's jitted epoch function instead (KGE);
* the cost of the trainers (examples/s, FLOPs per step, utilisation, peak memory; see
  :mod:`experiments.common.cost`) goes to each newly computed cell's ``metrics.jsonl`` record as
  ``<key>/cost/<name>`` and to the run's cost table;
* :func:`mean_sd` / :func:`format_mean_sd`: mean ± sample standard deviation over seeds;
* :func:`check`, :func:`checks_markdown`, :func:`markdown_table` and :func:`write_sweep_results`:
  the trend checks of a paper's claims marked as reproduced or not, next to the results table.

Example::

    cells = sweep.CellStore(workdir)
    accs = [cells.get(f"{m}/seed={s}", lambda m=m, s=s: run_cell(m, s))["accuracy"]
            for m in methods for s in seeds]
"""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from absl import logging

from experiments.common import config_checks, loop
from experiments.common import cost as cost_lib
from experiments.common import lowering as lowering_lib
from experiments.common import metrics as metrics_lib

__all__ = [
    "CellStore",
    "adam",
    "batch_indices",
    "check",
    "check_config",
    "checks_markdown",
    "command_line",
    "format_cell",
    "format_mean_sd",
    "markdown_table",
    "mean_sd",
    "train_epochs",
    "train_scan",
    "train_scan_step",
    "write_sweep_results",
]


def check_config(config: Any) -> None:
    """Checks the keys every seeded sweep of small cells has (``seed``, ``eval.num_seeds``,
    ``schedule.num_steps``, ``data.batch_size``, ``data.num_train``, ``ckpt.resume``).

    Raises:
      experiments.common.ConfigError: naming the first bad key.
    """
    config_checks.check_nonnegative(config, "seed", integer=True)
    config_checks.check_positive(config, "eval.num_seeds", integer=True)
    config_checks.check_positive(config, "schedule.num_steps", integer=True)
    config_checks.check_positive(config, "data.batch_size", integer=True)
    config_checks.check_positive(config, "data.num_train", integer=True)
    config_checks.check_choice(config, "ckpt.resume", (True, False))


# ----------------------------------------------------------------------------------------------
# The resumable cell store.


def _filename(key: str) -> str:
    return urllib.parse.quote(key, safe="-_.=@,") + ".json"


def _write_cell(path: str, obj: Any) -> None:
    """Writes a cell's JSON atomically (temporary file + ``os.replace``), on process 0 only.

    Unlike ``metrics.write_json`` it keeps NaN (Python's JSON reads it back): a diverged cell
    stays NaN and shows as such in the means, as in the run that computed it.
    """
    if jax.process_index() != 0:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.write("\n")
    os.replace(tmp, path)


class CellStore:
    """The finished cells of a sweep, one JSON file each under ``<workdir>/cells/``.

    Args:
      workdir: the run directory.
      resume: read back cells finished by an earlier run (False: recompute and overwrite them).
      log_metrics: append each newly finished cell's scalar metrics to ``metrics.jsonl`` as
        ``<key>/<name>`` (step = number of cells finished so far).

    Attributes:
      cells: ``{key: metrics}`` of the cells computed or read back so far, in that order.
      computed: the keys computed (not read back) by this process.
    """

    def __init__(
        self, workdir: str | os.PathLike, *, resume: bool = True, log_metrics: bool = True
    ):
        self.directory = os.path.join(os.fspath(workdir), "cells")
        os.makedirs(self.directory, exist_ok=True)
        self.resume = resume
        self.cells: dict[str, dict[str, Any]] = {}
        self.computed: list[str] = []
        self._writer = None
        if log_metrics:
            start = len(os.listdir(self.directory)) if resume else 0
            self._writer = metrics_lib.MetricWriter(workdir, start_step=start, tensorboard=False)
            self._step = start

    def path(self, key: str) -> str:
        """The file that holds (or will hold) the cell ``key``."""
        return os.path.join(self.directory, _filename(key))

    def __contains__(self, key: str) -> bool:
        return key in self.cells or (self.resume and os.path.exists(self.path(key)))

    def get(self, key: str, fn: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The metrics of cell ``key``: read back if finished, else ``fn()``, stored atomically.

        ``fn`` must return a JSON-serialisable mapping (numbers, strings, lists, dicts).
        """
        if key in self.cells:
            return self.cells[key]
        path = self.path(key)
        if self.resume and os.path.exists(path):
            with open(path) as f:
                self.cells[key] = json.load(f)
            return self.cells[key]
        with cost_lib.collect() as costs:  # the cost of the trainers that fn calls
            result = json.loads(json.dumps(dict(fn()), default=str))  # what a rerun reads back
        loop.training_started()  # a cell trained: the runner may write config.json
        _write_cell(path, result)
        self.cells[key] = result
        self.computed.append(key)
        if self._writer is not None:
            self._step += 1
            scalars = {
                f"{key}/{k}": v
                for k, v in result.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
            if costs:
                cell_cost = cost_lib.summarise(costs)
                scalars.update({f"{key}/{k}": v for k, v in cell_cost.items()})
            if scalars:
                self._writer.write(self._step, scalars)
        logging.info("cell %s: %s", key, _short(result))
        return result

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _short(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if isinstance(v, int | float | str | bool)}


# ----------------------------------------------------------------------------------------------
# The scan trainer.


def batch_indices(seed: int, n: int, batch_size: int, steps: int) -> np.ndarray:
    """``(steps, batch_size)`` example indices: successive epochs, each a fresh permutation.

    Epochs of ``max(n // batch_size, 1)`` batches are drawn from ``default_rng([seed, 11])`` and
    concatenated; the last incomplete batch of an epoch carries over into the next one.
    """
    rng = np.random.default_rng([seed, 11])
    per_epoch = max(n // batch_size, 1)
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    return order[: steps * batch_size].reshape(steps, batch_size)


@functools.cache
def adam(learning_rate: float) -> optax.GradientTransformation:
    """``optax.adam(learning_rate)``, one object per rate, so :func:`train_scan` compiles once."""
    return optax.adam(learning_rate)


def train_scan(
    trainable: Any,
    frozen: Any,
    train: Any,
    idx: jax.Array,
    *,
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    trace: bool = True,
    opt_state: Any = None,
) -> tuple[Any, Any, jax.Array | None]:
    """``len(idx)`` optimiser steps in one ``lax.scan``: ``(trainable, opt_state, trace)``.

    Step ``k`` takes the gradient of ``loss_fn(trainable, frozen, batch_k)`` with ``batch_k =
    tree.map(lambda a: a[idx[k]], train)`` and applies ``tx``'s update.

    Args:
      trainable: the pytree that is trained (adapters, or all parameters).
      frozen: passed unchanged to ``loss_fn`` (may be None).
      train: pytree of training arrays with a leading example axis ``N``.
      idx: ``(steps, b)`` example indices (:func:`batch_indices`).
      loss_fn: ``(trainable, frozen, batch) -> scalar``; hashable (a module-level function or a
        cached closure), since it is a static argument.
      tx: the optimizer; hashable and reused across cells (e.g. :func:`adam`).
      trace: also return the full-training-set loss after every step.
      opt_state: continue from this optimizer state (None: ``tx.init(trainable)``), e.g. to
        train epoch by epoch and keep each epoch's checkpoint with its optimizer state.

    Returns:
      ``(trainable, opt_state, trace)``; ``trace[k - 1]`` is the loss on all of ``train`` after
      ``k`` steps (``None`` if ``trace=False``).

    The call is compiled first (once per signature), then timed to its end: its examples/s and
    FLOPs go to the run's cost table and the cell's metrics (:mod:`experiments.common.cost`).
    """
    steps, batch = np.shape(idx)[:2]
    label = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
    return cost_lib.timed_call(
        _train_scan,
        trainable,
        frozen,
        train,
        idx,
        loss_fn=loss_fn,
        tx=tx,
        trace=trace,
        opt_state=opt_state,
        label=f"train_scan {label} (batch {batch})",
        steps=int(steps),
        examples=int(batch),
    )


def train_scan_step(
    name: str,
    trainable: Any,
    frozen: Any,
    train: Any,
    idx: Any,
    *,
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    trace: bool = True,
    opt_state: Any = None,
) -> lowering_lib.Step:
    """:func:`train_scan`'s jitted program on abstract arguments (arrays or
    ``jax.ShapeDtypeStruct``; e.g. ``idx`` as ``ShapeDtypeStruct((steps, batch), int32)``), for
    lowering without data."""
    args = lowering_lib.abstract((trainable, frozen, train, idx))
    kwargs = {"loss_fn": loss_fn, "tx": tx, "trace": trace}
    kwargs["opt_state"] = None if opt_state is None else lowering_lib.abstract(opt_state)
    return lowering_lib.Step(name, _train_scan, args, kwargs)


@functools.partial(jax.jit, static_argnames=("loss_fn", "tx", "trace"))
def _train_scan(
    trainable: Any,
    frozen: Any,
    train: Any,
    idx: jax.Array,
    *,
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    trace: bool = True,
    opt_state: Any = None,
) -> tuple[Any, Any, jax.Array | None]:
    """The jitted program of :func:`train_scan` (same arguments)."""

    def body(carry, i):
        p, s = carry
        batch = jax.tree.map(lambda a: a[i], train)
        g = jax.grad(loss_fn)(p, frozen, batch)
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return (p, s), (loss_fn(p, frozen, train) if trace else None)

    s0 = tx.init(trainable) if opt_state is None else opt_state
    (p, s), losses = jax.lax.scan(body, (trainable, s0), idx)
    return p, s, losses


def train_epochs(
    epoch_fn: Callable[..., tuple[Any, Any, jax.Array]],
    params: Any,
    opt_state: Any,
    key: jax.Array,
    *args: Any,
    num_epochs: int,
    log_every: int,
    examples_per_epoch: int = 0,
    steps_per_epoch: int = 1,
) -> tuple[Any, Any, list[tuple[int, float]]]:
    """Runs a library's jitted epoch function ``num_epochs`` times (for cells trained by epoch).

    ``epoch_fn(params, opt_state, key, *args) -> (params, opt_state, loss)`` (e.g.
    :func:`lowrank_jax.kge.training.make_train_epoch`, which donates ``params`` and ``opt_state``);
    epoch ``e`` gets the second half of the ``e``-th ``split`` of ``key``. The loss comes to the
    host only every ``log_every`` epochs and after the last one.

    The epochs are timed (the first one's compilation excluded) and recorded as
    ``num_epochs * steps_per_epoch`` steps of ``examples_per_epoch / steps_per_epoch`` examples in
    the run's cost table and the cell's metrics, with the FLOPs of the compiled epoch (an epoch
    that is a ``lax.scan`` over its batches counts as one batch step: see
    :mod:`experiments.common.cost`).

    Returns:
      ``(params, opt_state, curve)`` with ``curve = [(epoch, loss), ...]``.
    """
    curve = []
    flops = None
    if hasattr(epoch_fn, "lower"):  # compiled first, so the timing below excludes it
        flops = cost_lib.program_flops(epoch_fn, params, opt_state, key, *args)
    start = time.perf_counter()
    for epoch in range(1, num_epochs + 1):
        key, k_epoch = jax.random.split(key)
        params, opt_state, loss = epoch_fn(params, opt_state, k_epoch, *args)
        if epoch % log_every == 0 or epoch == num_epochs:
            curve.append((epoch, float(loss)))  # (waits for the epoch)
    cost_lib.record_steps(
        getattr(epoch_fn, "__qualname__", "train_epochs"),
        steps=num_epochs * steps_per_epoch,
        seconds=time.perf_counter() - start,
        examples=examples_per_epoch / steps_per_epoch,
        flops=flops,
    )
    return params, opt_state, curve


# ----------------------------------------------------------------------------------------------
# Aggregation and reporting.


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, sample standard deviation)`` in float64; the sd of a single value is 0.

    Raises:
      ValueError: ``values`` is empty.
    """
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("mean_sd needs at least one value (did every cell of the group run?)")
    return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else 0.0)


def format_mean_sd(values: Sequence[float], digits: int = 3) -> str:
    """``"mean ± sd"`` with ``digits`` decimals (see :func:`mean_sd`)."""
    m, s = mean_sd(values)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def check(criterion: str, reproduced: Any, evidence: str = "") -> dict[str, Any]:
    """One trend check: a claim of the paper, whether it reproduced (bool or a measured value)."""
    return {"criterion": criterion, "reproduced": reproduced, "evidence": evidence}


def format_cell(x: Any, digits: int = 3) -> str:
    """A table cell: floats with ``digits`` decimals (``inf``), booleans as yes / **no**."""
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{digits}f}"
    return str(x).replace("|", "\\|")  # a '|' in a cell would split it


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], *, digits: int = 3
) -> str:
    """A Markdown table: ``columns`` are ``(heading, key)`` pairs; floats with ``digits`` decimals,
    booleans as yes / **no**, missing keys blank."""
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(format_cell(r.get(k, ""), digits) if k else "" for _, k in columns)
            + " |"
        )
    return "\n".join(lines)


def checks_markdown(checks: Sequence[Mapping[str, Any]]) -> str:
    """The trend-check table (criterion, reproduced, evidence) of :func:`check` records."""
    cols = [("criterion", "criterion"), ("reproduced", "reproduced")]
    if any(c.get("evidence") for c in checks):
        cols.append(("evidence", "evidence"))
    rows = [  # a measured value (a ratio, a best method) is shown as measured
        {
            **c,
            "reproduced": c["reproduced"]
            if isinstance(c["reproduced"], bool)
            else str(c["reproduced"]),
        }
        for c in checks
    ]
    return markdown_table(rows, cols)


def command_line(default: str) -> str:
    """The ``python -m experiments.train ...`` command of this process, else ``default``.

    Results tables quote it, so a table made by a ``:smoke`` run or with ``--config.*`` overrides
    says so (``default`` is used when the run was started from Python, e.g. a test).
    """
    argv = sys.argv
    if argv and argv[0].endswith(os.path.join("experiments", "train.py")):
        return " ".join(["python -m experiments.train", *map(shlex.quote, argv[1:])])
    return default


def write_sweep_results(
    workdir: str | os.PathLike,
    table: Sequence[Mapping[str, Any]],
    checks: Sequence[Mapping[str, Any]],
    *,
    title: str,
    columns: Sequence[str],
    command: str,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Writes ``results.md`` (table, command, trend checks) and ``summary.json``.

    Args:
      workdir: the run directory.
      table: one row per method/setting (mean ± sd strings, counts, ...).
      checks: :func:`check` records.
      title: the heading of ``results.md``.
      columns: the table's column order.
      command: the command that reproduces the table.
      extra: further headline numbers (listed below the checks and returned).

    Returns:
      The headline numbers: ``{"rows": len(table), <criterion>: reproduced, ..., **extra}`` with
      every value a JSON scalar.
    """
    notes = f"Command: `{command}`\n\nTrend checks (specs):\n\n" + checks_markdown(checks)
    if extra:
        notes += "\n\n" + "\n".join(f"- {k}: {v}" for k, v in extra.items())
    metrics_lib.write_results_md(workdir, table, title=title, columns=columns, notes=notes)
    by_name = {c["criterion"]: c["reproduced"] for c in checks}
    metrics_lib.write_json(
        os.path.join(os.fspath(workdir), "summary.json"),
        {"table": list(table), "checks": list(checks), **({"extra": dict(extra)} if extra else {})},
    )
    out = {"rows": len(table), **by_name, **(extra or {})}
    return {k: (v if isinstance(v, int | float | str | bool) else str(v)) for k, v in out.items()}
