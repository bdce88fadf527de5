"""The optimizer an experiment reads from its config: warm-up + cosine decay, AdamW or SGD,
optional global-norm clipping, optionally a peak learning rate per top-level parameter group."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

__all__ = ["warmup_cosine_optimizer"]

OPTIMIZERS = ("adamw", "sgd")


def _schedule_optimizer(config: Any, peak: float) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=config.schedule.warmup_steps,
        decay_steps=config.schedule.num_steps,
        end_value=0.0,
    )
    if config.optim.name == "adamw":
        return optax.adamw(schedule, weight_decay=config.optim.weight_decay)
    return optax.sgd(schedule, momentum=0.9)


def _group_labels(trained: Mapping[str, Any]) -> dict[str, Any]:
    return {k: jax.tree.map(lambda _, k=k: k, v) for k, v in trained.items()}


def warmup_cosine_optimizer(
    config: Any, *, peaks: Mapping[str, float] | None = None
) -> optax.GradientTransformation:
    """The optimizer of ``config.optim`` on the schedule of ``config.schedule``.

    The learning rate rises linearly from 0 over ``schedule.warmup_steps`` steps to its peak
    (``optim.learning_rate``), then follows a cosine to 0 at ``schedule.num_steps``.
    ``optim.name`` is ``"adamw"`` (``optim.weight_decay``) or ``"sgd"`` (momentum 0.9); a
    nonzero ``optim.grad_clip`` clips the global gradient norm first.

    Args:
      config: the config (``optim.name``, ``optim.learning_rate``, ``optim.weight_decay``,
        ``optim.grad_clip``, ``schedule.warmup_steps``, ``schedule.num_steps``).
      peaks: if given, the parameters are a dict whose top-level keys each get their own
        optimizer with this peak learning rate (``optax.multi_transform``), e.g.
        ``{"params": 1e-3, "adapters": 5e-2}``; ``optim.learning_rate`` is then unused.

    Returns:
      The ``optax.GradientTransformation``.

    Raises:
      ValueError: if ``optim.name`` is not one of ``("adamw", "sgd")``.
    """
    if config.optim.name not in OPTIMIZERS:
        raise ValueError(f"config.optim.name={config.optim.name!r} must be one of {OPTIMIZERS}.")
    if peaks:
        tx = optax.multi_transform(
            {k: _schedule_optimizer(config, peak) for k, peak in peaks.items()}, _group_labels
        )
    else:
        tx = _schedule_optimizer(config, config.optim.learning_rate)
    if config.optim.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip), tx)
    return tx
