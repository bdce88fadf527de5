"""End-to-end scorers: a pool and a validation set in, one score per pool example out.

Each scorer computes factorised per-example LoRA gradients chunk by chunk
(:func:`~lowrank_jax.selection.gradient_features`) and reduces them at once, so only the stored
features (``d·C`` floats for LESS, ``k`` for GIST) are ever held for the whole pool:

* :func:`less_pipeline`: at every warm-up checkpoint, validation gradients and Adam-normalised
  pool gradients are JL-projected to ``d``; :func:`~lowrank_jax.selection.scoring.less_scores`.
* :func:`gist_pipeline`: at one checkpoint, the top-``k`` right singular directions of the
  validation gradients; pool gradients projected onto them;
  :func:`~lowrank_jax.selection.scoring.gist_scores` for several ``k`` from one pass (the top-``k``
  directions are prefixes of the top-``k_max`` ones). With ``nu`` (the warm-up Adam second
  moment) every gradient is first scaled by ``1/(√ν + ε)``: GIST-diag.
* :func:`cosine_pipeline`: raw cosine with the mean validation gradient (full ``D`` features).

References: P11 GIST (arXiv 2602.18584), specs §11; Xia et al. 2024, LESS.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.selection import gradients, random_projection, scoring

__all__ = [
    "WarmupCheckpoint",
    "cosine_pipeline",
    "gist_pipeline",
    "less_pipeline",
    "warmup_checkpoint",
    "warmup_optimizer",
]


class WarmupCheckpoint(NamedTuple):
    """One warm-up checkpoint: adapter factors, flat Adam moments ``(D,)``, its LESS weight."""

    trainable: Any
    mu: jax.Array
    nu: jax.Array
    weight: float


def _flat(tree: Any) -> jax.Array:
    return gradients.flatten_per_example(jax.tree.map(lambda a: a[None], tree))[0]


def warmup_checkpoint(trainable: Any, opt_state: Any, *, weight: float = 1.0) -> WarmupCheckpoint:
    """Packs a warm-up checkpoint: ``trainable`` and the Adam moments found in ``opt_state``.

    ``weight``: LESS weighs a checkpoint by the mean learning rate of the epoch that ended at it.
    """
    mu, nu, _ = gradients.adam_moments(opt_state)
    return WarmupCheckpoint(trainable, _flat(mu), _flat(nu), float(weight))


def warmup_optimizer(
    learning_rate: float,
    *,
    num_steps: int,
    warmup_fraction: float = 0.03,
    weight_decay: float = 0.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    r"""LESS's warm-up optimizer: AdamW with a linear schedule, ``w = max(1, round(f·T))`` steps
    from 0 up to ``learning_rate``, then linearly down to 0 at step ``T = num_steps``.

    The schedule is returned too: LESS weighs the checkpoint saved after each warm-up epoch by
    the epoch's mean learning rate (``warmup_checkpoint(..., weight=mean(schedule(i) for i in
    epoch))``), and the checkpoints' Adam moments feed :func:`less_pipeline`.

    Args:
      learning_rate: the peak rate (> 0).
      num_steps: ``T``, the warm-up's total optimizer steps (>= 1).
      warmup_fraction: ``f``, the share of ``T`` spent rising, in [0, 1].
      weight_decay: AdamW's decoupled weight decay (>= 0).

    Returns:
      ``(tx, schedule)``: ``optax.adamw(schedule, weight_decay=weight_decay)`` and the schedule.

    Raises:
      ValueError: a non-positive ``learning_rate`` or ``num_steps``, or ``warmup_fraction`` /
        ``weight_decay`` out of range.

    References:
      P11 GIST / LESS (specs.md §11 (2), "Warm-up. Same recipe as LESS": AdamW, linear schedule
      with 3% warm-up; 4 checkpoints weighted by their average learning rate).

    Example::

      tx, schedule = warmup_optimizer(2e-5, num_steps=4 * steps_per_epoch)
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r} is invalid: a rate > 0, e.g. 2e-5")
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} is invalid: a positive int")
    if not 0.0 <= warmup_fraction <= 1.0:
        raise ValueError(f"warmup_fraction={warmup_fraction!r} is invalid: a fraction in [0, 1]")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay={weight_decay!r} is invalid: must be >= 0")
    warm = max(1, round(warmup_fraction * num_steps))
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, learning_rate, warm),
            optax.linear_schedule(learning_rate, 0.0, num_steps - warm),
        ],
        [warm],
    )
    return optax.adamw(schedule, weight_decay=weight_decay), schedule


@dataclasses.dataclass(frozen=True)  # values, equal per dim: the jitted features compile once
class _JL:
    dim: int

    def __call__(self, g, key):
        return random_projection.jl_project(g, key=key, dim=self.dim)


@dataclasses.dataclass(frozen=True)
class _AdamJL:
    dim: int

    def __call__(self, g, mu, nu, key):
        direction = gradients.adam_update_direction(g, mu, nu)
        return random_projection.jl_project(direction, key=key, dim=self.dim)


def _scaled(g, nu):
    return gradients.adam_precondition(g, nu)


def _scaled_project(g, nu, p):
    return gradients.adam_precondition(g, nu) @ p


def less_pipeline(
    loss_fn: Any,
    checkpoints: Sequence[WarmupCheckpoint],
    frozen: Any,
    pool: Any,
    val: Any,
    subtasks: Any,
    *,
    num_subtasks: int,
    key: jax.Array,
    dim: int = 8192,
    chunk_size: int = 256,
) -> jax.Array:
    """LESS scores ``(n,)`` of ``pool`` from warm-up checkpoints (Adam-normalised, JL to ``dim``).

    Args:
      loss_fn: ``(trainable, frozen, example) -> scalar`` for one example.
      checkpoints: :class:`WarmupCheckpoint` s (LESS: one per warm-up epoch, 4).
      frozen: base parameters.
      pool, val: example pytrees with leading axes ``n`` and ``N``.
      subtasks: ``(N,)`` subtask ids of ``val``.
      num_subtasks: ``T``.
      key: the JL projection's key (shared by pool and validation features).
      dim: projection dimension ``d`` (LESS: 8192).
      chunk_size: examples per gradient chunk.
    """
    feats = functools.partial(gradients.gradient_features, loss_fn, frozen=frozen,
                              chunk_size=chunk_size)  # fmt: skip
    tr = [feats(c.trainable, examples=pool, transform=_AdamJL(dim), transform_args=(c.mu, c.nu, key))
          for c in checkpoints]  # fmt: skip
    va = [feats(c.trainable, examples=val, transform=_JL(dim), transform_args=(key,))
          for c in checkpoints]  # fmt: skip
    return scoring.less_scores(jnp.stack(tr), jnp.stack(va), subtasks, num_subtasks=num_subtasks,
                               weights=[c.weight for c in checkpoints])  # fmt: skip


def gist_pipeline(
    loss_fn: Any,
    trainable: Any,
    frozen: Any,
    pool: Any,
    val: Any,
    subtasks: Any,
    *,
    num_subtasks: int,
    ks: Sequence[int] = (9,),
    nu: jax.Array | None = None,
    chunk_size: int = 256,
) -> dict[int, jax.Array]:
    """GIST scores ``{k: (n,)}`` at one checkpoint; GIST-diag when the Adam ``nu`` is given.

    One pass over the pool projects onto the top-``max(ks)`` directions; the scores for a
    smaller ``k`` use the first ``k`` coordinates (``V_k`` is a prefix of ``V_{k_max}``).

    Raises:
      ValueError: if a ``k`` exceeds the number of validation examples.
    """
    feats = functools.partial(gradients.gradient_features, loss_fn, trainable, frozen,
                              chunk_size=chunk_size)  # fmt: skip
    if nu is None:
        g = feats(val)
        proj = lambda p: feats(pool, transform=jnp.matmul, transform_args=(p,))  # noqa: E731
    else:
        g = feats(val, transform=_scaled, transform_args=(nu,))
        proj = lambda p: feats(pool, transform=_scaled_project, transform_args=(nu, p))  # noqa: E731
    basis = scoring.gist_basis(g, k=max(ks))
    f = proj(basis.projection)
    return {k: scoring.gist_scores(f[None, :, :k], basis.val_features[None, :, :k], subtasks,
                                   num_subtasks=num_subtasks) for k in ks}  # fmt: skip


def cosine_pipeline(
    loss_fn: Any, trainable: Any, frozen: Any, pool: Any, val: Any, *, chunk_size: int = 256
) -> jax.Array:
    """Raw gradient cosine ``(n,)`` with the mean validation gradient (no projection)."""
    feats = functools.partial(gradients.gradient_features, loss_fn, trainable, frozen,
                              chunk_size=chunk_size)  # fmt: skip
    return scoring.cosine_scores(feats(pool), feats(val))
