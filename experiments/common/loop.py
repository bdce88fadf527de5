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
                 workdir=workdir, eval_fn=evaluate, eval_every=200,
                 options=TrainOptions.from_config(config, workdir))

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
  non-finite step (or, with ``options.max_loss``, a loss above it) stops the run with
  :class:`~experiments.common.steps.NonFiniteError`, naming the step, the metric and the last good
  checkpoint, which is left intact (nothing non-finite is ever saved); with
  ``options.skip_nonfinite`` such steps keep the previous state instead (as
  ``optax.apply_if_finite``) and are counted in ``train/skipped_steps``;
* **outputs**: ``metrics.jsonl`` and TensorBoard (train metrics averaged over ``log_every`` steps,
  ``eval_fn`` results every ``eval_every`` steps and at the end), a tqdm bar with rate and ETA;
* **cost** (:mod:`~experiments.common.cost`): with every train record, ``cost/examples_per_s``
  (``tokens_per_s``) over the interval, ``cost/flops_per_step`` of the compiled step,
  ``cost/utilisation`` and peak memory; a ``jax.profiler`` trace of the steps that
  ``options`` names (``config.profile``).

Its run-wide options (``skip_nonfinite``, ``max_loss``, the peak TFLOP/s, the profiled steps) come
in one explicit value, ``options`` (:class:`~experiments.common.options.TrainOptions`, built from
the config by ``TrainOptions.from_config``; default: ``TrainOptions()``). The step ``fit`` jits is
built in :mod:`~experiments.common.steps`; whole-split evaluation helpers for ``eval_fn`` are in
:mod:`~experiments.common.evaluation`.

``batches`` is an iterator of host (numpy) batch pytrees with ``state()`` and ``restore(state)``
(JSON-serialisable), such as ``lowrank_jax.data.BatchIterator``; wrap one with
:class:`~experiments.common.batches.MapBatches` to tokenise or reshape on the fly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from experiments.common import checkpoint as ckpt_lib
from experiments.common import cost as cost_lib
from experiments.common import metrics as metrics_lib
from experiments.common import sharding as sharding_lib
from experiments.common import signals
from experiments.common import steps as steps_lib
from experiments.common.batches import ResumableIterator
from experiments.common.options import TrainOptions

__all__ = [
    "FitResult",
    "fit",
    "fit_options",
]


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
    options: TrainOptions | None = None,
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
        divisible by the number of devices); see
        :class:`~experiments.common.batches.ResumableIterator`.
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
      options: the run's options (:class:`~experiments.common.options.TrainOptions`; default
        ``TrainOptions()``): ``skip_nonfinite`` keeps the previous state on a step whose metrics
        or new state are not finite (counted in ``train/skipped_steps``) instead of stopping;
        a step whose ``metrics["loss"]`` exceeds ``max_loss`` (> 0) counts as non-finite (a
        finite divergence); the peak TFLOP/s and profiled steps of the cost records; ``fit``
        reports its cost row and its start (``options.log``).

    Returns:
      A :class:`FitResult`.

    Raises:
      ValueError: if ``num_steps``, ``log_every`` or ``ckpt_every`` is not positive, or
        ``state`` has no ``"step"``.
      experiments.common.steps.NonFiniteError: a step's metrics or new state were NaN/Inf, or
        its loss above ``max_loss`` (unless ``skip_nonfinite``); the message names the first
        such step, the metric and the last good checkpoint.
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
    options = TrainOptions() if options is None else options
    options.log.started()  # the state exists: the model and its adapters are initialised
    skip_nonfinite, max_loss = options.skip_nonfinite, options.max_loss
    mesh = sharding_lib.make_mesh() if mesh is None else mesh
    state = {**state, "step": jnp.asarray(state["step"], jnp.int32)}
    (state, state_sh), (frozen, frozen_sh) = sharding_lib.place(mesh, state, frozen, fsdp=fsdp)
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
        key = ckpt_lib.key_from_json(meta["rng"])
        window = list(meta.get("window", []))  # train metrics since the last log record
        timing_before = tuple(meta.get("timing", (0, 0.0)))  # (timed steps, seconds) so far
        logging.info("Resumed from %s at step %d.", manager.directory, int(state["step"]))
    start = int(jax.device_get(state["step"]))
    writer = metrics_lib.MetricWriter(workdir, start_step=start)

    jitted = steps_lib.jit_step(
        step_fn, state_sh, frozen_sh, mesh, skip_nonfinite=skip_nonfinite, max_loss=max_loss
    )
    key = sharding_lib.put_global(key, rep)
    run_step = jitted  # with several processes: its executable, compiled before the first step
    meter = cost_lib.StepMeter(description, options)  # throughput, FLOPs, memory; the profiler flag

    saved_timing = {}  # step -> the (timed steps, seconds) written with its checkpoint

    def meta():
        jax.block_until_ready(state)  # (the window may be empty) the step's time counts below
        host_window = steps_lib.host_window(window)
        elapsed = time.perf_counter() - t_last if timed_steps else 0.0
        return {
            "data": batches.state(),
            "rng": ckpt_lib.key_to_json(key),
            "window": host_window,
            "timing": [timing_before[0] + timed_steps, timing_before[1] + elapsed],
        }

    def save(step):
        step_meta = meta()
        if ckpt_lib.save(manager, step, state, meta=step_meta, force=True):
            saved_timing[step] = tuple(step_meta["timing"])

    def check_finite(step):
        """Raises NonFiniteError if a step of the window (ending at ``step``) was not finite."""
        if not skip_nonfinite and window:
            steps_lib.check_finite(window, step, max_loss, manager)

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
                        if not steps_lib.has_sub_byte_leaves((state, frozen)):
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
                    means = {f"train/{k}": v for k, v in steps_lib.mean_metrics(window).items()}
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
