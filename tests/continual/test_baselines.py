"""Baseline pieces (O-LoRA, InfLoRA, SD-LoRA) and layer-input capture."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import continual, models
from lowrank_jax.continual.baselines import (
    inflora_down_projection,
    o_lora_penalty,
    sd_lora_kernel,
    unit_direction,
)
from lowrank_jax.optim import SubspaceMemory, init_subspace_memory


def test_o_lora_penalty():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 2))
    old = rng.standard_normal((3, 6, 4))
    ref = sum(np.sum((o.T @ a) ** 2) for o in old)
    np.testing.assert_allclose(float(o_lora_penalty(a, old)), ref, rtol=1e-5)
    assert float(o_lora_penalty(a, np.zeros((0, 6, 2)))) == 0.0
    with pytest.raises(ValueError, match="T_old"):
        o_lora_penalty(a, np.zeros((6, 2)))


def test_inflora_down_projection_is_off_memory_and_spans_residual():
    rng = np.random.default_rng(1)
    n = 8
    q, _ = np.linalg.qr(rng.standard_normal((n, 3)))
    basis = np.zeros((n, 5))
    basis[:, :3] = q
    mem = SubspaceMemory(jnp.asarray(basis, jnp.float32), jnp.asarray(3, jnp.int32))
    x = rng.standard_normal((50, n)) * np.linspace(2, 0.5, n)
    a = np.asarray(inflora_down_projection(x, mem, rank=2), np.float64)
    np.testing.assert_allclose(q.T @ a, 0, atol=1e-5)
    np.testing.assert_allclose(a.T @ a, np.eye(2), atol=1e-5)
    resid = (np.eye(n) - q @ q.T) @ x.T
    u = np.linalg.svd(resid)[0][:, :2]
    np.testing.assert_allclose(u @ u.T, a @ a.T, atol=1e-4)
    # a memory spanning everything leaves nothing to learn: zero columns
    full = init_subspace_memory(n)
    full = SubspaceMemory(jnp.eye(n), jnp.asarray(n, jnp.int32))
    np.testing.assert_allclose(inflora_down_projection(x, full, rank=2), 0, atol=1e-6)
    with pytest.raises(ValueError, match="rank"):
        inflora_down_projection(x, mem, rank=9)


def test_sd_lora_kernel_and_direction():
    rng = np.random.default_rng(2)
    w0 = rng.standard_normal((4, 3))
    delta = rng.standard_normal((4, 3))
    d, norm = unit_direction(delta)
    np.testing.assert_allclose(float(norm), np.linalg.norm(delta), rtol=1e-5)
    w = sd_lora_kernel(w0, jnp.asarray(d)[None], jnp.asarray([norm]))
    np.testing.assert_allclose(w, w0 + delta, rtol=1e-5, atol=1e-5)


def test_layer_inputs_match_manual_forward():
    model = models.MLP((5, 4), 3)
    x = jax.random.normal(jax.random.key(0), (7, 6))
    variables = model.init(jax.random.key(1), x)
    out, inputs = jax.jit(
        lambda v, a: continual.layer_inputs(
            model.apply, ("params/dense_0/kernel", "params/dense_1/kernel"), v, a
        )
    )(variables, x)
    p = variables["params"]
    h = jax.nn.relu(x @ p["dense_0"]["kernel"] + p["dense_0"]["bias"])
    np.testing.assert_allclose(inputs["params/dense_0/kernel"], x, rtol=1e-6)
    np.testing.assert_allclose(inputs["params/dense_1/kernel"], h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, model.apply(variables, x), rtol=1e-6)
    with pytest.raises(ValueError, match="never used in a matmul"):
        continual.layer_inputs(model.apply, ("params/nope/kernel",), variables, x)
