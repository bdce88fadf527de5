"""Tests of MLP, ViT, CharGPT and the shared transformer layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import models
from lowrank_jax.models.layers import SelfAttention, stack_layers, unstack_layers


def _flat(tree):
    return {
        "/".join(k.key for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _kernels(variables):
    return {p: v for p, v in _flat(variables).items() if p.endswith("kernel")}


def test_mlp_names_shapes_and_float64_reference():
    model = models.MLP((16, 8), 3)
    x = jax.random.normal(jax.random.key(0), (5, 4, 5))
    variables = model.init(jax.random.key(1), x)
    kernels = _kernels(variables)
    assert {p: k.shape for p, k in kernels.items()} == {
        "params/dense_0/kernel": (20, 16),
        "params/dense_1/kernel": (16, 8),
        "params/head/kernel": (8, 3),
    }
    logits = jax.jit(model.apply)(variables, x)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
    h = np.asarray(x, np.float64).reshape(5, 20)
    for name in ("dense_0", "dense_1"):
        h = np.maximum(h @ p[name]["kernel"] + p[name]["bias"], 0.0)
    want = h @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5)
    linear = models.MLP((), 2)
    assert linear.apply(linear.init(jax.random.key(0), x), x).shape == (5, 2)
    with pytest.raises(ValueError, match="positive"):
        models.MLP((0,), 2).init(jax.random.key(0), x)


def test_self_attention_matches_float64_reference_with_mask():
    b, t, d, h = 2, 5, 8, 2
    x = jax.random.normal(jax.random.key(0), (b, t, d))
    mask = nn.make_causal_mask(jnp.ones((b, t)), dtype=jnp.bool_)
    attn = SelfAttention(h)
    variables = attn.init(jax.random.key(1), x, mask)
    got = jax.jit(attn.apply)(variables, x, mask)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), variables["params"])
    x64 = np.asarray(x, np.float64)

    def proj(name, v):
        return v @ p[name]["kernel"] + p[name]["bias"]

    k = d // h
    q = proj("query", x64).reshape(b, t, h, k)
    kk = proj("key", x64).reshape(b, t, h, k)
    v = proj("value", x64).reshape(b, t, h, k)
    s = np.einsum("bqhk,bshk->bhqs", q, kk) / np.sqrt(k)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    want = proj("out", np.einsum("bhqs,bshk->bqhk", prob, v).reshape(b, t, d))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="must divide"):
        SelfAttention(3).init(jax.random.key(0), x)


def _shapes(tree):
    return jax.tree.map(jnp.shape, tree)


@pytest.mark.parametrize("shape, patch", [((3, 28, 28), 7), ((3, 8, 8, 1), 2)])
def test_vit_shapes_and_2d_kernels(shape, patch):
    model = models.ViT(patch, 16, 2, 4, 32, 10)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    assert jax.eval_shape(model.apply, variables, x).shape == (3, 10)
    kernels = _kernels(variables)
    assert all(len(k.shape) == 2 for k in kernels.values())
    assert len(kernels) == 1 + 2 * 6 + 1  # patch_embed, 6 per layer, head
    assert kernels["params/patch_embed/kernel"].shape == (patch * patch, 16)
    assert kernels["params/encoder/layer_1/attention/query/kernel"].shape == (16, 16)
    assert kernels["params/encoder/layer_0/attention/out/kernel"].shape == (16, 16)
    assert kernels["params/encoder/layer_0/mlp/fc1/kernel"].shape == (16, 32)
    assert variables["params"]["pos_embed"].shape == (1, 16 + 1, 16)  # 16 patches + class token
    with pytest.raises(ValueError, match="must divide"):
        jax.eval_shape(models.ViT(3, 16, 1, 4, 32, 10).init, jax.random.key(0), x)


def test_vit_scan_equals_unrolled_with_stacked_params():
    x = jax.random.normal(jax.random.key(0), (4, 8, 8))
    unrolled = models.ViT(4, 16, 3, 4, 32, 10)
    scanned = models.ViT(4, 16, 3, 4, 32, 10, dropout_rate=0.5, scan_layers=True)
    v_scanned = jax.jit(scanned.init)(jax.random.key(2), x)
    kernels = _kernels(v_scanned)
    assert kernels["params/encoder/layers/attention/query/kernel"].shape == (3, 16, 16)
    assert kernels["params/encoder/layers/mlp/fc2/kernel"].shape == (3, 32, 16)
    # The layouts correspond exactly, and stack inverts unstack.
    v_unrolled = unstack_layers(v_scanned)
    assert _shapes(v_unrolled) == _shapes(jax.eval_shape(unrolled.init, jax.random.key(1), x))
    assert _shapes(stack_layers(v_unrolled)) == _shapes(v_scanned)
    same = jax.tree.map(np.array_equal, stack_layers(v_unrolled), v_scanned)
    assert all(jax.tree.leaves(same))
    np.testing.assert_array_equal(
        v_unrolled["params"]["encoder"]["layer_2"]["mlp"]["fc1"]["kernel"],
        v_scanned["params"]["encoder"]["layers"]["mlp"]["fc1"]["kernel"][2],
    )
    # They compute the same function (dropout is off when deterministic).
    scanned_apply = jax.jit(scanned.apply, static_argnames="deterministic")
    want = jax.jit(unrolled.apply)(v_unrolled, x)
    np.testing.assert_allclose(scanned_apply(v_scanned, x), want, rtol=0, atol=1e-5)
    # Dropout under scan is active when not deterministic.
    train = scanned_apply(v_scanned, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    assert np.abs(np.asarray(train - want)).max() > 1e-3


def test_stack_layers_errors():
    with pytest.raises(ValueError, match="0..L-1"):
        stack_layers({"layer_0": {"w": jnp.ones(2)}, "layer_2": {"w": jnp.ones(2)}})
    with pytest.raises(ValueError, match="shapes"):
        stack_layers({"layer_0": {"w": jnp.ones(2)}, "layer_1": {"w": jnp.ones(3)}})
    with pytest.raises(ValueError, match="leading layer axis"):
        unstack_layers({"layers": {"w": jnp.ones((2, 1)), "v": jnp.ones((3, 1))}})


@pytest.mark.parametrize("scan_layers", [False, True])
def test_char_gpt_shapes_and_causality(scan_layers):
    vocab, t, positions = 11, 9, (0, 4, 8)
    model = models.CharGPT(vocab, 16, 2, 4, 12, scan_layers=scan_layers)
    tokens = jax.random.randint(jax.random.key(0), (1, t), 0, vocab)
    # Row 0: the sequence; row 1 + j: the sequence with the token at positions[j] changed.
    batch = jnp.concatenate(
        [tokens] + [tokens.at[:, p].set((tokens[:, p] + 1) % vocab) for p in positions]
    )
    variables = model.init(jax.random.key(1), tokens)
    logits = jax.jit(model.apply)(variables, batch)
    assert logits.shape == (1 + len(positions), t, vocab)
    for j, p in enumerate(positions):
        np.testing.assert_allclose(logits[1 + j, :p], logits[0, :p], rtol=0, atol=1e-6)
        assert np.abs(np.asarray(logits[1 + j, p:] - logits[0, p:])).max() > 1e-4
    kernels = _kernels(variables)
    layer_ndim = 3 if scan_layers else 2
    assert all(k.ndim == (layer_ndim if "/decoder/" in p else 2) for p, k in kernels.items())
    assert kernels["params/head/kernel"].shape == (16, vocab)
    with pytest.raises(ValueError, match="max_len"):
        model.apply(variables, jnp.zeros((1, 13), jnp.int32))
    with pytest.raises(ValueError, match="integer token ids"):
        model.apply(variables, jnp.zeros((1, 3)))
