"""A small domain-shift benchmark on sklearn digits, shared by the FrameFT and LoRA-DA studies.

The source domain is the original 8x8 digits; the target domain rotates them by 90° and replaces
a fraction of the pixels by uniform noise. :func:`pretrain_mlp` trains an MLP on the source once
per process (cached); the studies adapt it to the target from a few hundred examples.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.common import lowering, sweep
from experiments.common.options import TrainOptions
from lowrank_jax import adapters, data, models

__all__ = [
    "accuracy",
    "adapter_loss",
    "adapter_scan_step",
    "digits_domains",
    "pretrain_mlp",
    "pretrain_step",
    "shifted_digits",
    "source_model",
    "xent",
]


def shifted_digits(x: np.ndarray, *, noise: float, seed: int) -> np.ndarray:
    """Rotates 8x8 digits by 90° and replaces a fraction ``noise`` of pixels by uniform noise."""
    rng = np.random.default_rng(seed)
    out = np.rot90(x, k=1, axes=(1, 2)).copy()
    mask = rng.random(out.shape) < noise
    out[mask] = rng.random(int(mask.sum()))
    return out.astype(np.float32)


def digits_domains(seed: int, *, num_train: int, noise: float, num_valid: int = 0):
    """``(source, target_train, target_valid, target_test)`` as ``(x, y)`` pairs.

    The digits are split 60/40 (stratified, fixed seed 0) into the source (original images) and
    the target pool (rotated + noise); each ``seed`` draws its ``num_train`` target training
    examples (and ``num_valid`` validation ones) from the pool, the rest is the target test set.
    """
    ds = data.load_digits()
    parts = data.split(ds, seed=0, valid_fraction=0.0, test_fraction=0.4)
    src = (np.asarray(parts.train.x, np.float32), np.asarray(parts.train.y))
    pool_x = shifted_digits(np.asarray(parts.test.x, np.float32), noise=noise, seed=1)
    pool_y = np.asarray(parts.test.y)
    order = np.random.default_rng([seed, 7]).permutation(len(pool_y))
    tr, va, te = np.split(order, [num_train, num_train + num_valid])
    pick = lambda idx: (pool_x[idx], pool_y[idx])
    return src, pick(tr), pick(va), pick(te)


def xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(logits: jax.Array, y: jax.Array) -> float:
    return float(jnp.mean(jnp.argmax(logits, -1) == y))


@functools.cache
def adapter_loss(model):
    """``loss(adapters, variables, batch)``: cross-entropy of the adapted ``model`` (one function
    per model, so that :func:`experiments.common.sweep.train_scan` compiles once)."""
    fwd = adapters.adapt(model.apply)

    def loss(ad, variables, batch):
        return xent(fwd(variables, ad, batch["x"]), batch["y"])

    return loss


@functools.cache
def _smoothed_loss(model):
    def loss(v, _, batch):
        return optax.softmax_cross_entropy(model.apply(v, batch["x"]), batch["y"]).mean()

    return loss


@functools.lru_cache(maxsize=8)
def pretrain_mlp(
    features: tuple[int, ...], steps: int, seed: int = 0, *, options: TrainOptions | None = None
):
    """An MLP trained on the source digits: ``(model, variables, source train accuracy)``.

    Adam 1e-3, batch 64 (drawn with replacement), label smoothing 0.1 (which keeps the logits
    moderate, so that the shifted domain starts at a finite loss rather than at a saturated,
    over-confident model). ``options``: the run's, for the cost of the ``train_scan``.
    """
    (x, y), *_ = digits_domains(0, num_train=1, noise=0.0)
    x, y = jnp.asarray(x), jnp.asarray(y)
    model = models.MLP(features, 10)
    variables = model.init(jax.random.key(seed), x[:1])
    idx = np.random.default_rng(seed).integers(0, len(y), (steps, 64))
    train = {"x": x, "y": optax.smooth_labels(jax.nn.one_hot(y, 10), 0.1)}
    variables, _, _ = sweep.train_scan(
        variables, None, train, jnp.asarray(idx), **_pretrain_options(model), options=options
    )
    return model, variables, accuracy(model.apply(variables, x), y)


def _pretrain_options(model):  # the pre-training's train_scan options, in one place
    return {"loss_fn": _smoothed_loss(model), "tx": sweep.adam(1e-3), "trace": False}


# The digits: 8x8 grey images, 10 classes; the source domain is 1,078 of the 1,797 (the
# stratified 60% split of digits_domains), for the lowering.
_SHAPE, _SOURCE_ROWS = (8, 8, 1), 1078


def pretrain_step(config) -> tuple[Any, Any, lowering.Step]:
    """``(model, abstract variables, step)``: :func:`source_model`'s pre-training
    ``train_scan`` on abstract inputs (for lowering; no data)."""
    model = models.MLP(tuple(config.model.features), 10)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *_SHAPE)))
    spec = jax.ShapeDtypeStruct
    train = {"x": spec((_SOURCE_ROWS, *_SHAPE), jnp.float32), "y": spec((_SOURCE_ROWS, 10), jnp.float32)}  # fmt: skip
    idx = spec((config.model.pretrain_steps, 64), jnp.int32)
    step = sweep.train_scan_step(
        "source MLP", variables, None, train, idx, **_pretrain_options(model)
    )
    return model, variables, step


def adapter_scan_step(name, config, model, adapter, base, *, lr: float) -> lowering.Step:
    """The studies' adapter ``train_scan`` (``trace=True``) on abstract inputs: ``adapter`` and
    ``base`` abstract, ``config.data.num_train`` target examples."""
    spec, n = jax.ShapeDtypeStruct, config.data.num_train
    train = {"x": spec((n, *_SHAPE), jnp.float32), "y": spec((n,), jnp.int32)}
    idx = spec((config.schedule.num_steps, config.data.batch_size), jnp.int32)
    return sweep.train_scan_step(
        name, adapter, base, train, idx, loss_fn=adapter_loss(model), tx=sweep.adam(lr)
    )


def source_model(config, options: TrainOptions):
    """:func:`pretrain_mlp` for a study config (``model.features``, ``model.pretrain_steps``) and
    the run's ``options``."""
    features, steps = tuple(config.model.features), config.model.pretrain_steps
    return pretrain_mlp(features, steps, options=options)
