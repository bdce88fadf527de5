"""Tests of ``lowrank_jax.continual.make_train_step`` (a continual method's training step)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import continual, models


def _setup():
    model = models.MLP((16,), 6)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8)))
    method = continual.o_lora(
        model.apply, targets=(r"params/dense_\d+/kernel",), rank=2, learning_rate=1e-2,
        lambda_orth=0.5,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 8)).astype(np.float32), rng.integers(0, 3, 12).astype(np.int32)
    task = continual.Task(0, np.arange(3), x, y, 6)
    trainable, frozen, tx = method.begin_task(method.init(variables), jax.random.key(1), task)
    mask = np.isin(np.arange(6), [0, 1, 2])
    batch = {"x": x, "y": y, "mask": np.repeat(mask[None], 12, 0)}
    return method, trainable, frozen, tx, batch


def test_one_step_is_the_masked_objective_plus_penalty_through_tx():
    method, trainable, frozen, tx, batch = _setup()
    key = jax.random.key(2)
    state = {"trainable": trainable, "opt_state": tx.init(trainable), "step": 7}
    new, metrics = jax.jit(continual.make_train_step(method, tx))(state, frozen, batch, key)

    def loss_fn(tr):
        z = jnp.where(batch["mask"], method.apply(tr, frozen, batch["x"]), -1e9)
        ce = optax.softmax_cross_entropy_with_integer_labels(z, batch["y"]).mean()
        return ce + method.loss(tr, frozen, batch, key), ce

    (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    updates, _ = tx.update(grads, tx.init(trainable), trainable)
    want = optax.apply_updates(trainable, updates)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["ce"], ce, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new["trainable"], want
    )
    assert new["step"] == 7  # other entries pass through
    # the loss falls over a few steps on the fixed batch
    step = jax.jit(continual.make_train_step(method, tx))
    for _ in range(20):
        state, m = step(state, frozen, batch, key)
    assert float(m["ce"]) < float(ce)


def test_bad_arguments_raise():
    method, _, _, tx, _ = _setup()
    with pytest.raises(TypeError, match="ContinualMethod"):
        continual.make_train_step(tx, tx)
    with pytest.raises(TypeError, match="GradientTransformation"):
        continual.make_train_step(method, optax.adam)
