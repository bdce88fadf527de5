"""A classifier's fine-tuning step over an explicit train state with the frozen base kept apart.

The train state is a dict ``{"params": trained params, "adapters": adapter factors (optional),
"opt_state", "step", ...}``; the frozen parameters travel as a separate argument, so a loop can
donate the state and never the base. ``logits_fn(state, frozen, batch, *, train, key)`` computes
the ``(b, c)`` logits (for instance ``adapt(model.apply)`` on ``combine(state["params"], frozen)``
and ``state["adapters"]``); the step trains exactly :func:`trained_parts` of the state::

    step = make_classifier_step(logits_fn, tx)
    state["opt_state"] = tx.init(trained_parts(state))
    for batch in batches:
        key, sub = jax.random.split(key)
        state, metrics = jax.jit(step, donate_argnums=0)(state, frozen, batch, sub)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["classifier_sums", "make_classifier_step", "trained_parts"]

_TRAINED = ("params", "adapters")


def trained_parts(state: Mapping[str, Any]) -> dict[str, Any]:
    """The trained part of a train state: its ``"params"`` and ``"adapters"`` entries.

    Args:
      state: a train state dict (``"params"``; ``"adapters"`` optional; other entries such as
        ``"opt_state"`` and ``"step"`` are left out).

    Returns:
      ``{"params": ..., "adapters": ...}`` with the entries ``state`` has, in that order: the
      pytree the optimizer is initialised on and the gradients are taken of.

    Raises:
      ValueError: if ``state`` has neither entry.
    """
    out = {k: state[k] for k in _TRAINED if k in state}
    if not out:
        raise ValueError(f"the train state has none of {_TRAINED}; it has {sorted(state)}.")
    return out


def make_classifier_step(
    logits_fn: Callable[..., jax.Array], tx: optax.GradientTransformation
) -> Callable[..., tuple[dict[str, Any], dict[str, jax.Array]]]:
    """A training step of mean softmax cross-entropy over :func:`trained_parts` of the state.

    ``loss = mean_i CE(logits_fn(state, frozen, batch, train=True, key=key)_i, y_i)``; its
    gradient with respect to the trained parts goes through ``tx`` and
    ``optax.apply_updates``. ``state["step"]`` is left to the loop.

    Args:
      logits_fn: ``(state, frozen, batch, *, train, key) -> (b, c)`` logits.
      tx: the optax transformation whose state is ``state["opt_state"]``.

    Returns:
      ``step(state, frozen, batch, key) -> (new state, {"loss": (), "accuracy": ()})`` where
      ``batch["y"]`` is ``(b,)`` int labels; ``loss`` and ``accuracy`` are of the batch before
      the update. Pure: jit it (donating ``state``) or hand it to a training loop.
    """

    def step(state, frozen, batch, key):
        def loss_fn(trained):
            logits = logits_fn({**state, **trained}, frozen, batch, train=True, key=key)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, logits

        trained = trained_parts(state)
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
        updates, opt_state = tx.update(grads, state["opt_state"], trained)
        trained = optax.apply_updates(trained, updates)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return {**state, **trained, "opt_state": opt_state}, {"loss": loss, "accuracy": accuracy}

    return step


def classifier_sums(
    logits_fn: Callable[..., jax.Array],
) -> Callable[..., dict[str, jax.Array]]:
    """The weighted loss and accuracy sums of one evaluation batch.

    ``{"loss": sum_i w_i CE(z_i, y_i), "accuracy": sum_i w_i [argmax z_i = y_i]}`` with
    ``z = logits_fn(state, frozen, batch, train=False, key=None)``: with weight 0 on padding
    rows, the sums over all chunks divided by the number of real rows are the dataset's mean
    loss and accuracy.

    Args:
      logits_fn: ``(state, frozen, batch, *, train, key) -> (b, c)`` logits.

    Returns:
      ``sums(state, frozen, batch, weight) -> {"loss": (), "accuracy": ()}`` where ``batch["y"]``
      is ``(b,)`` int labels and ``weight`` is ``(b,)`` float. Pure: jit it.
    """

    def sums(state, frozen, batch, weight):
        logits = logits_fn(state, frozen, batch, train=False, key=None)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return {"loss": jnp.sum(loss * weight), "accuracy": jnp.sum(correct * weight)}

    return sums
