"""The sweep trainers: ``train_scan`` (many optimiser steps in one ``lax.scan``) and
``train_epochs`` (a library's jitted epoch function, epoch by epoch); see
:mod:`experiments.common.sweep`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from experiments.common import cost as cost_lib
from experiments.common import lowering as lowering_lib
from experiments.common.options import TrainOptions

__all__ = ["adam", "batch_indices", "train_epochs", "train_scan", "train_scan_step"]


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
    options: TrainOptions | None = None,
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
      options: the run's options (default ``TrainOptions()``), whose log gets the call's cost.

    Returns:
      ``(trainable, opt_state, trace)``; ``trace[k - 1]`` is the loss on all of ``train`` after
      ``k`` steps (``None`` if ``trace=False``).

    The call is compiled first (once per signature), then timed to its end: its examples/s and
    FLOPs go to ``options.log`` (the run's cost table and the cell's metrics; see
    :mod:`experiments.common.cost`).
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
        options=TrainOptions() if options is None else options,
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
    options: TrainOptions | None = None,
) -> tuple[Any, Any, list[tuple[int, float]]]:
    """Runs a library's jitted epoch function ``num_epochs`` times (for cells trained by epoch).

    ``epoch_fn(params, opt_state, key, *args) -> (params, opt_state, loss)`` (e.g.
    :func:`lowrank_jax.kge.training.make_train_epoch`, which donates ``params`` and ``opt_state``);
    epoch ``e`` gets the second half of the ``e``-th ``split`` of ``key``. The loss comes to the
    host only every ``log_every`` epochs and after the last one.

    The epochs are timed (the first one's compilation excluded) and recorded as
    ``num_epochs * steps_per_epoch`` steps of ``examples_per_epoch / steps_per_epoch`` examples in
    ``options.log`` (default ``TrainOptions()``; the run's cost table and the cell's metrics),
    with the FLOPs of the compiled epoch (an epoch
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
        options=TrainOptions() if options is None else options,
        steps=num_epochs * steps_per_epoch,
        seconds=time.perf_counter() - start,
        examples=examples_per_epoch / steps_per_epoch,
        flops=flops,
    )
    return params, opt_state, curve
