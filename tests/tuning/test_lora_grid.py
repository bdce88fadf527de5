"""The vmapped LoRA grid scorer against a plain Adam loop with LoRA(alpha), and the search space's
encodings against their definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowrank_jax import adapters, models, tuning
from lowrank_jax.tuning.lora_grid import epoch_order
from lowrank_jax.tuning.lora_space import onehot_features, ordinal_features
from lowrank_jax.tuning.text_embedding import principal_components


def _problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    model = models.MLP((6,), 3)
    params = model.init(jax.random.key(1), x[:1])
    return model, params, (x[:16], y[:16]), (x[16:], y[16:])


def _reference(model, params, train, valid, *, rank, alpha, lr, batch, epochs, micro, key):
    """Plain LoRA(alpha) + head training with optax.adam on batches of ``batch`` examples."""
    k_init, _ = jax.random.split(key)
    rules = [(r"params/dense_0/kernel", adapters.lora(rank, alpha=alpha))]
    tr = {"adapters": adapters.init(k_init, params, rules)}
    tr["head"], frozen = adapters.split_trainable(params, [r"params/head/.*"])
    fwd = adapters.adapt(model.apply)

    def loss(tr, xb, yb):
        logits = fwd(adapters.combine(tr["head"], frozen), tr["adapters"], xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    tx = optax.adam(lr)
    state = tx.init(tr)
    grad = jax.jit(jax.grad(loss))
    idx = epoch_order(0, len(train[1]), num_epochs=epochs, micro_batch=micro)
    k = batch // micro
    for s in range(len(idx) // k):
        b = idx[s * k : (s + 1) * k].reshape(-1)
        g = grad(tr, train[0][b], train[1][b])
        u, state = tx.update(g, state, tr)
        tr = optax.apply_updates(tr, u)
    return float(loss(tr, *valid))


def test_group_scores_equal_plain_lora_training_with_alpha_and_accumulated_batches():
    model, params, train, valid = _problem()
    configs = [(2.0, 1e-2, 4), (8.0, 3e-2, 8), (1.0, 3e-2, 8)]
    alphas, lrs, batches = map(np.asarray, zip(*configs, strict=True))
    key = jax.random.key(3)
    out = tuning.score_lora_group(
        model.apply, params, train, {"valid": valid}, targets=[r"params/dense_0/kernel"],
        trainable=[r"params/head/.*"], rank=2, dropout=0.0, alphas=alphas, learning_rates=lrs,
        batch_sizes=batches, num_epochs=3, micro_batch=4, key=key,
    )  # fmt: skip
    for j, (a, lr, b) in enumerate(configs):
        ref = _reference(
            model, params, train, valid, rank=2, alpha=a, lr=lr, batch=b, epochs=3, micro=4, key=key
        )
        assert out["valid_loss"][j] == pytest.approx(ref, rel=1e-4, abs=1e-5), (a, lr, b)
    assert out["num_updates"].tolist() == [12, 6, 6]
    assert out["valid_accuracy"].shape == (3,)
    with pytest.raises(ValueError, match="multiple of micro_batch=4"):
        tuning.score_lora_group(
            model.apply, params, train, {}, targets=[r"params/dense_0/kernel"], rank=2,
            dropout=0.0, alphas=[1.0], learning_rates=[1e-2], batch_sizes=[6], num_epochs=1,
            micro_batch=4, key=key,
        )  # fmt: skip


def test_space_encodings_follow_their_definitions():
    space = tuning.LoraSearchSpace((1, 4), (2.0, 8.0), (1e-3, 1e-2), (8, 16), (0.0, 0.1))
    cfg = tuning.lora_grid_configurations(space)
    assert len(cfg["rank"]) == 32 == int(np.prod(space.shape))
    i = int(np.ravel_multi_index((1, 0, 1, 1, 0), space.shape))  # C order
    assert (cfg["rank"][i], cfg["alpha"][i], cfg["learning_rate"][i]) == (4, 2.0, 1e-2)
    assert tuning.describe_configurations(cfg)[i] == (
        "rank=4, alpha=2, learning_rate=0.01, batch_size=16, dropout=0"
    )
    kf = tuning.knowledge_features(cfg)[i]
    lr, a, r, b = 1e-2, 2.0, 4.0, 16.0
    ref = [np.log(lr), np.log(a / r), np.log(r), np.log(lr * a / r), np.log(b), lr / b, 0.0]
    np.testing.assert_allclose(kf, ref, rtol=1e-12)
    np.testing.assert_array_equal(ordinal_features(cfg)[i], [1, 0, 1, 1, 0])
    oh = onehot_features(cfg)
    assert oh.shape == (32, 10) and np.all(oh.sum(1) == 5)
    tok = tuning.value_tokens(cfg)
    np.testing.assert_array_equal(tok.sum(1), oh)  # the tokens are the one-hot blocks
    z = tuning.standardize_features(tuning.knowledge_features(cfg))
    np.testing.assert_allclose(z[:, :6].mean(0), 0, atol=1e-6)
    with pytest.raises(ValueError, match="axis dropout has out-of-range"):
        tuning.lora_grid_configurations(space._replace(dropouts=(0.0, 1.0)))
    with pytest.raises(TypeError, match="axis rank must hold ints"):
        tuning.lora_grid_configurations(space._replace(ranks=(1.5, 2)))
    with pytest.raises(ValueError, match="distinct values"):
        tuning.lora_grid_configurations(space._replace(alphas=(2.0, 2.0)))


def test_principal_components_match_numpy_svd():
    x = np.random.default_rng(0).normal(size=(10, 4)) @ np.diag([3.0, 2.0, 1.0, 0.1])
    p = principal_components(x, 2)
    np.testing.assert_allclose(p.T @ p, np.diag(np.sum(p**2, 0)), atol=1e-9)  # orthogonal scores
    ev = np.linalg.eigvalsh(np.cov(x.T, bias=True))[::-1][:2] * len(x)
    np.testing.assert_allclose(np.sum(p**2, 0), ev, rtol=1e-9)
    assert jnp.asarray(p).shape == (10, 2)
