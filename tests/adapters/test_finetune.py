"""The classifier fine-tuning step: it is SGD on the cross-entropy of the trained parts only, and
the evaluation sums give the dataset's mean loss and accuracy whatever the padding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.adapters.finetune import classifier_sums, make_classifier_step, trained_parts

NUM_CLASSES, LR = 3, 0.1
X = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)
Y = jnp.asarray([0, 1, 2, 1, 0, 2], jnp.int32)


@pytest.fixture(scope="module")
def setup():
    """A LoRA-adapted MLP: head trained, hidden kernel frozen with a nonzero LoRA on it."""
    model = models.MLP((4,), NUM_CLASSES)
    variables = model.init(jax.random.key(0), X)
    trainable, frozen = adapters.split_trainable(variables, (r"params/head/.*",))
    lora = adapters.init(jax.random.key(1), variables, [(r".*dense_0/kernel", adapters.lora(2))])
    lora = jax.tree.map(lambda a: a + 0.1, lora)  # B = 0 at init: make the adapter act
    apply = adapters.adapt(model.apply)

    def logits_fn(state, frozen, batch, *, train, key):
        del train, key
        return apply(adapters.combine(state["params"], frozen), state["adapters"], batch["x"])

    return {"params": trainable, "adapters": lora, "step": 0}, frozen, logits_fn


def _loss(trained, frozen, logits_fn):
    logits = logits_fn(trained, frozen, {"x": X}, train=True, key=None)
    return optax.softmax_cross_entropy_with_integer_labels(logits, Y).mean()


def test_trained_parts_are_params_and_adapters_only(setup):
    state, _, _ = setup
    parts = trained_parts({**state, "opt_state": ()})
    assert list(parts) == ["params", "adapters"]
    assert trained_parts({"params": 1, "step": 0}) == {"params": 1}
    with pytest.raises(ValueError, match="none of"):
        trained_parts({"opt_state": (), "step": 0})


def test_step_is_sgd_on_the_cross_entropy_of_the_trained_parts(setup):
    state, frozen, logits_fn = setup
    tx = optax.sgd(LR)
    state = {**state, "opt_state": tx.init(trained_parts(state))}
    step = jax.jit(make_classifier_step(logits_fn, tx))
    new, metrics = step(state, frozen, {"x": X, "y": Y}, jax.random.key(2))
    trained = trained_parts(state)
    loss, grads = jax.value_and_grad(_loss)(trained, frozen, logits_fn)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    logits = logits_fn(trained, frozen, {"x": X}, train=False, key=None)
    np.testing.assert_allclose(metrics["accuracy"], np.mean(np.argmax(logits, -1) == Y))
    expected = jax.tree.map(lambda p, g: p - LR * g, trained, grads)
    got = trained_parts(new)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert new["step"] == 0  # the loop counts steps
    assert float(jnp.abs(grads["adapters"][next(iter(grads["adapters"]))].factors["a"]).sum()) > 0


def test_sums_over_padded_chunks_are_the_mean_loss_and_accuracy(setup):
    state, frozen, logits_fn = setup
    sums = jax.jit(classifier_sums(logits_fn))
    logits = logits_fn(state, frozen, {"x": X}, train=False, key=None)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, Y)
    full = sums(state, frozen, {"x": X, "y": Y}, jnp.ones(6))
    np.testing.assert_allclose(full["loss"] / 6, ce.mean(), rtol=1e-6)
    np.testing.assert_allclose(full["accuracy"] / 6, np.mean(np.argmax(logits, -1) == Y))
    # Rows 4 and 5 replaced by copies of row 3 with weight 0: the sums of rows 0..3.
    pad_x, pad_y = X.at[4:].set(X[3]), Y.at[4:].set(Y[3])
    w = jnp.asarray([1, 1, 1, 1, 0, 0], jnp.float32)
    padded = sums(state, frozen, {"x": pad_x, "y": pad_y}, w)
    np.testing.assert_allclose(padded["loss"], ce[:4].sum(), rtol=1e-6)
    np.testing.assert_allclose(padded["accuracy"], np.sum(np.argmax(logits[:4], -1) == Y[:4]))
