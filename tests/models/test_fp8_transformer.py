"""The FP8-logit transformer (P14): exact without quantisation, current scaling, geometry readout."""

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import fp8, models
from lowrank_jax.fp8.bounds import norm_gain_bound
from lowrank_jax.models.fp8_transformer import Fp8SelfAttention, fp8_attention_geometry


def test_fp8_attention_exact_without_quantisation_and_close_with_it():
    model = Fp8SelfAttention(num_heads=2)
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    variables = model.init(jax.random.key(1), x, None)
    exact = Fp8SelfAttention(num_heads=2, quantize=False)
    y0, stats0 = exact.apply(variables, x, jnp.ones(2))
    assert float(jnp.max(stats0["softmax_error"])) == 0.0
    y1, stats1 = model.apply(variables, x, None)  # current scaling
    np.testing.assert_allclose(np.asarray(stats1["utilisation"]), 1.0, rtol=1e-5)
    assert int(stats1["overflow"].sum()) == 0
    assert float(jnp.max(stats1["softmax_error"])) < 0.1
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), atol=0.1)
    # a scale far too large saturates and is counted
    _, stats2 = model.apply(variables, x, jnp.full(2, 1e4))
    assert int(stats2["overflow"].sum()) > 0


def test_geometry_readout_feeds_a_policy():
    model = models.Fp8Transformer(
        vocab_size=11, num_layers=2, d_model=16, num_heads=2, mlp_dim=32, max_len=8
    )
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = model.init(jax.random.key(0), tokens, None)["params"]
    wq, wk, gains = fp8_attention_geometry(params, num_layers=2)
    assert wq.shape == wk.shape == (2, 16, 2, 8) and gains.shape == (2,)
    ln = params["block_1_ln_attention"]
    assert float(gains[1]) == float(norm_gain_bound(ln["scale"], ln["bias"]))
    policy = fp8.geometry_scaling_policy(fp8.ScaleRule(seq_len=8))
    scales, _ = policy.scales(policy.init(jax.random.key(1), wq, wk, gains), wq, wk, gains)
    _, stats = model.apply({"params": params}, tokens, scales)
    np.testing.assert_allclose(np.asarray(stats["scale"]), np.asarray(scales), rtol=1e-6)
    # the geometry-aware scale bounds the logits of these (random, near-isotropic) tokens
    assert int(stats["overflow"].sum()) == 0
