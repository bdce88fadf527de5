"""Scores of many LoRA configurations at once: one ``jit``, ``vmap`` over alpha, learning rate
and batch size, for one (rank, dropout) group.

Every configuration of a group trains the same LoRA factors (rank ``r``, dropout ``p``) plus
optionally some fully trainable parameters (a new head) with Adam for ``num_epochs`` epochs over
the same example order. Shapes are shared across the group:

* ``alpha`` enters as the factor ``s = α/r`` on ``A``: the loss of ``(s·A, B)`` under a scale-1
  LoRA is exactly the loss of ``(A, B)`` under LoRA with ``alpha = α`` (same function, same
  gradients), so ``s`` can be a traced, vmapped value;
* the learning rate multiplies Adam's direction (``optax.scale_by_adam``);
* a batch of ``b = k·m`` examples is ``k`` accumulated micro-batches of ``m`` examples: every
  configuration runs the same micro-steps and applies its update after every ``k``-th one, so a
  fixed number of epochs gives ``b``-dependent numbers of updates at one compiled shape.

Rank and dropout rate are static (a LoRA kind's rank sets shapes; its dropout rate is a Python
float), hence one call per (rank, dropout) group.

References:
  P15 LoRA-BO (specs §15 (4)): the exhaustive grid of the CPU experiment, precomputed once with
  ``jit`` + ``vmap``. Hu et al. 2021 (LoRA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax import adapters

__all__ = ["epoch_order", "score_lora_group"]


def epoch_order(seed: int, n: int, *, num_epochs: int, micro_batch: int) -> np.ndarray:
    """``(T, micro_batch)`` example indices: ``num_epochs`` fresh permutations of ``range(n)``,
    concatenated and cut into ``T = ceil(num_epochs·n / micro_batch)`` micro-batches (the tail
    wraps around to the start)."""
    rng = np.random.default_rng([seed, 15])
    order = np.concatenate([rng.permutation(n) for _ in range(num_epochs)])
    steps = -(-len(order) // micro_batch)
    order = np.resize(order, steps * micro_batch)
    return order.reshape(steps, micro_batch)


def _scale_a(ads: Mapping[str, adapters.Adapter], s: jax.Array) -> dict[str, adapters.Adapter]:
    return {k: a.replace(factors={**a.factors, "a": a.factors["a"] * s}) for k, a in ads.items()}


def score_lora_group(
    apply_fn: Callable[..., jax.Array],
    params: Any,
    train: tuple[jax.typing.ArrayLike, jax.typing.ArrayLike],
    evals: Mapping[str, tuple[jax.typing.ArrayLike, jax.typing.ArrayLike]],
    *,
    targets: Sequence[str],
    trainable: Sequence[str] = (),
    rank: int,
    dropout: float,
    alphas: jax.typing.ArrayLike,
    learning_rates: jax.typing.ArrayLike,
    batch_sizes: jax.typing.ArrayLike,
    num_epochs: int,
    micro_batch: int = 8,
    key: jax.Array,
) -> dict[str, np.ndarray]:
    """Trains and evaluates ``g`` LoRA configurations that share ``rank`` and ``dropout``.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits (b, classes)`` (e.g. a linen ``model.apply``).
      params: the pretrained parameters (frozen except ``trainable``).
      train: ``(x (n, ...), y (n,) int)``, the training examples.
      evals: ``{name: (x, y)}`` sets to evaluate after training.
      targets: regexes of the kernels that get LoRA (see :func:`lowrank_jax.adapters.init`).
      trainable: regexes of parameters trained in full (a new head), with the same optimiser.
      rank, dropout: the group's LoRA rank and dropout rate.
      alphas, learning_rates, batch_sizes: ``(g,)`` each, the configurations.
      num_epochs: passes over ``train``.
      micro_batch: ``m``; every batch size must be a multiple of it.
      key: PRNG key (LoRA initialisation and dropout masks; the same for every configuration).

    Returns:
      ``{"<name>_accuracy": (g,), "<name>_loss": (g,)}`` float64 per eval set (a diverged run
      has loss ``inf``), and ``"num_updates": (g,)``.

    Raises:
      ValueError: mismatched lengths, a batch size that is not a positive multiple of
        ``micro_batch``, or ``num_epochs < 1``.
    """
    alphas = np.asarray(alphas, np.float32).reshape(-1)
    lrs = np.asarray(learning_rates, np.float32).reshape(-1)
    batches = np.asarray(batch_sizes).reshape(-1)
    if not (len(alphas) == len(lrs) == len(batches) >= 1):
        raise ValueError(
            f"alphas, learning_rates, batch_sizes need one equal length >= 1; got "
            f"{len(alphas)}, {len(lrs)}, {len(batches)}."
        )
    if np.any(batches < micro_batch) or np.any(batches % micro_batch):
        raise ValueError(
            f"every batch size must be a positive multiple of micro_batch={micro_batch}; got "
            f"{sorted(set(batches.tolist()))}."
        )
    if not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be an int >= 1; got {num_epochs!r}.")
    x, y = jnp.asarray(train[0]), jnp.asarray(train[1])
    k_init, k_drop = jax.random.split(key)
    rules = [(t, adapters.lora(rank, dropout=float(dropout))) for t in targets]
    ad0 = adapters.init(k_init, params, rules)
    head, frozen = adapters.split_trainable(params, trainable) if trainable else (None, params)
    idx = jnp.asarray(epoch_order(0, len(y), num_epochs=num_epochs, micro_batch=micro_batch))
    out = _train_group(
        apply_fn,
        float(dropout) > 0,
        {"adapters": ad0, "head": head},
        frozen,
        x,
        y,
        idx,
        k_drop,
        jnp.asarray(alphas / rank),
        jnp.asarray(lrs),
        jnp.asarray(batches // micro_batch, jnp.int32),
        {k: (jnp.asarray(v[0]), jnp.asarray(v[1])) for k, v in evals.items()},
    )
    result = {k: np.asarray(v, np.float64) for k, v in out.items()}
    for k in result:
        if k.endswith("_loss"):
            result[k] = np.where(np.isfinite(result[k]), result[k], np.inf)
    result["num_updates"] = (len(idx) // (batches // micro_batch)).astype(np.int64)
    return result


@functools.partial(jax.jit, static_argnums=(0, 1))  # compiled once per model and dropout use
def _train_group(apply_fn, use_dropout: bool, *args):
    return _group_fn(apply_fn, use_dropout)(*args)


def _group_fn(apply_fn, use_dropout: bool):
    fwd = adapters.adapt(apply_fn)
    opt = optax.scale_by_adam()

    def logits_fn(tr, frozen, xb, s, key):
        p = frozen if tr["head"] is None else adapters.combine(tr["head"], frozen)
        return fwd(p, _scale_a(tr["adapters"], s), xb, adapter_key=key)

    def loss_fn(tr, frozen, xb, yb, s, key):
        logits = logits_fn(tr, frozen, xb, s, key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def train_one(tr0, frozen, x, y, idx, key, s, lr, k, evals):
        def body(carry, inp):
            tr, state, acc, count = carry
            t, i = inp
            dkey = jax.random.fold_in(key, t) if use_dropout else None
            g = jax.grad(loss_fn)(tr, frozen, x[i], y[i], s, dkey)
            acc = jax.tree.map(jnp.add, acc, g)
            count = count + 1
            do = count == k
            u, new_state = opt.update(jax.tree.map(lambda a: a / k, acc), state, tr)
            stepped = jax.tree.map(lambda p, d: p - lr * d, tr, u)
            pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(do, a, b), new, old)
            tr, state = pick(stepped, tr), pick(new_state, state)
            acc = jax.tree.map(lambda a: jnp.where(do, jnp.zeros_like(a), a), acc)
            return (tr, state, acc, jnp.where(do, 0, count)), None

        zeros = jax.tree.map(jnp.zeros_like, tr0)
        carry = (tr0, opt.init(tr0), zeros, jnp.zeros((), jnp.int32))
        steps = jnp.arange(idx.shape[0])
        (tr, *_), _ = jax.lax.scan(body, carry, (steps, idx))
        out = {}
        for name, (xe, ye) in evals.items():
            logits = logits_fn(tr, frozen, xe, s, None)
            out[f"{name}_accuracy"] = jnp.mean(jnp.argmax(logits, -1) == ye)
            out[f"{name}_loss"] = optax.softmax_cross_entropy_with_integer_labels(logits, ye).mean()
        return out

    axes = (None, None, None, None, None, None, 0, 0, 0, None)
    return jax.vmap(train_one, in_axes=axes)
