"""``fit``: a functional, resumable, data-parallel training loop (no Trainer class).

An experiment builds its own pieces and hands them over::

    state = {"params": trainable, "opt_state": tx.init(trainable), "step": 0}

    def train_step(state, frozen, batch, key):       # pure; jitted by fit with donation
        def loss_fn(params):
            logits = model.apply({"params": {**frozen, **params}}, batch["x"])
            return cross_entropy(logits, batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state}, {"loss": loss}

    result = fit(state, frozen, train_step, batches, key=jax.random.key(0), num_steps=1000,
                 workdir=workdir, eval_fn=evaluate, eval_every=200)

What ``fit`` does:

* **sharding**: a 1-D ``"data"`` mesh over all devices; every batch is split along its leading
  axis; ``state`` and ``frozen`` are replicated, or FSDP-sharded with ``fsdp=True``;
* **the step**: ``jax.jit(..., donate_argnums=0)`` donates the train state (never ``frozen``); the
  per-step key is ``fold_in(key, state["step"])`` and ``fit`` increments ``state["step"]`` itself;
* **resume**: if ``<workdir>/checkpoints`` holds a checkpoint, the state, the data position
  (``batches.state()``) and the key are restored and training continues from that step; rerunning
  a finished run only re-evaluates;
* **checkpoints** every ``ckpt_every`` steps and at the end; **Ctrl-C, SIGTERM or SIGUSR1** (a
  scheduler's preemption) finishes the current step, saves, and returns with ``interrupted=True``
  (a second signal aborts at once); in a multi-process job every process saves the same step
  (see :mod:`~experiments.common.signals`);
* **numerical faults**: the jitted step also reports whether its metrics and the new state are
  finite (no extra host round-trip: the flags are read at the logging and checkpoint cadence). A
  non-finite step stops the run with :class:`NonFiniteError`, naming the step, the metric and the
  last good checkpoint, which is left intact (nothing non-finite is ever saved); with
  ``skip_nonfinite=True`` such steps keep the previous state instead (as ``optax.apply_if_finite``)
  and are counted in ``train/skipped_steps``. The runner sets the default of every ``fit`` call of
  a run from ``config.train.skip_nonfinite`` (:func:`train_options`);
* **outputs**: ``metrics.jsonl`` and TensorBoard (train metrics averaged over ``log_every`` steps,
  ``eval_fn`` results every ``eval_every`` steps and at the end), a tqdm bar with rate and ETA;
* **cost** (:mod:`~experiments.common.cost`): with every train record, ``cost/examples_per_s``
  (``tokens_per_s``) over the interval, ``cost/flops_per_step`` of the compiled step,
  ``cost/utilisation`` and peak memory; a ``jax.profiler`` trace of the steps that
  ``config.profile`` names.

``batches`` is an iterator of host (numpy) batch pytrees with ``state()`` and ``restore(state)``
(JSON-serialisable), such as ``lowrank_jax.data.BatchIterator``; wrap one with
:class:`MapBatches` to tokenise or reshape on the fly.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from experiments.common import checkpoint as ckpt_lib
from experiments.common import cost as cost_lib
from experiments.common import lowering as lowering_lib
from experiments.common import metrics as metrics_lib
from experiments.common import sharding as sharding_lib
from experiments.common import signals

__all__ = [
    "FitResult",
    "MapBatches",
    "NonFiniteError",
    "ResumableIterator",
    "fit",
    "fit_options",
    "fit_step",
    "on_start",
    "padded_means",
    "train_options",
    "training_started",
]

_FINITE = "_finite"  # the step's finiteness flag, carried with its metrics but never logged
# fit's default for skip_nonfinite inside ``train_options(config)`` (the runner's config.train).
_SKIP_NONFINITE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "skip_nonfinite", default=False
)
# fit's default for max_loss inside ``train_options(config)`` (0: no bound).
_MAX_LOSS: contextvars.ContextVar[float] = contextvars.ContextVar("max_loss", default=0.0)


@contextlib.contextmanager
def train_options(config: Any) -> Iterator[None]:
    """Applies ``config.train`` to every :func:`fit` call in the block that does not pass its own.

    ``python -m experiments.train`` wraps the experiment's ``run`` in it, so a config option of the
    shared loop (``config.train.skip_nonfinite``, see ``configs.common.train_section``) reaches
    every ``fit`` call of every experiment without each one passing it. Code that calls an
    experiment's ``run(config, workdir)`` directly (a notebook) does the same::

        with common.train_options(config):
            metrics = lora_finetune.run(config, workdir)

    A config without a ``train`` section leaves the defaults (stop on a non-finite step, no
    bound on the loss).

    Raises:
      TypeError: if ``config.train.skip_nonfinite`` is not a bool.
      ValueError: if ``config.train.max_loss`` is not a number >= 0.
    """
    train = config.get("train", None) if hasattr(config, "get") else None
    skip = train.get("skip_nonfinite", False) if train is not None else False
    max_loss = train.get("max_loss", 0.0) if train is not None else 0.0
    if not isinstance(skip, bool):
        raise TypeError(f"config.train.skip_nonfinite={skip!r} is invalid: must be True or False")
    if isinstance(max_loss, bool) or not isinstance(max_loss, int | float) or not max_loss >= 0:
        raise ValueError(
            f"config.train.max_loss={max_loss!r} is invalid: must be a number >= 0 (0: off)"
        )
    tokens = _SKIP_NONFINITE.set(skip), _MAX_LOSS.set(float(max_loss))
    try:
        yield
    finally:
        _SKIP_NONFINITE.reset(tokens[0])
        _MAX_LOSS.reset(tokens[1])


def fit_options(config: Any) -> dict[str, Any]:
    """``fit``'s keyword arguments that every experiment reads from the same config keys:
    ``log_every`` (``config.log.every``), ``ckpt_every`` / ``max_to_keep`` (``config.ckpt``),
    ``fsdp`` (``config.parallel.fsdp``) and ``progress`` (``config.log.progress``)."""
    return {
        "log_every": config.log.every,
        "ckpt_every": config.ckpt.every,
        "max_to_keep": config.ckpt.max_to_keep,
        "fsdp": config.parallel.fsdp,
        "progress": config.log.progress,
    }


# What the runner does once the run's model is initialised (write config.json): see on_start.
_ON_START: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "on_start", default=None
)


@contextlib.contextmanager
def on_start(fn: Callable[[], None]) -> Iterator[None]:
    """Calls ``fn()`` once, when the block first reports :func:`training_started`.

    ``python -m experiments.train`` writes ``config.json`` this way: only once the experiment has
    built its model, adapters and train state (the first :func:`fit` call, or the first computed
    cell of a ``sweep.CellStore``), so a run that fails while starting (a regex that matches no
    parameter, a rank larger than a kernel) leaves no ``config.json`` behind.
    """
    token = _ON_START.set([fn])
    try:
        yield
    finally:
        _ON_START.reset(token)


def training_started() -> None:
    """Runs the pending :func:`on_start` callback, if any (once; later calls do nothing)."""
    pending = _ON_START.get()
    while pending:
        pending.pop()()


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or Inf loss, metric or state; the message says where."""


class ResumableIterator(Protocol):
    """What :func:`fit` needs from a data source: batches, and a position it can save."""

    def __next__(self) -> Any: ...

    def state(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


@dataclasses.dataclass
class MapBatches:
    """Applies ``fn`` to every batch of a resumable iterator, keeping ``state``/``restore``.

    Example: ``MapBatches(BatchIterator(train, batch_size=32, seed=0), lambda b: {"x": b.x,
    "y": b.y})``.
    """

    batches: Any
    fn: Callable[[Any], Any]

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.fn(next(self.batches))

    def state(self) -> Any:
        return self.batches.state()

    def restore(self, state: Any) -> None:
        self.batches.restore(state)


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
      state: the final train state (on device, sharded as trained).
      history: every record of ``metrics.jsonl`` (including those of earlier, resumed processes).
      last_eval: the latest ``eval_fn`` result (empty without ``eval_fn`` or when interrupted
        before any evaluation).
      start_step: the step this process started from (> 0 when resumed).
      interrupted: true if a stop signal (Ctrl-C, SIGTERM, SIGUSR1) stopped training early (a
        checkpoint of the step it stopped at was saved).
      step_time_s: mean wall time of a training step over the whole run (resumed processes
        included, as recorded in the checkpoints), excluding each process's first
        (compilation) step and evaluation; NaN if no step was timed.
      skipped_steps: steps of the whole run that kept the previous state (``skip_nonfinite``)
        because they were not finite or their loss exceeded ``max_loss``.
      cost: this process's ``cost/*`` totals (throughput, FLOPs per step, utilisation, peak
        memory; see :mod:`experiments.common.cost`).
    """

    state: Any
    history: list[dict[str, Any]]
    last_eval: dict[str, float]
    start_step: int
    interrupted: bool
    step_time_s: float
    skipped_steps: int = 0
    cost: dict[str, float] = dataclasses.field(default_factory=dict)


def padded_batches(
    arrays: Mapping[str, np.ndarray], batch_size: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """``(chunk, weight)`` over all rows of ``arrays`` in order, every chunk ``batch_size`` long.

    The last chunk is padded by repeating its final row, with weight 0 on the padding (1
    elsewhere), so one compiled evaluation step sees a single shape and weighted sums count each
    example once. ``arrays`` must hold ``"y"`` (its length is the row count).
    """
    n = len(arrays["y"])
    for start in range(0, n, batch_size):
        chunk = {k: v[start : start + batch_size] for k, v in arrays.items()}
        weight = np.ones(len(chunk["y"]), np.float32)
        pad = batch_size - len(weight)
        if pad:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in chunk.items()}
            weight = np.concatenate([weight, np.zeros(pad, np.float32)])
        yield chunk, weight


def padded_means(
    sums: Callable[[Any, np.ndarray], Mapping[str, Any]],
    arrays: Mapping[str, np.ndarray],
    batch_size: int,
    *,
    mesh: Any = None,
) -> dict[str, float]:
    """Per-example means over all rows of ``arrays``, from weighted sums of padded chunks.

    ``sums(chunk, weight) -> {name: sum of the rows' values times weight}`` (a jitted
    evaluation) runs on every chunk of :func:`padded_batches`; the totals are accumulated on
    the host in float and divided by the row count, so padding rows (weight 0) count nowhere.

    Args:
      sums: the chunk evaluation; ``chunk`` holds ``(batch_size, ...)`` arrays, ``weight`` is
        ``(batch_size,)`` float32.
      arrays: ``(N, ...)`` host arrays, with ``"y"`` (its length is ``N``).
      batch_size: rows per chunk (one compiled shape).
      mesh: if given, each ``(chunk, weight)`` is put on it with :func:`shard_batch` first.

    Returns:
      ``{name: total / N}`` with the names of ``sums``'s output, in its order.
    """
    totals: dict[str, float] = {}
    for batch in padded_batches(arrays, batch_size):
        if mesh is not None:
            batch = sharding_lib.shard_batch(mesh, batch)
        for k, v in sums(*batch).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    n = len(arrays["y"])
    return {k: v / n for k, v in totals.items()}


def _key_to_json(key: jax.Array) -> dict[str, Any]:
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else key
    return {"typed": bool(typed), "data": np.asarray(data).tolist()}


def _key_from_json(meta: Mapping[str, Any]) -> jax.Array:
    data = jnp.asarray(np.asarray(meta["data"], np.uint32))
    return jax.random.wrap_key_data(data) if meta["typed"] else data


def _host_window(window: list[Mapping[str, Any]]) -> list[dict[str, float]]:
    return [{k: float(np.asarray(v)) for k, v in m.items()} for m in jax.device_get(window)]


def _mean_metrics(window: list[Mapping[str, Any]]) -> dict[str, float]:
    """Means over the window's finite steps, plus the count of skipped (non-finite) ones."""
    host = _host_window(window)
    good = [m for m in host if m.get(_FINITE, 1.0)] or host
    names = [k for k in host[0] if k != _FINITE]
    out = {k: float(np.mean(np.asarray([m[k] for m in good], np.float64))) for k in names}
    skipped = sum(not m.get(_FINITE, 1.0) for m in host)
    return {**out, "skipped_steps": float(skipped)} if skipped else out


def _all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every inexact leaf of ``tree`` is finite (integer leaves always are)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _first_nonfinite(
    window: list[Mapping[str, Any]], last_step: int, max_loss: float
) -> tuple[int, str] | None:
    """``(step, what)`` of the first bad step in ``window`` (which ends at ``last_step``): one
    with a non-finite metric or state, or a loss above ``max_loss``."""
    flags = jax.device_get([m[_FINITE] for m in window])
    for i, ok in enumerate(flags):
        if not ok:
            metrics = _host_window([window[i]])[0]
            bad = [
                f"train/{k}={v}" for k, v in metrics.items() if k != _FINITE and not np.isfinite(v)
            ]
            if not bad and max_loss > 0 and metrics.get("loss", -math.inf) > max_loss:
                bad = [f"train/loss={metrics['loss']:.4g} > train.max_loss={max_loss:g}"]
            what = bad[0] if bad else "the train state (parameters or optimizer state)"
            return last_step - len(window) + 1 + i, what
    return None


def _has_sub_byte_leaves(tree) -> bool:
    """Whether any array of ``tree`` has a dtype narrower than a byte (int4, uint4, ...)."""
    return any(
        jnp.issubdtype(leaf.dtype, jnp.integer) and jnp.iinfo(leaf.dtype).bits < 8
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype")
    )


def _jit_step(
    step_fn: Callable[..., Any],
    state_sh: Any,
    frozen_sh: Any,
    mesh: Any,
    *,
    skip_nonfinite: bool,
    max_loss: float = 0.0,
) -> Any:
    """The step ``fit`` runs: ``step_fn`` with the per-step key, the step count and the finiteness
    flag (false too for a loss above ``max_loss`` when it is > 0), jitted with the state donated
    and the given shardings."""
    rep = sharding_lib.replicated(mesh)

    def wrapped(state, frozen, batch, key):
        new_state, metrics = step_fn(state, frozen, batch, jax.random.fold_in(key, state["step"]))
        finite = _all_finite((metrics, new_state))
        if max_loss > 0:
            if "loss" not in metrics:
                raise ValueError(
                    f"max_loss={max_loss:g} bounds metrics['loss'], but the step returns only "
                    f"{sorted(metrics)}: return the loss as 'loss' or leave max_loss at 0 (off)"
                )
            finite = finite & (metrics["loss"] <= max_loss)
        if skip_nonfinite:
            new_state = jax.tree.map(
                lambda new, old: (
                    jnp.where(finite, new, old)
                    if jnp.issubdtype(jnp.result_type(new), jnp.inexact)
                    else new
                ),
                new_state,
                state,
            )
        return {**new_state, "step": state["step"] + 1}, {**metrics, _FINITE: finite}

    return jax.jit(
        wrapped,
        donate_argnums=(0,),
        in_shardings=(state_sh, frozen_sh, sharding_lib.batch_sharding(mesh), rep),
        out_shardings=(state_sh, rep),
    )


def fit_step(
    step_fn: Callable[[Any, Any, Any, jax.Array], tuple[Any, Mapping[str, Any]]],
    state: Any,
    frozen: Any,
    batch: Any,
    *,
    mesh: Any,
    key: Any = None,
    fsdp: bool = False,
    skip_nonfinite: bool = False,
    name: str = "train",
) -> lowering_lib.Step:
    """The jitted step :func:`fit` would run, on abstract arguments (for lowering; no data).

    Args:
      step_fn: the step handed to ``fit``.
      state, frozen, batch: the train state, frozen arrays and one batch (arrays or
        ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``); the state's ``"step"`` may be 0.
      mesh: the mesh (a ``jax.sharding.AbstractMesh`` lowers for devices that need not exist).
      key: the base key handed to ``fit`` (abstract is enough; default: a typed
        ``jax.random.key``).
      fsdp, skip_nonfinite: as in :func:`fit`.
      name: the step's name in lowering reports.

    Returns:
      A :class:`~experiments.common.lowering.Step` whose arguments carry fit's shardings.
    """
    state = {**state, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    state_sh = sharding_lib.param_sharding(mesh, state, fsdp=fsdp)
    frozen_sh = sharding_lib.param_sharding(mesh, frozen, fsdp=fsdp)
    key = jax.eval_shape(lambda: jax.random.key(0)) if key is None else key
    args = (
        lowering_lib.abstract(state, state_sh),
        lowering_lib.abstract(frozen, frozen_sh),
        lowering_lib.sharded_batch(batch, mesh),
        lowering_lib.abstract(key, sharding_lib.replicated(mesh)),
    )
    jitted = _jit_step(step_fn, state_sh, frozen_sh, mesh, skip_nonfinite=skip_nonfinite)
    return lowering_lib.Step(name, jitted, args)


def fit(
    state: dict[str, Any],
    frozen: Any,
    step_fn: Callable[[Any, Any, Any, jax.Array], tuple[Any, Mapping[str, Any]]],
    batches: ResumableIterator,
    *,
    key: jax.Array,
    num_steps: int,
    workdir: str | os.PathLike,
    eval_fn: Callable[[Any, Any], Mapping[str, Any]] | None = None,
    eval_every: int = 0,
    log_every: int = 50,
    ckpt_every: int = 100,
    max_to_keep: int = 2,
    mesh: jax.sharding.Mesh | None = None,
    fsdp: bool = False,
    progress: bool = True,
    description: str = "train",
    skip_nonfinite: bool | None = None,
    max_loss: float | None = None,
) -> FitResult:
    """Trains ``state`` for ``num_steps`` steps, resuming from ``<workdir>/checkpoints``.

    Args:
      state: the trainable train state, a dict with an integer ``"step"`` entry (0 for a fresh
        run) and whatever else the step needs (``"params"`` or ``"adapters"``, ``"opt_state"``).
        It is donated to the jitted step: do not reuse the arrays passed in.
      frozen: pytree of frozen arrays (base model parameters) passed to every step and to
        ``eval_fn``; never donated (may be None).
      step_fn: ``(state, frozen, batch, key) -> (new_state, metrics)``, pure and jittable;
        ``metrics`` is a dict of scalars (``{"loss": ...}``) logged as ``train/<name>``. ``fit``
        sets ``new_state["step"] = state["step"] + 1``.
      batches: resumable iterator of host batches (pytrees of arrays with a leading batch axis
        divisible by the number of devices); see :class:`ResumableIterator`.
      key: base PRNG key; step ``t`` receives ``fold_in(key, t)``.
      num_steps: total number of steps of the run (not of this process).
      workdir: directory for ``checkpoints/``, ``metrics.jsonl`` and ``tensorboard/``.
      eval_fn: ``(state, frozen) -> {"valid/accuracy": ..., ...}`` (keys ``"<split>/<name>"``),
        called every ``eval_every`` steps and after the last step.
      eval_every: evaluation interval in steps (0: only at the end).
      log_every: interval in steps of the averaged ``train/*`` records.
      ckpt_every: periodic checkpoint interval in steps; a run killed with SIGKILL loses at most
        the steps since the last one.
      max_to_keep: number of checkpoints kept.
      mesh: device mesh (default: :func:`~experiments.common.sharding.make_mesh` over all
        devices).
      fsdp: shard ``state`` and ``frozen`` over the devices instead of replicating them.
      progress: show a tqdm progress bar (process 0 only).
      description: the progress bar's label.
      skip_nonfinite: keep the previous state on a step whose metrics or new state are not
        finite (counted in ``train/skipped_steps``) instead of stopping; None (the default):
        ``config.train.skip_nonfinite`` inside :func:`train_options`, else False.
      max_loss: a step whose ``metrics["loss"]`` exceeds it counts as non-finite (it stops the
        run, or is skipped with ``skip_nonfinite``): catches a finite divergence. None (the
        default): ``config.train.max_loss`` inside :func:`train_options`, else 0 (off).

    Returns:
      A :class:`FitResult`.

    Raises:
      ValueError: if ``num_steps``, ``log_every`` or ``ckpt_every`` is not positive, or
        ``state`` has no ``"step"``.
      NonFiniteError: a step's metrics or new state were NaN/Inf (unless ``skip_nonfinite``);
        the message names the first such step, the metric and the last good checkpoint.
    """
    if num_steps <= 0 or log_every <= 0 or ckpt_every <= 0 or eval_every < 0:
        raise ValueError(
            "num_steps, log_every and ckpt_every must be positive and eval_every >= 0, got "
            f"{num_steps}, {log_every}, {ckpt_every}, {eval_every}"
        )
    if not isinstance(state, Mapping) or "step" not in state:
        raise ValueError(
            'state must be a dict with a "step" entry, e.g. {"params", "opt_state", "step"}'
        )
    workdir = os.fspath(workdir)
    training_started()  # the state exists: the model and its adapters are initialised
    if skip_nonfinite is None:
        skip_nonfinite = _SKIP_NONFINITE.get()
    max_loss = _MAX_LOSS.get() if max_loss is None else float(max_loss)
    mesh = sharding_lib.make_mesh() if mesh is None else mesh
    state = {**state, "step": jnp.asarray(state["step"], jnp.int32)}
    state_sh = sharding_lib.param_sharding(mesh, state, fsdp=fsdp)
    frozen_sh = sharding_lib.param_sharding(mesh, frozen, fsdp=fsdp)
    state = sharding_lib.put_global(state, state_sh)
    frozen = sharding_lib.put_global(frozen, frozen_sh)
    leaves = jax.tree.leaves((state_sh, frozen_sh))
    logging.info(
        "Mesh of %d devices; batches split over 'data'; %d of %d parameter/state arrays sharded "
        "(fsdp=%s), the rest replicated.",
        mesh.size,
        sum(not s.is_fully_replicated for s in leaves),
        len(leaves),
        fsdp,
    )
    rep = sharding_lib.replicated(mesh)

    manager = ckpt_lib.make_manager(
        os.path.join(workdir, "checkpoints"), every=ckpt_every, max_to_keep=max_to_keep
    )
    window: list[Any] = []
    timing_before: tuple[int, float] = (0, 0.0)
    restored = ckpt_lib.restore_latest(manager, state)
    if restored is not None:
        state, meta = restored
        batches.restore(meta["data"])
        key = _key_from_json(meta["rng"])
        window = list(meta.get("window", []))  # train metrics since the last log record
        timing_before = tuple(meta.get("timing", (0, 0.0)))  # (timed steps, seconds) so far
        logging.info("Resumed from %s at step %d.", manager.directory, int(state["step"]))
    start = int(jax.device_get(state["step"]))
    writer = metrics_lib.MetricWriter(workdir, start_step=start)

    jitted = _jit_step(
        step_fn, state_sh, frozen_sh, mesh, skip_nonfinite=skip_nonfinite, max_loss=max_loss
    )
    key = sharding_lib.put_global(key, rep)
    run_step = jitted  # with several processes: its executable, compiled before the first step
    meter = cost_lib.StepMeter(description)  # throughput, FLOPs, memory; the profiler flag

    saved_timing = {}  # step -> the (timed steps, seconds) written with its checkpoint

    def meta():
        jax.block_until_ready(state)  # (the window may be empty) the step's time counts below
        host_window = _host_window(window)
        elapsed = time.perf_counter() - t_last if timed_steps else 0.0
        return {
            "data": batches.state(),
            "rng": _key_to_json(key),
            "window": host_window,
            "timing": [timing_before[0] + timed_steps, timing_before[1] + elapsed],
        }

    def save(step):
        step_meta = meta()
        if ckpt_lib.save(manager, step, state, meta=step_meta, force=True):
            saved_timing[step] = tuple(step_meta["timing"])

    def check_finite(step):
        """Raises NonFiniteError if a step of the window (ending at ``step``) was not finite."""
        if skip_nonfinite or not window:
            return
        bad = _first_nonfinite(window, step, max_loss)
        if bad is None:
            return
        good = [s for s in manager.all_steps() if s < bad[0]]
        where = (
            f"the last good checkpoint, step {max(good)}, is kept in {manager.directory}"
            if good
            else "no checkpoint was saved before it"
        )
        raise NonFiniteError(
            f"{bad[1]} at step {bad[0]}: training stopped; {where}. Lower the learning rate "
            "(or clip gradients), or skip such steps: --config.train.skip_nonfinite=True (in "
            "code: fit(..., skip_nonfinite=True))."
        )

    def evaluate(step):
        if step == start:  # a finished run, rerun: its records are already in metrics.jsonl
            return metrics_lib.to_scalars(eval_fn(state, frozen))
        scalars = writer.write(step, eval_fn(state, frozen))
        logging.info("step %d: %s", step, scalars)
        return scalars

    last_eval: dict[str, float] = {}
    last_eval_step = -1
    timed_steps, timed_s, t_last = 0, 0.0, None
    interrupted = False
    bar = None
    if progress and jax.process_index() == 0 and start < num_steps:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_steps, initial=start, desc=description, dynamic_ncols=True)
    multiprocess = jax.process_count() > 1
    try:
        with signals.StopFlag(multiprocess=multiprocess) as stop:
            for step in range(start + 1, num_steps + 1):
                try:
                    batch = sharding_lib.shard_batch(mesh, next(batches))
                except StopIteration:
                    raise ValueError(
                        f"batches ran out before step {step} of {num_steps}: pass an iterator "
                        "that repeats (e.g. BatchIterator(..., num_epochs=None))"
                    ) from None
                if step == start + 1:  # compiled first (jit reuses it): its FLOPs are known
                    compiled = jitted.lower(state, frozen, batch, key).compile()
                    meter.compiled(compiled, batch)
                    if jax.process_count() > 1:
                        # Wait for every process before the first collective (gloo drops a peer
                        # that joins > ~30 s late; compile times differ under load). The jitted
                        # step reuses this executable; it is called directly unless an argument
                        # is sub-byte (NF4's uint4): on CPU such arrays carry a layout the
                        # executable refuses (JAX 0.10.2), while the jitted call accepts them.
                        if not _has_sub_byte_leaves((state, frozen)):
                            run_step = compiled
                        sharding_lib.sync_processes("fit_first_step")
                paused = meter.profile(step, state)  # starts or stops a trace, if asked for
                if t_last is not None:  # (that is not a training step's time)
                    t_last += paused
                state, step_metrics = run_step(state, frozen, batch, key)
                window.append(step_metrics)
                if t_last is None:
                    jax.block_until_ready(state)
                    t_last = time.perf_counter()
                else:
                    timed_steps += 1
                if step % log_every == 0 or step == num_steps:
                    check_finite(step)
                    means = {f"train/{k}": v for k, v in _mean_metrics(window).items()}
                    elapsed = time.perf_counter() - t_last if timed_steps else 0.0  # (synced)
                    writer.write(step, {**means, **meter.log(timed_steps, elapsed)})
                    window = []
                    if bar is not None:
                        bar.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in means.items()})
                if eval_fn is not None and eval_every and step % eval_every == 0:
                    check_finite(step)  # no evaluation records of a non-finite state
                    jax.block_until_ready(state)
                    t_eval = time.perf_counter()
                    last_eval, last_eval_step = evaluate(step), step
                    t_last += time.perf_counter() - t_eval
                # Several processes stop at the step JAX's preemption service agrees on (asked
                # every step, by every process); one process stops at once.
                preempted = manager.reached_preemption(step)
                stopping = preempted if multiprocess else stop.signum is not None
                if stopping or manager.should_save(step):  # (meta() waits for the step)
                    check_finite(step)
                    t_save = time.perf_counter()
                    save(step)
                    if t_last is not None:  # saving is not a training step's time
                        t_last += time.perf_counter() - t_save
                if bar is not None:
                    bar.update(1)
                if stopping:
                    interrupted = True
                    stop.stopped(stop.signum)
                    logging.warning(
                        "Stopped by %s at step %d of %d: checkpoint saved in %s. Rerun the same "
                        "command to resume.",
                        signals.describe(stop.signum),
                        step,
                        num_steps,
                        manager.directory,
                    )
                    break
        if timed_steps:
            jax.block_until_ready(state)
            timed_s = time.perf_counter() - t_last
        meter.stop(state)  # a trace that reached the last step
        end = int(jax.device_get(state["step"]))
        if not interrupted:
            save(end)
            if eval_fn is not None and last_eval_step != end:
                last_eval = evaluate(end)
    finally:
        meter.stop()
        if bar is not None:
            bar.close()
        with contextlib.suppress(Exception):
            manager.wait_until_finished()
        manager.close()
        writer.close()
    total_steps, total_s = timing_before[0] + timed_steps, timing_before[1] + timed_s
    if end in saved_timing:  # what a rerun reads back from the last checkpoint
        total_steps, total_s = saved_timing[end]
    step_time = total_s / total_steps if total_steps else math.nan
    history = metrics_lib.read_metrics(workdir)
    skipped = metrics_lib.skipped_steps(history)
    if skipped:
        logging.warning(
            "%d of %d training steps were skipped (non-finite, or a loss above max_loss) and kept "
            "the previous state; a final loss of NaN (null in JSON) means the state kept is "
            "unusable too.",
            skipped,
            end,
        )
    return FitResult(
        state=state,
        history=history,
        last_eval=last_eval,
        start_step=start,
        interrupted=interrupted,
        step_time_s=step_time,
        skipped_steps=skipped,
        cost=meter.summary(timed_steps, timed_s),
    )
