"""Resumable checkpoints with orbax: the train state plus JSON metadata (data position, RNG).

A checkpoint step directory holds two items:

* ``state``: the train state pytree (``{"params"/"adapters", "opt_state", "step"}``), saved with
  ``ocp.args.StandardSave`` so sharded arrays are written by every process in parallel and are
  restored straight into the shardings of an abstract target;
* ``meta``: a small JSON dict (the data iterator's ``state()``, the PRNG key data, anything else).

Orbax writes each step into a temporary directory and renames it when complete, so a run killed
while saving leaves the previous checkpoint intact. Example::

    manager = make_manager(workdir / "checkpoints", every=100)
    restored = restore_latest(manager, state)
    if restored is not None:
        state, meta = restored
    ...
    save(manager, step, state, meta={"data": batches.state()})
    manager.wait_until_finished()
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

__all__ = [
    "CheckpointError",
    "abstract_like",
    "key_from_json",
    "key_to_json",
    "make_manager",
    "restore_latest",
    "save",
]


def make_manager(
    directory: str | os.PathLike, *, every: int, max_to_keep: int = 2
) -> ocp.CheckpointManager:
    """A ``CheckpointManager`` that saves every ``every`` steps and keeps ``max_to_keep``.

    Args:
      directory: where the step directories go (created if missing); usually
        ``<workdir>/checkpoints``.
      every: periodic save interval in steps (:func:`save` with ``force=True`` saves off-interval).
      max_to_keep: number of most recent checkpoints kept on disk.

    Returns:
      An ``orbax.checkpoint.CheckpointManager`` managing the items ``state`` and ``meta``.
    """
    if every <= 0:
        raise ValueError(f"checkpoint interval must be a positive number of steps, got {every}")
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        # Every `every` steps, and when a multi-host job is being preempted; no orbax default of
        # also saving the first step.
        save_decision_policy=policies.AnySavePolicy(
            [policies.FixedIntervalPolicy(every), policies.PreemptionCheckpointingPolicy()]
        ),
        max_to_keep=max_to_keep,
        create=True,
        cleanup_tmp_directories=True,
    )
    return ocp.CheckpointManager(
        os.path.abspath(os.fspath(directory)), item_names=("state", "meta"), options=options
    )


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: Any,
    *,
    meta: dict[str, Any],
    force: bool = False,
) -> bool:
    """Saves ``state`` and ``meta`` at ``step`` if the interval says so (or ``force``).

    Args:
      manager: from :func:`make_manager`.
      step: the number of optimizer steps taken so far.
      state: pytree of arrays (sharded or not).
      meta: JSON-serialisable dict (plain ints, floats, strings, lists).
      force: save even off-interval (end of training, Ctrl-C).

    Returns:
      Whether a save was started (saves are asynchronous; call ``manager.wait_until_finished()``
      before the process exits).
    """
    if not force and not manager.should_save(step):
        return False
    if step in manager.all_steps():
        return False
    return manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
    )


def key_to_json(key: jax.Array) -> dict[str, Any]:
    """A PRNG key (typed or raw ``uint32``) as JSON, for a checkpoint's metadata."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(key) if typed else key
    return {"typed": bool(typed), "data": np.asarray(data).tolist()}


def key_from_json(meta: Mapping[str, Any]) -> jax.Array:
    """The key that :func:`key_to_json` wrote."""
    data = jnp.asarray(np.asarray(meta["data"], np.uint32))
    return jax.random.wrap_key_data(data) if meta["typed"] else data


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves (with shardings) describing a restore target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def restore_latest(manager: ocp.CheckpointManager, target: Any) -> tuple[Any, dict] | None:
    """Restores the newest readable checkpoint into the structure, dtypes and shardings of ``target``.

    A step directory that cannot be read (truncated or corrupted files) is reported by step and
    renamed to ``unreadable_<step>`` (kept for inspection, out of the manager's way, so the step
    can be trained and saved again), and the previous step is restored instead.

    Args:
      manager: from :func:`make_manager`.
      target: a state pytree of arrays (e.g. the freshly initialised state) or of
        ``jax.ShapeDtypeStruct``; restored arrays get its shardings.

    Returns:
      ``(state, meta)`` from the latest readable step, or None when the directory holds no
      checkpoint.

    Raises:
      CheckpointError: no checkpoint in the directory can be read (the message names each step
        directory and says which to delete).
    """
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        return None
    failures = {}
    abstract = abstract_like(target)
    _quiet_closed_event_loop()
    for step in steps:
        try:
            restored = manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # orbax/TensorStore raise many types for unreadable files
            failures[step] = _reason(e)
            continue
        if failures:
            _set_aside(manager, list(failures))
            bad = ", ".join(str(s) for s in failures)
            logging.warning(
                "Checkpoint step%s %s in %s cannot be read (%s): set aside as %s; restored step "
                "%d instead.",
                "s" if len(failures) > 1 else "",
                bad,
                manager.directory,
                "; ".join(failures.values()),
                ", ".join(f"unreadable_{s}" for s in failures),
                step,
            )
        return restored["state"], dict(restored["meta"])
    raise CheckpointError(
        "no checkpoint can be read: "
        + "; ".join(f"{os.path.join(manager.directory, str(s))} ({r})" for s, r in failures.items())
        + ". Delete these step directories to start over from step 0 (or restore them from a "
        "backup)."
    )


def _is_closed_loop_callback(unraisable: Any) -> bool:
    """``RuntimeError('Event loop is closed')`` in the unraisable exception's chain (raised in
    ``call_soon_threadsafe``, or while handling a TensorStore read error of the failed restore,
    which is how it arrives on a loaded machine)."""
    exc, seen = unraisable.exc_value, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return True
        exc = exc.__context__ or exc.__cause__
    return False


def _quiet_closed_event_loop() -> None:
    """Silences TensorStore's late callbacks into the event loop of a failed orbax restore.

    When a restore fails, orbax closes its asyncio loop while TensorStore reads of the other
    arrays are still in flight; each of them later calls ``loop.call_soon_threadsafe`` from a
    C++ thread, gets ``RuntimeError: Event loop is closed`` and reports it through
    ``sys.unraisablehook`` (about a hundred lines that read as a crash, after the restore has
    already fallen back to the previous step). This hook drops exactly those; every other
    unraisable exception goes to the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop_callbacks", False):
        return

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable):
            previous(unraisable)

    hook._drops_closed_loop_callbacks = True
    sys.unraisablehook = hook


def _reason(error: BaseException) -> str:
    """The first line of ``error``, without TensorStore's pointer to a bound method, ≤ 200 chars."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    first = text.splitlines()[0].split(" See full TensorStore details")[0]
    return first[:200]


def _set_aside(manager: ocp.CheckpointManager, steps: list[int]) -> None:
    """Renames unreadable step directories to ``unreadable_<step>`` (process 0) and reloads."""
    if jax.process_index() == 0:
        for step in steps:
            src = os.path.join(os.fspath(manager.directory), str(step))
            dst = os.path.join(os.fspath(manager.directory), f"unreadable_{step}")
            if os.path.isdir(src) and not os.path.exists(dst):
                os.rename(src, dst)
    manager.reload()


class CheckpointError(RuntimeError):
    """No checkpoint of a run directory can be restored."""
