"""FP8 attention logits of DecoderLM (P14, `lowrank_jax.models.decoder_fp8`): nothing changes
without scales, overflow counts are sown per layer and head, the RoPE-safe bound holds on every
logit (bias, QK-norm, GQA), equals P14's worst case with `σ̄ = ‖W_Q,h‖‖W_K,g‖` for Llama, and
RoPE's rotation does change `σ_max(W_Q R W_Kᵀ)` (why σ̄ and not σ_max is used)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import fp8, models
from lowrank_jax.models import decoder_fp8
from lowrank_jax.models.decoder import _apply_rope, _rope_tables
from lowrank_jax.models.decoder_config import rope_frequencies
from tests.models.test_decoder import GEMMA, LLAMA, _init

GQA = dataclasses.replace(LLAMA, num_key_value_heads=2)
QWEN = dataclasses.replace(GQA, qkv_bias=True)
R = fp8.fp8_max("e4m3")


def _tokens(config, b=2, t=12, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, config.vocab_size)


def _fp8_apply(config, variables, tokens, scales, **kw):
    model = models.DecoderLM(config)
    return model.apply(variables, tokens, fp8_scales=scales, mutable=["intermediates"], **kw)


def _enlarged(variables, factor):
    """The q/k kernels (and biases) times `factor`: logits large enough to overflow."""

    def grow(path, x):
        name = jax.tree_util.keystr(path)
        return x * factor if ("q_proj" in name or "k_proj" in name) else x

    return jax.tree_util.tree_map_with_path(grow, variables)


@pytest.mark.parametrize("config", [LLAMA, GEMMA, QWEN], ids=["llama", "gemma3", "qwen"])
def test_without_scales_nothing_is_sown_and_the_logits_do_not_change(config):
    v, tokens = _init(config), _tokens(config)
    model = models.DecoderLM(config)
    plain = jax.jit(model.apply)(v, tokens)
    again, state = jax.jit(lambda v, t: model.apply(v, t, mutable=["intermediates"]))(v, tokens)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(again))
    assert not state.get("intermediates")
    scales = decoder_fp8.decoder_attention_scales(config, v)
    quantised, _ = _fp8_apply(config, v, tokens, scales)
    assert not np.array_equal(np.asarray(quantised), np.asarray(plain))  # E4M3 rounds
    np.testing.assert_allclose(np.asarray(quantised), np.asarray(plain), atol=0.1)


@pytest.mark.parametrize("config", [LLAMA, GEMMA, QWEN], ids=["llama", "gemma3", "qwen"])
def test_the_bound_holds_on_every_attended_logit_and_its_scale_never_overflows(config):
    v = _enlarged(_init(config), 30.0)
    tokens = _tokens(config, b=3, t=24)
    bound = decoder_fp8.decoder_logit_bound(config, v)
    _, state = _fp8_apply(config, v, tokens, decoder_fp8.decoder_attention_scales(config, v))
    amax = decoder_fp8.logit_amax(state)
    assert amax.shape == bound.shape == (config.num_hidden_layers, config.num_attention_heads)
    assert np.all(np.asarray(amax) <= np.asarray(bound)), (amax, bound)
    np.testing.assert_array_equal(decoder_fp8.overflow_counts(state), 0)
    # half the range each head's logits need: every head overflows; twice: none
    for factor, overflows in ((2.0, True), (0.5, False)):
        _, state = _fp8_apply(config, v, tokens, factor * R / amax)
        counts = np.asarray(decoder_fp8.overflow_counts(state))
        assert np.all(counts > 0) if overflows else np.all(counts == 0), counts


def test_llama_bound_is_p14_worst_case_with_the_rotation_safe_sigma():
    v = _init(GQA)
    layers = v["params"]["model"]["layers"]
    d, h, g, dh = 32, 4, 2, 8
    wq = np.asarray(layers["self_attn"]["q_proj"]["kernel"]).reshape(2, d, h, dh)
    wk = np.asarray(layers["self_attn"]["k_proj"]["kernel"]).reshape(2, d, g, dh)
    norm = lambda w: np.linalg.norm(np.moveaxis(w, -2, 1), ord=2, axis=(-2, -1))  # noqa: E731
    sigma_bar = norm(wq) * np.repeat(norm(wk), h // g, axis=-1)  # (L, H)
    gain = np.abs(np.asarray(layers["input_layernorm"]["scale"])).max(axis=-1)[:, None]
    bound = decoder_fp8.decoder_logit_bound(GQA, v)
    expected = fp8.worst_case_logit_bound(sigma_bar, d=d, head_dim=dh, norm_gain=gain)
    np.testing.assert_allclose(bound, expected, rtol=1e-5)
    rule = fp8.ScaleRule(seq_len=16)
    scales = decoder_fp8.decoder_attention_scales(GQA, v, rule)
    want = rule.scales(sigma_bar, d=d, head_dim=dh, norm_gain=gain)
    np.testing.assert_allclose(scales, want, rtol=1e-5)
    assert np.all(np.asarray(scales) > R / np.asarray(bound))  # α < 1: a finer scale
    with pytest.raises(ValueError, match="e4m3"):
        decoder_fp8.decoder_attention_scales(GQA, v, fp8.ScaleRule(seq_len=16, fmt="e5m2"))


def test_rope_changes_sigma_max_of_the_product_but_not_the_product_of_norms():
    """`σ_max(W_Q R Wᵀ_K)` over the relative rotations R of RoPE exceeds `σ_max(W_Q Wᵀ_K)`
    (it is not rotation invariant) and stays below `‖W_Q‖‖W_K‖`."""
    d, dh = 32, 8
    a, b = jax.random.normal(jax.random.key(0), (2, d, dh))
    b = b + 0.5 * a  # aligned heads, as training makes them: the rotation can misalign them
    positions = jnp.arange(64)[None]
    cos, sin = _rope_tables(positions, rope_frequencies(LLAMA.rope, dh), jnp.float32)
    eye = jnp.broadcast_to(jnp.eye(dh)[None, :, None, :], (64, dh, 1, dh))
    rot = _apply_rope(eye, cos[0][:, None], sin[0][:, None])[:, :, 0]  # (p, d_h, d_h)
    sigma = [float(fp8.attention_sigma_max(a[:, None], (b @ r)[:, None])[0]) for r in rot]
    bar = float(np.linalg.norm(a, 2) * np.linalg.norm(b, 2))
    assert sigma[0] == pytest.approx(float(fp8.attention_sigma_max(a[:, None], b[:, None])[0]))
    assert max(sigma) > 1.01 * sigma[0] or min(sigma) < 0.99 * sigma[0], sigma
    assert max(sigma) <= bar * (1 + 1e-5)


def test_unscanned_layers_sow_the_same_counts_and_bad_shapes_raise():
    v, tokens = _enlarged(_init(LLAMA), 30.0), _tokens(LLAMA)
    scales = 4 * decoder_fp8.decoder_attention_scales(LLAMA, v)
    logits, state = _fp8_apply(LLAMA, v, tokens, scales)
    unscanned = dataclasses.replace(LLAMA, scan_layers=False)
    params = dict(v["params"]["model"])
    stack = params.pop("layers")
    for i in range(LLAMA.num_hidden_layers):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stack)
    u = {"params": {**v["params"], "model": params}}
    logits_u, state_u = _fp8_apply(unscanned, u, tokens, scales)
    np.testing.assert_allclose(logits_u, logits, atol=1e-5)
    np.testing.assert_array_equal(
        decoder_fp8.overflow_counts(state_u), decoder_fp8.overflow_counts(state)
    )
    bound_u = decoder_fp8.decoder_logit_bound(unscanned, u)
    np.testing.assert_allclose(bound_u, decoder_fp8.decoder_logit_bound(LLAMA, v), rtol=1e-6)
    with pytest.raises(ValueError, match=r"fp8_scales must be \(layers, heads\)"):
        _fp8_apply(LLAMA, v, tokens, scales[0])
    with pytest.raises(ValueError, match="no FP8 statistics"):
        decoder_fp8.overflow_counts({"intermediates": {}})
