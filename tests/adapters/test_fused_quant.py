"""The fused LoRA matmul and the low-precision (bfloat16, int8) frozen bases.

Fused vs factorised: same values and adapter gradients to float32 tolerance (both backends, jit,
vmap, scan, remat, transposed use, dropout fallback); its training step has no weight-gradient
dot. Low-precision bases: the adapted forward on a bf16 / int8 base equals the forward on the
float32 upcast / dequantisation of that base (same kernels, so float32 rounding only), int8
quantisation is within half a scale step of the kernel, ``merge`` dequantises and ``init`` sees
the dequantised kernel.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.bench import common
from lowrank_jax import adapters as A
from lowrank_jax.adapters import quant
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.adapters.quant import dequantize, dequantize_base, quantize_int8, quantize_nf4
from tests.adapters.models import Block, perturb, plain_function, plain_params

X = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)
RULES = [
    (r".*fc1/kernel", A.lora(4, alpha=8.0)),
    (r".*qkv/kernel", A.lora(2, in_ndim=1)),
    (r".*out/kernel", A.lora(2, out_ndim=1, rslora=True)),
]
F32_ATOL = 2e-5  # float32 rounding of x·(W + sAB) against x·W + s(xA)B at these sizes


def _close(tree_a, tree_b, atol, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def block():
    model = Block()
    variables = model.init(jax.random.key(0), X)
    return model, variables, perturb(A.init(jax.random.key(1), variables, RULES))


def _value_and_grad(fwd, variables, ad, x=X):
    loss = lambda a: jnp.sum(jnp.sin(fwd(variables, a, x)))
    return jax.jit(jax.value_and_grad(loss))(ad)


@pytest.mark.parametrize("backend", ["quax", "linen"])
def test_fused_equals_factorised_values_and_grads(block, backend):
    model, variables, ad = block
    ref = A.adapt(model.apply, backend=backend)
    fused = A.adapt(model.apply, backend=backend, lora_matmul="fused")
    np.testing.assert_allclose(
        jax.jit(fused)(variables, ad, X), ref(variables, ad, X), atol=F32_ATOL
    )
    (l1, g1), (l0, g0) = _value_and_grad(fused, variables, ad), _value_and_grad(ref, variables, ad)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    _close(g1, g0, atol=F32_ATOL)


_plain = plain_function


@pytest.fixture(scope="module")
def plain():
    p, rules = plain_params()
    return p, perturb(A.init(jax.random.key(0), p, rules))


def test_fused_under_scan_remat_vmap_and_transposed_use(plain):
    p, ad = plain
    ref, fused = A.adapt(_plain), A.adapt(_plain, lora_matmul="fused")
    (l1, g1), (l0, g0) = _value_and_grad(fused, p, ad), _value_and_grad(ref, p, ad)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    _close(g1, g0, atol=1e-4)
    xs = jnp.stack([X, 2 * X])
    vm = lambda f: jax.jit(jax.vmap(f, in_axes=(None, None, 0)))(p, ad, xs)
    np.testing.assert_allclose(vm(fused), vm(ref), atol=1e-4)


def test_fused_with_dropout_falls_back_to_factorised(block):
    model, variables, _ = block
    ad = perturb(A.init(jax.random.key(1), variables, [(r".*fc1/kernel", A.lora(4, dropout=0.5))]))
    key = jax.random.key(7)
    for backend in ("quax", "linen"):
        got = A.adapt(model.apply, backend=backend, lora_matmul="fused")(
            variables, ad, X, adapter_key=key
        )
        want = A.adapt(model.apply, backend=backend)(variables, ad, X, adapter_key=key)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_bad_lora_matmul():
    with pytest.raises(ValueError, match="lora_matmul"):
        A.adapt(lambda p: p, lora_matmul="merged")


def test_fused_step_has_no_weight_gradient_dot():
    n, m, tokens = 24, 40, 64

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="head")(jnp.tanh(nn.Dense(m, name="body")(x)))

    model = Mlp()
    x = jnp.ones((tokens, n))
    variables = model.init(jax.random.key(0), x)
    ad = A.init(jax.random.key(1), variables, [(r".*body/kernel", A.lora(4))])
    opt = optax.adam(1e-3)

    def dots(forward):
        def step(ad, opt_state, variables, x):
            loss, g = jax.value_and_grad(lambda a: jnp.mean(forward(variables, a, x) ** 2))(ad)
            updates, opt_state = opt.update(g, opt_state, ad)
            return optax.apply_updates(ad, updates), opt_state, loss

        hlo = jax.jit(step).lower(ad, opt.init(ad), variables, x).compile().as_text()
        return common.weight_shaped_dots(hlo, [(n, m)], min_contraction=tokens)

    for backend in ("quax", "linen"):
        assert dots(A.adapt(model.apply, backend=backend, lora_matmul="fused")) == []
    # The detector finds the weight gradient of merge-at-apply (ΔW's cotangent, contracting tokens).
    assert dots(lambda v, a, x: model.apply(A.fold(v, a), x))


# ----------------------------------------------------------------------------------------------
# Low-precision frozen bases.


def _upcast(params):
    """The float32 reference of a low-precision base: dequantised / upcast kernels."""
    return jax.tree.map(
        lambda w: jnp.asarray(quant.dequantize(w), jnp.float32),
        params,
        is_leaf=quant.is_quantized,
    )


def test_int8_quantisation_is_absmax_per_channel():
    w = np.asarray(jax.random.normal(jax.random.key(0), (16, 5)), np.float64)
    q = quantize_int8(jnp.asarray(w, jnp.float32))
    assert q.qvalue.dtype == jnp.int8 and q.scale.shape == (1, 5)
    scale = np.abs(w).max(axis=0, keepdims=True) / 127.5  # qwix's symmetric int8: ±127.5
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    err = np.abs(np.asarray(dequantize(q), np.float64) - w)
    assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(np.abs(np.asarray(q.qvalue, np.int32)).max(axis=0) >= 127)


NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])  # fmt: skip  # QLoRA, Appendix E


def test_nf4_quantisation_is_blockwise_absmax_to_the_nearest_level():
    w = np.asarray(jax.random.normal(jax.random.key(0), (2, 64, 5)), np.float64)  # stacked
    q = quantize_nf4(jnp.asarray(w, jnp.float32), block_size=16)
    assert q.qvalue.dtype == jnp.uint4 and q.qtype == "nf4" and q.scale.shape == (2, 4, 5)
    scale = np.abs(w).reshape(2, 4, 16, 5).max(axis=2)  # per layer, block of rows, column
    np.testing.assert_allclose(q.scale, scale, rtol=1e-6)
    s = np.repeat(scale, 16, axis=1)
    nearest = np.abs(w[..., None] / s[..., None] - NF4_LEVELS).argmin(axis=-1)
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.int32), nearest)
    err = np.abs(np.asarray(dequantize(q), np.float64) - w)
    assert np.all(err <= s * np.diff(NF4_LEVELS).max() / 2 * (1 + 1e-5) + 1e-7)
    assert quant.base_bytes(q) == w.size // 2 + 4 * w.size // 16
    with pytest.raises(ValueError, match="block_size=24"):
        quantize_nf4(jnp.asarray(w), block_size=24)


@pytest.mark.parametrize(
    "base_dtype, lora_matmul, backend",  # each option twice, in four combinations
    [
        ("bfloat16", "fused", "quax"),
        ("bfloat16", "factorised", "linen"),
        ("int8", "fused", "linen"),
        ("int8", "factorised", "quax"),
    ],
)
def test_low_precision_base_matches_its_float32_reference(block, base_dtype, lora_matmul, backend):
    model, variables, ad = block
    low = A.low_precision_base(variables, base_dtype)
    fwd = A.adapt(model.apply, backend=backend, lora_matmul=lora_matmul)
    ref = A.adapt(model.apply, backend=backend)
    y = jax.jit(fwd)(low, ad, X)
    assert y.dtype == jnp.float32  # float32 activations and factors: float32 output
    np.testing.assert_allclose(y, ref(_upcast(low), ad, X), atol=F32_ATOL)
    (l1, g1), (l0, g0) = _value_and_grad(fwd, low, ad), _value_and_grad(ref, _upcast(low), ad)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    _close(g1, g0, atol=F32_ATOL)
    assert {g.dtype for g in jax.tree.leaves(g1)} == {jnp.dtype(jnp.float32)}
    # The base is what was rounded: within bf16 / int8 precision of the float32 model.
    np.testing.assert_allclose(y, ref(variables, ad, X), atol=0.1, rtol=0.05)


def test_low_precision_bytes_merge_and_init(block):
    model, variables, ad = block
    kernels = sum(v.nbytes for p, v in named_leaves(variables).items() if p.endswith("kernel"))
    rest = quant.base_bytes(variables) - kernels
    bf16, int8 = (
        A.low_precision_base(variables, "bfloat16"),
        A.low_precision_base(variables, "int8"),
    )
    assert quant.base_bytes(bf16) == rest + kernels // 2
    assert quant.base_bytes(int8) < rest + kernels // 4 + 4 * 64
    assert sorted(named_leaves(int8)) == sorted(named_leaves(variables))  # paths unchanged
    for low in (bf16, int8):
        folded = A.fold(low, ad)  # dequantises; float32 factors promote the kernels
        for path, leaf in named_leaves(folded).items():
            if path.endswith("kernel"):
                assert leaf.dtype == jnp.float32, path
        np.testing.assert_allclose(
            model.apply(folded, X), A.adapt(model.apply)(low, ad, X), atol=F32_ATOL
        )
        np.testing.assert_allclose(
            model.apply(dequantize_base(folded), X), model.apply(A.fold(_upcast(low), ad), X)
        )
    # init reads the dequantised kernel (PiSSA uses W's SVD).
    rules = [(r".*fc1/kernel", A.lora(2, init="pissa"))]
    _close(
        A.init(jax.random.key(0), int8, rules),
        A.init(jax.random.key(0), _upcast(int8), rules),
        1e-6,
    )
    with pytest.raises(ValueError, match="base_dtype"):
        A.low_precision_base(variables, "int4")
    with pytest.raises(ValueError, match="matches"):
        A.low_precision_base(variables, "int8", patterns=(r"nothing",))
