"""Factorised application: equals the folded model, under jit/grad/vmap/scan/remat, all backends."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowrank_jax import adapters as A
from tests.adapters.models import Block, Scanned, perturb, plain_function, plain_params

X = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)
RULES = [
    (r".*fc1/kernel", A.lora(4, alpha=8.0)),
    (r".*qkv/kernel", A.lora(2, in_ndim=1)),
    (r".*out/kernel", A.lora(2, out_ndim=1, rslora=True)),
]


def _close(tree_a, tree_b, atol):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)


@pytest.fixture(scope="module")
def block():
    model = Block()
    variables = model.init(jax.random.key(0), X)
    return model, variables, perturb(A.init(jax.random.key(1), variables, RULES))


@pytest.mark.parametrize("backend", ["quax", "linen"])
def test_factorised_equals_merged_and_grads_match(block, backend):
    model, variables, ad = block
    fwd = jax.jit(A.adapt(model.apply, backend=backend))
    np.testing.assert_allclose(
        fwd(variables, ad, X), model.apply(A.fold(variables, ad), X), atol=1e-6
    )
    loss = lambda a: jnp.sum(fwd(variables, a, X) ** 2)
    loss_merged = lambda a: jnp.sum(model.apply(A.fold(variables, a), X) ** 2)
    _close(jax.grad(loss)(ad), jax.grad(loss_merged)(ad), atol=1e-5)


def test_nnx_model():
    model = nnx.Sequential(
        nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 4, rngs=nnx.Rngs(1))
    )
    graphdef, state = nnx.split(model)
    apply = lambda s, x: nnx.merge(graphdef, s)(x)
    ad = perturb(A.init(jax.random.key(0), state, [(r"layers/\d+/kernel", A.lora(2))]))
    assert sorted(ad) == ["layers/0/kernel", "layers/2/kernel"]
    got = jax.jit(A.adapt(apply))(state, ad, X)
    np.testing.assert_allclose(got, apply(A.fold(state, ad), X), atol=1e-6)


_plain = plain_function


@pytest.fixture(scope="module")
def plain():
    p, rules = plain_params()
    return p, perturb(A.init(jax.random.key(0), p, rules))


def test_plain_function_scan_remat_transpose(plain):
    p, ad = plain
    fwd = jax.jit(A.adapt(_plain))
    np.testing.assert_allclose(fwd(p, ad, X), _plain(A.fold(p, ad), X), atol=1e-5)
    g = jax.grad(lambda a: jnp.sum(fwd(p, a, X)))(ad)
    g_ref = jax.grad(lambda a: jnp.sum(_plain(A.fold(p, a), X)))(ad)
    _close(g, g_ref, atol=1e-4)


def test_vmap(plain):
    p, ad = plain
    xs = jnp.stack([X, 2 * X])
    got = jax.jit(jax.vmap(A.adapt(_plain), in_axes=(None, None, 0)))(p, ad, xs)
    np.testing.assert_allclose(
        got, jax.vmap(_plain, in_axes=(None, 0))(A.fold(p, ad), xs), atol=1e-5
    )


def test_linen_scan_and_remat():
    model = Scanned()
    variables = model.init(jax.random.key(0), X)
    assert variables["params"]["layers"]["dense"]["kernel"].shape == (3, 6, 6)
    rules = [
        (r".*layers/dense/kernel", A.lora(2, in_ndim=1, out_ndim=1)),
        (r".*head/kernel", A.lora(2)),
    ]
    ad = perturb(A.init(jax.random.key(1), variables, rules))
    fwd = jax.jit(A.adapt(model.apply))
    np.testing.assert_allclose(
        fwd(variables, ad, X), model.apply(A.fold(variables, ad), X), atol=1e-5
    )
    g = jax.grad(lambda a: jnp.sum(fwd(variables, a, X)))(ad)
    g_ref = jax.grad(lambda a: jnp.sum(model.apply(A.fold(variables, a), X)))(ad)
    _close(g, g_ref, atol=1e-4)
    with pytest.raises(NotImplementedError, match="stacked"):
        A.adapt(model.apply, backend="linen")(variables, ad, X)


def test_dropout_needs_key_and_is_inverted(block):
    model, variables, _ = block
    ad = perturb(A.init(jax.random.key(1), variables, [(r".*fc1/kernel", A.lora(4, dropout=0.5))]))
    fwd = jax.jit(A.adapt(model.apply))
    clean = fwd(variables, ad, X)
    np.testing.assert_allclose(clean, model.apply(A.fold(variables, ad), X), atol=1e-6)
    noisy = [fwd(variables, ad, X, adapter_key=jax.random.key(i)) for i in range(200)]
    assert float(jnp.abs(noisy[0] - clean).max()) > 1e-3
    assert float(jnp.abs(noisy[0] - noisy[1]).max()) > 1e-3
    # Inverted dropout keeps the adapter's first layer unbiased: E[dropout(x)] @ A = x @ A.
    # (Checked on the linear part: the mean over keys of the pre-activation matches.)
    lin = lambda p, x: x @ p["w"]
    p = {"w": jnp.zeros((8, 5))}
    d = perturb(A.init(jax.random.key(1), p, [("w", A.lora(2, dropout=0.5))]))
    f = jax.jit(A.adapt(lin))
    mean = jnp.mean(jnp.stack([f(p, d, X, adapter_key=jax.random.key(i)) for i in range(400)]), 0)
    np.testing.assert_allclose(mean, f(p, d, X), atol=0.1 * float(jnp.abs(f(p, d, X)).max()))


def test_other_ops_raise_unless_allow_dense(plain):
    p, ad = plain
    column_sums = lambda p: jnp.sum(p["emb"], axis=0)
    with pytest.raises(NotImplementedError, match="no factorised rule"):
        jax.jit(A.adapt(column_sums))(p, ad)
    got = jax.jit(A.adapt(column_sums, allow_dense=True))(p, ad)
    np.testing.assert_allclose(got, column_sums(A.fold(p, ad)), atol=1e-5)


def test_row_lookups_are_factorised(plain):
    """An embedding lookup ``E[ids]`` is ``E[ids] + s·A[ids]·B`` (PEFT's embedding LoRA)."""
    p, ad = plain
    ids = jnp.array([[1, 2], [3, 1]])
    for lookup in (lambda p, i: p["emb"][i], lambda p, i: jnp.take(p["emb"], i, axis=0)):
        got = jax.jit(A.adapt(lookup))(p, ad, ids)
        np.testing.assert_allclose(got, lookup(A.fold(p, ad), ids), atol=1e-6)


def test_bf16_compute_casts_factors(plain):
    p, ad = plain
    f = lambda p, x: x.astype(jnp.bfloat16) @ p["w1"].astype(jnp.bfloat16)
    got = jax.jit(A.adapt(f))(p, ad, X)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        got.astype(jnp.float32), f(A.fold(p, ad), X).astype(jnp.float32), atol=5e-2, rtol=1e-2
    )


def test_linen_backend_reports_unused_targets():
    class UsesParamDirectly(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (8, 3))
            return x @ w

    model = UsesParamDirectly()
    variables = model.init(jax.random.key(0), X)
    ad = A.init(jax.random.key(0), variables, [(r".*w", A.lora(2))])
    with pytest.raises(ValueError, match="never used by a linen Dense"):
        A.adapt(model.apply, backend="linen")(variables, ad, X)
    np.testing.assert_allclose(A.adapt(model.apply)(variables, ad, X), model.apply(variables, X))


def test_adapters_for_other_params_are_rejected(block):
    model, variables, ad = block
    other = {"params": {"fc1": variables["params"]["fc1"]}}
    with pytest.raises(ValueError, match="not in params"):
        A.adapt(lambda p, x: x)(other, ad, X)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        A.adapt(lambda p: p, backend="torch")


# The point of LoRA: no weight-shaped matmul for a targeted kernel in a training step.

N, M = 24, 40


def _weight_shaped_dots(step, *args) -> int:
    text = jax.jit(step).lower(*args).as_text()
    pattern = rf"dot_general.*-> tensor<(1x)?({N}x{M}|{M}x{N})xf32>"
    return len(re.findall(pattern, text))


def test_training_step_has_no_weight_shaped_dot():
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(M, name="body")(x)))

    model = Mlp()
    x = jnp.ones((16, N))
    variables = model.init(jax.random.key(0), x)
    ad = A.init(jax.random.key(1), variables, [(r".*body/kernel", A.lora(4))])
    opt = optax.adam(1e-3)

    def make_step(forward):
        def step(ad, opt_state, variables, x):
            loss, g = jax.value_and_grad(lambda a: jnp.mean(forward(variables, a, x) ** 2))(ad)
            updates, opt_state = opt.update(g, opt_state, ad)
            return optax.apply_updates(ad, updates), opt_state, loss

        return step

    args = (ad, opt.init(ad), variables, x)
    for backend in ("quax", "linen"):
        assert _weight_shaped_dots(make_step(A.adapt(model.apply, backend=backend)), *args) == 0
    merge_at_apply = lambda v, a, x: model.apply(A.fold(v, a), x)
    assert _weight_shaped_dots(make_step(merge_at_apply), *args) >= 2  # ΔW forward and its grad


def test_convolutions_and_lookups_are_factorised_with_merged_values_and_gradients():
    """flax nn.Conv kernels (*window, in, out) and an nn.Embed table with LoRA: conv(x, W) +
    s·conv(x, A)·B and E[ids] + s·A[ids]·B give the folded model's outputs and adapter gradients."""

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(11, 6, name="emb")(ids)
            h = nn.relu(nn.Conv(5, (3,), padding=1, name="c1")(h))
            h = jnp.repeat(h[:, :, None, :], 3, axis=2)
            return nn.Conv(4, (3, 2), strides=(2, 1), padding="VALID", name="c2")(h)

    ids = jnp.array([[1, 2, 3, 4, 5, 6], [0, 9, 10, 3, 3, 7]])
    v = ConvNet().init(jax.random.key(0), ids)
    rules = [
        (r".*emb/embedding", A.lora(2)),
        (r".*c1/kernel", A.lora(2, in_ndim=2)),
        (r".*c2/kernel", A.lora(3, alpha=6.0, in_ndim=3)),
    ]
    ad = jax.tree.map(lambda t: t + 0.1, A.init(jax.random.key(1), v, rules))
    fwd = A.adapt(ConvNet().apply)  # would raise if a kernel fell back to the dense path
    folded = lambda ad: ConvNet().apply(A.fold(v, ad), ids)
    np.testing.assert_allclose(jax.jit(fwd)(v, ad, ids), folded(ad), atol=1e-5)
    got = jax.jit(jax.grad(lambda ad: jnp.sum(fwd(v, ad, ids) ** 2)))(ad)
    want = jax.grad(lambda ad: jnp.sum(folded(ad) ** 2))(ad)
    for path in ad:
        for f in ("a", "b"):
            np.testing.assert_allclose(
                got[path].factors[f], want[path].factors[f], rtol=1e-4, atol=1e-5
            )
