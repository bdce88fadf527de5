"""One training step of a continual method on a task: the caller's objective plus its penalties.

:func:`make_train_step` is the inner loop of :mod:`lowrank_jax.continual.protocol`'s example as
a pure, jittable function over an explicit state ``{"trainable", "opt_state", ...}``::

    trainable, frozen, tx = method.begin_task(state, key, task)
    step = jax.jit(continual.make_train_step(method, tx))
    train_state = {"trainable": trainable, "opt_state": tx.init(trainable)}
    for i, batch in enumerate(batches):                   # {"x", "y", "mask"}
        train_state, metrics = step(train_state, frozen, batch, jax.random.fold_in(key, i))
    state = method.end_task(state, train_state["trainable"], frozen, task)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from lowrank_jax.continual.protocol import ContinualMethod, masked_cross_entropy

__all__ = ["make_train_step"]


def make_train_step(
    method: ContinualMethod, tx: optax.GradientTransformation
) -> Callable[
    [dict[str, Any], Any, dict[str, jax.Array], jax.Array],
    tuple[dict[str, Any], dict[str, jax.Array]],
]:
    r"""The training step of ``method`` on the current task (one optax update).

    The loss is the masked cross-entropy over the batch's classes plus the method's penalties,
    ``L = CE_mask(apply(trainable, frozen, x), y) + method.loss(trainable, frozen, batch, key)``
    (:func:`~lowrank_jax.continual.masked_cross_entropy`); its gradient in ``trainable`` goes
    through ``tx``.

    Args:
      method: the continual method.
      tx: the transformation :attr:`~lowrank_jax.continual.ContinualMethod.begin_task` returned
        for this task.

    Returns:
      ``step(state, frozen, batch, key) -> (state, {"loss", "ce"})``: ``state`` a dict with
      ``"trainable"`` and ``"opt_state"`` (other entries, e.g. a step count, pass through
      unchanged); ``frozen`` from ``begin_task``; ``batch`` ``{"x": (b, ...), "y": (b,) int,
      "mask": (b, C) or (C,) bool}``; ``key`` the penalties' PRNG key; ``loss`` the total and
      ``ce`` the cross-entropy, scalars. Pure and jittable (its state may be donated).

    Raises:
      TypeError: ``method`` is not a :class:`~lowrank_jax.continual.ContinualMethod` or ``tx``
        not an ``optax.GradientTransformation``.
    """
    if not isinstance(method, ContinualMethod):
        raise TypeError(f"method must be a ContinualMethod; got {type(method).__name__}.")
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax.GradientTransformation; got {type(tx).__name__}.")

    def step(state, frozen, batch, key):
        def loss_fn(tr):
            logits = method.apply(tr, frozen, batch["x"])
            ce = masked_cross_entropy(logits, batch["y"], batch["mask"])
            return ce + method.loss(tr, frozen, batch, key), ce

        (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["trainable"])
        trainable = optax.apply_updates(state["trainable"], updates)
        return {**state, "trainable": trainable, "opt_state": opt_state}, {"loss": loss, "ce": ce}

    return step
