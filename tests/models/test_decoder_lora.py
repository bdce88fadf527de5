"""LoRA on the scanned decoder stack: factors stacked on the layer axis, the base never copied.

Identities: a zero-initialised adapter is the base model; the factorised forward equals the
merged model; gradients reach the stacked factors only. Memory: the compiled LoRA training step
needs no more temporary memory than a backward pass through the frozen base plus a fraction of
one copy of the kernels (a merged `W + BA` per step would add at least the whole base).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.adapters.quant import dequantize_base

CONFIG = models.DecoderConfig(
    family="gemma2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_act="gelu_pytorch_tanh",
    norm_offset=1.0,
    sandwich_norms=True,
    embed_scale=True,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=4.0,
    sliding_window=3,
    layer_types=("sliding_attention", "full_attention"),
    tie_word_embeddings=True,
    remat_policy="nothing_saveable",
    dtype="float32",
)
RULES = [(r".*_proj/kernel", adapters.lora(4, alpha=8.0, in_ndim=1, out_ndim=1))]


@pytest.fixture(scope="module")
def setup():
    model = models.DecoderLM(CONFIG)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, 64)
    mask = jnp.ones((2, 7), jnp.bool_).at[0, :2].set(False)
    variables = jax.jit(model.init)(jax.random.key(1), tokens)
    return model, variables, tokens, mask


def test_zero_init_is_base_and_factorised_equals_merged(setup):
    model, variables, tokens, mask = setup
    lora = jax.jit(lambda v: adapters.init(jax.random.key(2), v, RULES))(variables)
    assert sorted(p.split("/")[-2] for p in lora) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert lora["params/model/layers/self_attn/k_proj/kernel"].factors["b"].shape == (2, 4, 16)
    fwd = jax.jit(adapters.adapt(model.apply))
    base = model.apply(variables, tokens, mask)
    np.testing.assert_allclose(fwd(variables, lora, tokens, mask), base, atol=1e-6, rtol=0)
    trained = jax.tree.map(lambda f: f + 0.1, lora)
    merged = model.apply(adapters.fold(variables, trained), tokens, mask)
    np.testing.assert_allclose(fwd(variables, trained, tokens, mask), merged, atol=1e-5, rtol=0)


def test_lora_step_forms_no_copy_of_the_base():
    config = CONFIG.replace(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        head_dim=32,
        layer_types=("sliding_attention", "full_attention") * 2,
        final_logit_softcapping=None,
        remat_policy=None,
    )
    model = models.DecoderLM(config)
    tokens = jnp.zeros((1, 16), jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(0), tokens)
    lora = adapters.init(jax.random.key(1), variables, RULES)
    fwd = adapters.adapt(model.apply)

    def lora_loss(ad, v):
        return jnp.mean(fwd(v, ad, tokens) ** 2)

    def frozen_loss(emb, v):  # a backward pass through every frozen layer, no adapter
        p = v["params"]
        p = {**p, "model": {**p["model"], "embed_tokens": {"embedding": emb}}}
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    def temp_bytes(loss, arg):
        compiled = jax.jit(jax.grad(loss)).lower(arg, variables).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    grads = jax.jit(jax.grad(lora_loss))(lora, variables)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, lora)
    kernels = sum(x.nbytes for p, x in named_leaves(variables).items() if "_proj" in p)
    emb = variables["params"]["model"]["embed_tokens"]["embedding"]
    extra = temp_bytes(lora_loss, lora) - temp_bytes(frozen_loss, emb)
    assert extra < 0.5 * kernels, (extra, kernels)  # measured: ~0.16 (a merged W + BA: > 1)


def test_qlora_nf4_base_on_the_scanned_stack(setup):
    model, variables, tokens, mask = setup
    lora = jax.jit(lambda v: adapters.init(jax.random.key(2), v, RULES))(variables)
    lora = jax.tree.map(lambda f: f + 0.05, lora)
    nf4 = adapters.low_precision_base(
        variables, "nf4", patterns=(r".*_proj/kernel",), block_size=16
    )
    upcast = jax.jit(dequantize_base)(nf4)
    fwd = adapters.adapt(model.apply)

    def loss(ad, base):
        return jnp.mean(jnp.sin(fwd(base, ad, tokens, mask)))

    # The quantised base computes what its float32 dequantisation computes, under scan + remat.
    step = jax.jit(jax.value_and_grad(loss))
    (l1, g1), (l0, g0) = step(lora, nf4), step(lora, upcast)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # 4-bit codes plus one float32 scale per 16 entries.
    quantised = [x for p, x in named_leaves(nf4).items() if "_proj" in p]
    entries = sum(x.qvalue.size for x in quantised)
    assert adapters.quant.base_bytes(quantised) == entries // 2 + 4 * entries // 16


def test_sampler_with_adapters_equals_sampler_on_merged_params(setup):
    model, variables, tokens, mask = setup
    lora = jax.jit(lambda v: adapters.init(jax.random.key(2), v, RULES))(variables)
    lora = jax.tree.map(lambda f: f + 0.1, lora)
    adapted = adapters.adapt(model.apply)

    def forward(state, *args, **kwargs):  # generate's `forward`: (variables, ...) -> ...
        return adapted(state["base"], state["lora"], *args, **kwargs)

    state = {"base": variables, "lora": lora}
    ours = models.generate(model, state, tokens, mask, max_new_tokens=5, forward=forward)
    merged = models.generate(model, adapters.fold(variables, lora), tokens, mask, max_new_tokens=5)
    np.testing.assert_array_equal(ours, merged)


def test_sampler_with_a_bank_and_per_row_ids_equals_each_adapter_alone(setup):
    model, variables, tokens, mask = setup
    rng = np.random.default_rng(0)
    lora = adapters.init(jax.random.key(2), variables, RULES)
    sets = [jax.tree.map(lambda f: jnp.asarray(rng.normal(size=f.shape), f.dtype), lora)] * 2
    sets[1] = {
        p: a.replace(factors={**a.factors, "b": -a.factors["b"]}) for p, a in sets[0].items()
    }
    bank = adapters.stack_adapters(sets)
    adapted = adapters.adapt(model.apply)
    ids = jnp.array([1, 0])

    # The ids closed over by `forward` are concrete inside generate's jit (checked on the host).
    def closed(v, *args, **kwargs):
        return adapted(v, bank, *args, adapter_ids=ids, **kwargs)

    mixed = models.generate(model, variables, tokens, mask, max_new_tokens=5, forward=closed)
    # Each adapter alone, merged, on the whole batch (the program of the test above): row i of
    # the mixed batch is row i of the batch decoded with adapter ids[i].
    alone = [
        models.generate(model, adapters.fold(variables, s), tokens, mask, max_new_tokens=5)
        for s in sets
    ]
    assert not np.array_equal(alone[0], alone[1])  # the adapters decode differently
    for i, j in enumerate(np.asarray(ids)):
        np.testing.assert_array_equal(mixed[i], alone[j][i])

    # Passed inside the variables, the ids are traced: any assignment reuses one compilation, and
    # ids out of [0, 2) are clamped into it (5 -> 1, -3 -> 0), unchecked.
    def traced(state, *args, **kwargs):
        return adapted(state["base"], state["bank"], *args, adapter_ids=state["ids"], **kwargs)

    for row_ids, want in (([0, 1], [alone[0][0], alone[1][1]]), ([5, -3], mixed)):
        state = {"base": variables, "bank": bank, "ids": jnp.array(row_ids)}
        out = models.generate(model, state, tokens, mask, max_new_tokens=5, forward=traced)
        np.testing.assert_array_equal(out, np.stack(want))
    bad = jnp.array([0, 2])
    with pytest.raises(ValueError, match=r"adapter_ids must lie in \[0, 2\)"):
        models.generate(
            model,
            variables,
            tokens,
            mask,
            max_new_tokens=5,
            forward=lambda v, *a, **k: adapted(v, bank, *a, adapter_ids=bad, **k),
        )
