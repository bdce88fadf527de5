"""P3 (c): per-head slicing of a value LoRA, gap ratios, embedding drift and scale transitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from lowrank_jax import adapters, models
from lowrank_jax import analysis as an
from lowrank_jax.analysis.attention_dynamics import head_matrices
from lowrank_jax.analysis.value_lora import (
    correlations,
    embedding_drift,
    embeddings_from_layer,
    head_gap_ratios,
    head_value_deltas,
    head_value_kernel_deltas,
    log_drift_fit,
    scale_transition,
    top_direction_flip,
)
from lowrank_jax.models import bert

D, HEADS = 16, 4


def _lora_delta(key, d=D, rank=3):
    """A trained-looking LoRA update of a (d, d) value kernel, via the adapter core."""
    kernel = jnp.zeros((d, d))
    params = {"attention": {"value": {"kernel": kernel}}}
    ad = adapters.init(key, params, [(r".*value/kernel", adapters.lora(rank=rank, alpha=6.0))])
    ((path, adapter),) = ad.items()
    ka, kb = jax.random.split(jax.random.fold_in(key, 1))
    factors = {
        k: jax.random.normal(kk, v.shape)
        for (k, v), kk in zip(sorted(adapter.factors.items()), (ka, kb), strict=True)
    }
    adapter = adapter.replace(factors=factors)
    f = {k: np.asarray(v, np.float64) for k, v in factors.items()}
    scale = 6.0 / rank
    return adapters.delta(adapter, (d, d)), f, scale


def test_head_slices_reconstruct_the_adapter_product_exactly():
    dw, f, scale = _lora_delta(jax.random.key(0))
    # The adapter product (A B) * scale in float64 (factors `a` (n, r), `b` (r, m)).
    ref = (f["a"] @ f["b"]) * scale
    np.testing.assert_allclose(np.asarray(dw, np.float64), ref, rtol=1e-5, atol=1e-5)
    parts = head_value_kernel_deltas(dw, num_heads=HEADS)
    assert parts.shape == (HEADS, D, D)
    np.testing.assert_array_equal(np.asarray(parts.sum(0)), np.asarray(dw))  # exact: disjoint
    width = D // HEADS
    for h in range(HEADS):
        keep = np.zeros(D, bool)
        keep[h * width : (h + 1) * width] = True
        np.testing.assert_array_equal(np.asarray(parts[h])[:, ~keep], 0.0)
        np.testing.assert_array_equal(np.asarray(parts[h])[:, keep], np.asarray(dw)[:, keep])


def test_head_value_deltas_are_the_ov_circuit_updates():
    k = jax.random.split(jax.random.key(1), 4)
    wq, wk, wv, wo = (jax.random.normal(kk, (D, D)) / 4 for kk in k)
    dw, _, _ = _lora_delta(jax.random.key(2))
    dv = head_value_deltas(dw, wo, num_heads=HEADS)
    for h in range(HEADS):
        _, _, v0 = head_matrices(wq, wk, wv, wo, num_heads=HEADS, head=h)
        _, _, v1 = head_matrices(wq, wk, wv + dw, wo, num_heads=HEADS, head=h)
        np.testing.assert_allclose(np.asarray(dv[h]), np.asarray(v1 - v0), atol=2e-5)
    ref = (np.asarray(dw, np.float64) @ np.asarray(wo, np.float64)).T
    np.testing.assert_allclose(np.asarray(dv.sum(0), np.float64), ref, atol=2e-5)


def test_gap_ratios_and_a_gap_crossing_update():
    wv = jnp.diag(jnp.array([1.0, 0.8, 0.5, 0.1]))  # one head, W_o = I: V = diag, gap 0.2
    wo = jnp.eye(4)
    zero = head_gap_ratios(wv, jnp.zeros((4, 4)), wo, num_heads=1)
    np.testing.assert_allclose(zero.gap, [0.2], atol=1e-6)
    np.testing.assert_array_equal(zero.delta_norm, [0.0])
    np.testing.assert_allclose(zero.top_overlap, [1.0], atol=1e-6)
    cross = head_gap_ratios(wv, jnp.diag(jnp.array([0.0, 0.5, 0, 0])), wo, num_heads=1)
    np.testing.assert_allclose(cross.ratio, [2.5], atol=1e-5)  # 0.5 / 0.2
    np.testing.assert_allclose(cross.top_shift, [0.3], atol=1e-5)  # λ₁: 1 -> 1.3
    np.testing.assert_allclose(cross.top_overlap, [0.0], atol=1e-5)  # e₁ -> e₂
    below = head_gap_ratios(wv, jnp.diag(jnp.array([0.0, 0.1, 0, 0])), wo, num_heads=1)
    np.testing.assert_allclose(below.top_overlap, [1.0], atol=1e-6)
    # The realised flip: λ₂ + s overtakes λ₁ = 1 once s > 0.2 (the Weyl scale here, as dv is
    # along e₂); along a direction orthogonal to both, the top never turns.
    grid = np.geomspace(0.01, 10, 31)
    e2 = jnp.diag(jnp.array([0.0, 1.0, 0, 0]))
    assert top_direction_flip(wv, e2, grid) == grid[grid > 0.2 + 1e-6][0]
    assert top_direction_flip(wv, -e2, grid) == np.inf
    # Several heads: the gap is value_spectrum's of each head's OV circuit.
    k = jax.random.split(jax.random.key(3), 3)
    wv, wo = jax.random.normal(k[0], (D, D)), jax.random.normal(k[1], (D, D))
    dw = 0.1 * jax.random.normal(k[2], (D, D))
    stats = head_gap_ratios(wv, dw, wo, num_heads=HEADS)
    for h in range(HEADS):
        _, _, v = head_matrices(wv, wv, wv, wo, num_heads=HEADS, head=h)
        np.testing.assert_allclose(stats.gap[h], an.value_spectrum(v).gap, rtol=1e-5)
    np.testing.assert_allclose(stats.ratio, stats.delta_norm / stats.gap, rtol=1e-6)


@pytest.fixture(scope="module")
def tiny_bert():
    cfg = models.BertConfig(
        vocab_size=40,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    ids = jax.random.randint(jax.random.key(4), (3, 8), 1, 40)
    mask = jnp.ones((3, 8), jnp.int32).at[0, 6:].set(0)
    variables = models.BertEncoder(cfg).init(jax.random.key(5), ids, mask)
    return cfg, variables, ids, mask


def test_embeddings_from_layer_match_the_full_encoder_and_zero_adapter_gives_zero_drift(tiny_bert):
    cfg, variables, ids, mask = tiny_bert
    params = variables["params"]
    encode = jax.jit(
        lambda p: models.mean_pool(models.BertEncoder(cfg).apply({"params": p}, ids, mask), mask)
    )
    full = encode(params)
    inputs = [x for x, _, _ in bert.attention_inputs(cfg, variables, ids, mask)]
    dw = 0.3 * jax.random.normal(jax.random.key(6), (D, D))
    for layer in (1,):  # the partial path (layer 0 would re-run the whole encoder)
        top = jax.jit(
            lambda x, dv, layer=layer: embeddings_from_layer(
                cfg, params, x, mask, first_layer=layer, value_delta=dv
            )
        )
        part = embeddings_from_layer(cfg, params, inputs[layer], mask, first_layer=layer)
        np.testing.assert_allclose(part, full, atol=1e-5)
        # A zero adapter: zero drift (up to float32 rounding of the cached path).
        drift = embedding_drift(full, top(inputs[layer], jnp.zeros((D, D))))
        assert float(jnp.max(drift.relative)) < 1e-5 and float(jnp.max(drift.cosine)) < 1e-5
        moved = top(inputs[layer], dw)
        merged = jax.tree.map(lambda x: x, params)
        kern = merged["encoder"][f"layer_{layer}"]["attention"]["value"]["kernel"]
        merged["encoder"][f"layer_{layer}"]["attention"]["value"]["kernel"] = kern + dw
        np.testing.assert_allclose(moved, encode(merged), atol=1e-5)
        assert float(jnp.min(embedding_drift(full, moved).relative)) > 1e-3
    same = embedding_drift(full, full)  # identical embeddings: exactly zero drift
    np.testing.assert_array_equal(same.relative, 0.0)
    np.testing.assert_array_equal(same.cosine, 0.0)


def test_embedding_drift_definitions():
    p = jnp.array([[3.0, 4.0], [1.0, 0.0]])
    q = jnp.array([[3.0, 0.0], [0.0, 2.0]])
    d = embedding_drift(p, q)
    np.testing.assert_allclose(d.relative, [4.0 / 5.0, np.sqrt(5.0)], rtol=1e-6)
    np.testing.assert_allclose(d.cosine, [1 - 9.0 / 15.0, 1.0], rtol=1e-6)


def test_scale_transition_tells_a_jump_from_linear_growth():
    ratios = np.array([0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    crossing = 3.0
    s = crossing * ratios
    linear = scale_transition(s, 0.1 * s, crossing=crossing)
    np.testing.assert_allclose(linear.jump, 4.0, rtol=1e-9)
    np.testing.assert_allclose(linear.linear, 4.0, rtol=1e-9)
    np.testing.assert_allclose(linear.slopes, 1.0, rtol=1e-9)
    assert not linear.transition_at_gap
    step = 1e-3 * s + np.where(ratios >= 1.0, 1.0, 0.0)  # saturating jump at s*
    jump = scale_transition(s, step, crossing=crossing)
    assert jump.transition_at_gap and jump.jump > 100
    np.testing.assert_allclose(jump.steepest, np.sqrt(0.5), rtol=1e-9)
    late = scale_transition(s, 1e-3 * s + np.where(ratios >= 8.0, 1.0, 0.0), crossing=crossing)
    assert not late.transition_at_gap  # a jump far above the gap is not the predicted one


def test_correlations_match_scipy():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 2, 20)
    y = x**3 + 0.1 * x  # strictly increasing, not linear
    c = correlations(x, y)
    np.testing.assert_allclose(c["spearman"], 1.0)
    np.testing.assert_allclose(c["pearson"], scipy.stats.pearsonr(x, y)[0], rtol=1e-12)
    assert np.isnan(correlations(x - 1, y)["pearson_log"])


def test_log_drift_fit_recovers_exponents_and_group_offsets():
    rng = np.random.default_rng(1)
    norm, gap = rng.uniform(0.01, 1, 30), rng.uniform(0.01, 1, 30)
    groups = np.repeat([0, 1, 2], 10)
    drift = np.exp(np.array([0.0, 1.0, -2.0])[groups]) * norm**1.5 * gap**-0.7
    fit = log_drift_fit(drift, norm, gap, groups)
    np.testing.assert_allclose([fit["a"], fit["b"], fit["r2"]], [1.5, -0.7, 1.0], atol=1e-9)
    assert fit["r2_without_gap"] < 1.0 - 1e-3
    with pytest.raises(ValueError, match="> 0"):
        log_drift_fit(-drift, norm, gap, groups)


def test_bad_inputs_raise_clear_errors(tiny_bert):
    cfg, variables, ids, mask = tiny_bert
    with pytest.raises(ValueError, match="square"):
        head_value_kernel_deltas(jnp.zeros((4, 3)), num_heads=1)
    with pytest.raises(ValueError, match="divides"):
        head_value_deltas(jnp.zeros((6, 6)), jnp.zeros((6, 6)), num_heads=4)
    with pytest.raises(ValueError, match="out_kernel"):
        head_value_deltas(jnp.zeros((4, 4)), jnp.zeros((5, 5)), num_heads=2)
    with pytest.raises(ValueError, match="delta_value"):
        head_gap_ratios(jnp.zeros((4, 4)), jnp.zeros((2, 2)), jnp.zeros((4, 4)), num_heads=2)
    with pytest.raises(ValueError, match="first_layer"):
        embeddings_from_layer(
            cfg, variables["params"], jnp.zeros((1, 8, D)), mask[:1], first_layer=2
        )
    with pytest.raises(ValueError, match="value_delta"):
        embeddings_from_layer(
            cfg,
            variables["params"],
            jnp.zeros((1, 8, D)),
            mask[:1],
            first_layer=0,
            value_delta=jnp.zeros((3, 3)),
        )
    with pytest.raises(ValueError, match="increasing"):
        top_direction_flip(jnp.eye(3), jnp.eye(3), [1.0, 0.5])
    with pytest.raises(ValueError, match="increase"):
        scale_transition([1.0, 0.5, 2.0], [1.0, 1.0, 1.0], crossing=1.0)
    with pytest.raises(ValueError, match="same shape|one shape"):
        embedding_drift(jnp.zeros((2, 3)), jnp.zeros((3, 3)))
