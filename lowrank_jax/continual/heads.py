r"""The classifier head as a component of its own: refitting it on frozen features.

:class:`~lowrank_jax.continual.ContinualState` keeps the head (``state.head``) apart from the
backbone (``state.params``), so head-side corrections act on every method alike: they read the
consolidated backbone and rewrite only ``state.head``. :func:`refit_head` is the one used today
(SABER's recalibration after recomposition); class-incremental heads (classifier alignment from
stored per-class feature statistics, prototype heads) belong here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.continual.protocol import masked_cross_entropy, set_path

__all__ = ["refit_head"]


@functools.partial(jax.jit, static_argnames=("apply_fn", "head_path", "learning_rate"))
def _refit_step(params, head, opt_state, x, y, mask, *, apply_fn, head_path, learning_rate):
    def loss_fn(h):
        return masked_cross_entropy(apply_fn(set_path(params, head_path, h), x), y, mask)

    grads = jax.grad(loss_fn)(head)
    updates, opt_state = optax.adam(learning_rate).update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state


def refit_head(
    apply_fn: Callable[..., Any],
    params: Any,
    head: Any,
    x: np.ndarray,
    y: np.ndarray,
    classes: np.ndarray,
    *,
    num_classes: int,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int | Sequence[int],
    head_path: str = "params/head",
) -> Any:
    r"""Refits ``head`` for ``steps`` Adam steps on ``(x, y)`` with the backbone ``params`` frozen.

    Minimises the cross-entropy over ``classes`` (the other logits masked out) of
    ``apply_fn(params with head at head_path, x)``; batches of ``min(batch_size, N)`` rows drawn
    without replacement by ``numpy.random.default_rng(seed)`` (deterministic).

    Args:
      apply_fn: the plain model ``apply(variables, x) -> logits (b, C)`` (hashable: a linen
        ``model.apply`` or a module-level function; it is a static argument of the jitted step).
      params: the model's variables (their head is ignored).
      head: the head to start from.
      x: ``(N, ...)`` inputs; ``y``: ``(N,)`` labels in ``classes``.
      classes: ``(k,)`` the classes the loss ranges over.
      num_classes: ``C``.
      steps: number of Adam steps (0 returns ``head`` unchanged).
      learning_rate: Adam learning rate.
      batch_size: rows per step.
      seed: the sampling seed (an int or a sequence of ints, as numpy takes it).
      head_path: where the head sits in ``params``.

    Returns:
      The refitted head (host arrays).

    Raises:
      ValueError: ``steps < 0`` or ``batch_size < 1``.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps}, {batch_size}.")
    if not steps:
        return head
    step = functools.partial(
        _refit_step, apply_fn=apply_fn, head_path=head_path, learning_rate=float(learning_rate)
    )
    head = jax.tree.map(jnp.asarray, head)
    opt_state = optax.adam(learning_rate).init(head)
    mask = np.zeros((len(y), num_classes), bool)
    mask[:, np.asarray(classes)] = True
    rng = np.random.default_rng(seed)
    n, bs = len(y), min(batch_size, len(y))
    for _ in range(steps):
        idx = rng.choice(n, bs, replace=False)
        head, opt_state = step(params, head, opt_state, x[idx], y[idx], mask[idx])
    return jax.device_get(head)
