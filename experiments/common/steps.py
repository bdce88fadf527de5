"""The training step that ``fit`` runs, built from an experiment's pure step function.

:func:`jit_step` wraps ``step_fn(state, frozen, batch, key)`` with the per-step key
(``fold_in(key, state["step"])``), the step count and a finiteness flag (false for a NaN/Inf
metric or state, or a loss above ``max_loss``), keeps the previous state on a bad step with
``skip_nonfinite``, and jits it with the state donated and fit's shardings. :func:`fit_step` is
the same program on abstract arguments, for lowering. The flag travels with the step's metrics
(never logged): :func:`mean_metrics` averages a logging window over its good steps and
:func:`first_nonfinite` finds the first bad one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import lowering as lowering_lib
from experiments.common import sharding as sharding_lib
from experiments.common.options import TrainOptions

__all__ = [
    "NonFiniteError",
    "check_finite",
    "first_nonfinite",
    "fit_step",
    "has_sub_byte_leaves",
    "host_window",
    "jit_step",
    "mean_metrics",
]

_FINITE = "_finite"  # the step's finiteness flag, carried with its metrics but never logged


def host_window(window: list[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The window's step metrics on the host, as floats."""
    return [{k: float(np.asarray(v)) for k, v in m.items()} for m in jax.device_get(window)]


def mean_metrics(window: list[Mapping[str, Any]]) -> dict[str, float]:
    """Means over the window's finite steps, plus the count of skipped (non-finite) ones."""
    host = host_window(window)
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


def first_nonfinite(
    window: list[Mapping[str, Any]], last_step: int, max_loss: float
) -> tuple[int, str] | None:
    """``(step, what)`` of the first bad step in ``window`` (which ends at ``last_step``): one
    with a non-finite metric or state, or a loss above ``max_loss``."""
    flags = jax.device_get([m[_FINITE] for m in window])
    for i, ok in enumerate(flags):
        if not ok:
            metrics = host_window([window[i]])[0]
            bad = [
                f"train/{k}={v}" for k, v in metrics.items() if k != _FINITE and not np.isfinite(v)
            ]
            if not bad and max_loss > 0 and metrics.get("loss", -math.inf) > max_loss:
                bad = [f"train/loss={metrics['loss']:.4g} > train.max_loss={max_loss:g}"]
            what = bad[0] if bad else "the train state (parameters or optimizer state)"
            return last_step - len(window) + 1 + i, what
    return None


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or Inf loss, metric or state; the message says where."""


def check_finite(
    window: list[Mapping[str, Any]], last_step: int, max_loss: float, manager: Any
) -> None:
    """Raises :class:`NonFiniteError` if a step of ``window`` (which ends at ``last_step``) was
    not finite, naming it, the metric and the last good checkpoint of ``manager``."""
    bad = first_nonfinite(window, last_step, max_loss)
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
        "code: fit(..., options=TrainOptions(skip_nonfinite=True)))."
    )


def has_sub_byte_leaves(tree) -> bool:
    """Whether any array of ``tree`` has a dtype narrower than a byte (int4, uint4, ...)."""
    return any(
        jnp.issubdtype(leaf.dtype, jnp.integer) and jnp.iinfo(leaf.dtype).bits < 8
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype")
    )


def jit_step(
    step_fn: Callable[..., Any],
    state_sh: Any,
    frozen_sh: Any,
    mesh: Any,
    *,
    skip_nonfinite: bool,
    max_loss: float = 0.0,
) -> Any:
    """The step :func:`~experiments.common.loop.fit` runs: ``step_fn`` with the per-step key,
    the step count and the finiteness flag (false too for a loss above ``max_loss`` when it is
    > 0), jitted with the state donated and the given shardings."""
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
    options: TrainOptions | None = None,
    name: str = "train",
) -> lowering_lib.Step:
    """The jitted step :func:`~experiments.common.loop.fit` would run, on abstract arguments
    (for lowering; no data).

    Args:
      step_fn: the step handed to ``fit``.
      state, frozen, batch: the train state, frozen arrays and one batch (arrays or
        ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``); the state's ``"step"`` may be 0.
      mesh: the mesh (a ``jax.sharding.AbstractMesh`` lowers for devices that need not exist).
      key: the base key handed to ``fit`` (abstract is enough; default: a typed
        ``jax.random.key``).
      fsdp, options: as in :func:`~experiments.common.loop.fit` (``options.skip_nonfinite`` and
        ``options.max_loss`` are part of the program; default: ``TrainOptions()``).
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
    options = TrainOptions() if options is None else options
    jitted = jit_step(
        step_fn,
        state_sh,
        frozen_sh,
        mesh,
        skip_nonfinite=options.skip_nonfinite,
        max_loss=options.max_loss,
    )
    return lowering_lib.Step(name, jitted, args)
