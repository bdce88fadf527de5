"""DecoderLM identities that need no PyTorch: KV cache == full forward, remat == no remat,
bf16 ~ f32, sampler invariants, config errors, names, sharded loading, lowering for GPU/TPU."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import models
from lowrank_jax.models.decoder import init_cache
from lowrank_jax.models.decoder_config import RopeConfig
from lowrank_jax.models.hf_decoder_config import config_from_hf, config_to_hf

# One tiny Gemma-3-like config with every switch on (sliding and full layers, local RoPE base,
# q/k norms, sandwich norms, soft-caps, tied embeddings) and a Llama-like one.
GEMMA = models.DecoderConfig(
    family="gemma3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_act="gelu_pytorch_tanh",
    norm_offset=1.0,
    rope=RopeConfig(theta=1e6, rope_type="linear", factor=2.0),
    local_rope=RopeConfig(theta=1e4),
    qk_norm=True,
    sandwich_norms=True,
    embed_scale=True,
    query_pre_attn_scalar=12.0,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=4.0,
    sliding_window=3,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    tie_word_embeddings=True,
    dtype="float32",
)
LLAMA = models.DecoderConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    rope=RopeConfig(theta=5e5, rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8),
    dtype="float32",
)  # fmt: skip


def _init(config, seed=0):
    @jax.jit
    def init(key):
        variables = models.DecoderLM(config).init(key, jnp.zeros((1, 4), jnp.int32))
        # Random norm scales too, so that (offset + w) is exercised.
        leaves, treedef = jax.tree.flatten(variables)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(leaves))
        noisy = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(treedef, noisy)

    return init(jax.random.key(seed))


@pytest.fixture(scope="module")
def gemma_vars():
    return _init(GEMMA)


@pytest.fixture(scope="module")
def llama_vars():
    return _init(LLAMA)


def _batch():
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 1, 96)
    mask = jnp.ones((2, 9), jnp.bool_).at[1, :3].set(False)  # row 1 left-padded
    return jnp.where(mask, tokens, 0), mask


def test_cache_prefill_and_decode_equal_full_forward(gemma_vars):
    apply, variables = jax.jit(models.DecoderLM(GEMMA).apply), gemma_vars
    tokens, mask = _batch()
    full = apply(variables, tokens, mask)
    cache = init_cache(GEMMA, 2, 12)
    logits, cache = apply(variables, tokens[:, :5], mask[:, :5], cache=cache)
    steps = [logits]
    for i in range(5, 9):
        logits, cache = apply(variables, tokens[:, i : i + 1], mask[:, i : i + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1)[mask], full[mask], atol=1e-5, rtol=0)
    assert int(cache.index) == 9 and cache.k.shape == (3, 2, 12, 2, 8)


@pytest.mark.parametrize("config", ["gemma", "llama"])
def test_packed_segments_give_the_logits_of_each_sequence_alone(config, request):
    """Two sequences and padding in one row: each segment's logits are its own forward's."""
    config, variables = (GEMMA, LLAMA)[config == "llama"], request.getfixturevalue(f"{config}_vars")
    apply = jax.jit(models.DecoderLM(config).apply)
    tokens = jax.random.randint(jax.random.key(5), (1, 12), 1, 96)
    segments = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    packed = apply(variables, jnp.where(segments > 0, tokens, 0), segment_ids=segments)
    for lo, hi in ((0, 5), (5, 10)):
        alone = apply(variables, tokens[:, lo:hi])
        np.testing.assert_allclose(packed[:, lo:hi], alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="segment_ids .* shape"):
        apply(variables, tokens, segment_ids=segments[:, :5])


def test_remat_policy_changes_nothing(llama_vars):
    tokens, mask = _batch()
    variables = llama_vars

    def loss(params, config):
        return jnp.mean(models.DecoderLM(config).apply(params, tokens, mask) ** 2)

    step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    plain = step(variables, LLAMA)
    remat = step(variables, LLAMA.replace(remat_policy="nothing_saveable"))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_bfloat16_compute_close_to_float32(gemma_vars):
    tokens, mask = _batch()
    variables = gemma_vars
    f32 = models.DecoderLM(GEMMA).apply(variables, tokens, mask)
    bf16 = models.DecoderLM(GEMMA.replace(dtype="bfloat16")).apply(variables, tokens, mask)
    assert bf16.dtype == jnp.float32  # logits are returned in float32
    err = jnp.max(jnp.abs(bf16 - f32)[mask]) / jnp.max(jnp.abs(f32))
    assert err < 5e-2


def test_sampler_temperature_and_eos(llama_vars):
    model, variables = models.DecoderLM(LLAMA), llama_vars
    prompt, mask = _batch()
    greedy = models.generate(model, variables, prompt, mask, max_new_tokens=6)
    assert greedy.shape == (2, 6) and greedy.dtype == jnp.int32
    # A vanishing temperature samples the argmax.
    cold = models.generate(
        model, variables, prompt, mask, max_new_tokens=6, temperature=1e-6, key=jax.random.key(0)
    )
    np.testing.assert_array_equal(cold, greedy)
    hot = [
        models.generate(
            model, variables, prompt, mask, max_new_tokens=6, temperature=5.0, key=jax.random.key(k)
        )
        for k in (1, 1, 2)
    ]
    np.testing.assert_array_equal(hot[0], hot[1])
    assert not np.array_equal(hot[0], hot[2])
    # With the first greedy token of row 0 as end of sequence, row 0 continues with padding.
    eos = int(greedy[0, 0])
    out = models.generate(
        model, variables, prompt, mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=95
    )
    assert int(out[0, 0]) == eos and np.all(np.asarray(out[0, 1:]) == 95)
    with pytest.raises(ValueError, match="PRNG key"):
        models.generate(model, variables, prompt, max_new_tokens=2, temperature=1.0)


def test_sampler_refuses_a_prompt_that_is_not_left_padded(llama_vars):
    model, variables = models.DecoderLM(LLAMA), llama_vars
    prompt, mask = _batch()
    right = jnp.ones_like(mask).at[1, -3:].set(False)  # row 1 right-padded
    gap = jnp.ones_like(mask).at[0, 4].set(False)  # a hole inside row 0
    empty = mask.at[1].set(False)  # row 1 has no token
    for bad, row in ((right, 1), (gap, 0), (empty, 1)):
        with pytest.raises(
            ValueError, match=rf"not left-padded in rows \[{row}\].*pad prompts on the left"
        ):
            models.generate(model, variables, prompt, bad, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt_mask has shape"):
        models.generate(model, variables, prompt, mask[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match="no columns"):
        models.generate(model, variables, prompt[:, :0], max_new_tokens=2)


def test_config_validation():
    with pytest.raises(ValueError, match="must divide"):
        LLAMA.replace(num_key_value_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        LLAMA.replace(layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="remat_policy"):
        LLAMA.replace(remat_policy="full")
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rope_type="yarn")


def test_config_from_hf_round_trip_and_errors():
    for config in (GEMMA, LLAMA):
        back = config_from_hf(config_to_hf(config), dtype="float32")
        assert back == config.replace(
            max_position_embeddings=back.max_position_embeddings,
            sliding_window=back.sliding_window,
            local_rope=back.local_rope,
            layer_types=back.layer_types,
            head_dim=config.dims_per_head,
        )
        assert back.types == config.types
    hf = config_to_hf(LLAMA)
    with pytest.raises(ValueError, match="model_type='mistral'"):
        config_from_hf({**hf, "model_type": "mistral"})
    with pytest.raises(ValueError, match="does not know.*'moe_experts'"):
        config_from_hf({**hf, "moe_experts": 8})
    config_from_hf({**hf, "moe_experts": 8}, ignore_keys=("moe_experts",))
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="has no.*attn_logit_softcapping"):
        config_from_hf({**hf, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="attention_dropout"):
        config_from_hf({**hf, "attention_dropout": 0.1})
    with pytest.raises(ValueError, match="cannot express"):
        config_to_hf(LLAMA.replace(qk_norm=True))


def test_module_names():
    path = "params/model/layers/self_attn/q_proj/kernel"
    assert models.decoder_module_name(path, 3) == "model.layers.3.self_attn.q_proj"
    assert models.decoder_path_from_module("base_model.model.model.layers.3.self_attn.q_proj") == (
        path,
        3,
    )
    assert models.decoder_module_name("params/lm_head/kernel") == "lm_head"
    assert models.decoder_path_from_module("lm_head") == ("params/lm_head/kernel", None)
    with pytest.raises(ValueError, match="layer index"):
        models.decoder_module_name(path)


def test_reader_refuses_foreign_tensors(tmp_path, llama_vars):
    from safetensors.numpy import load_file, save_file

    variables = llama_vars
    models.save_hf_decoder(tmp_path, LLAMA, variables)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file(
        {**tensors, "model.extra.weight": np.zeros(3, np.float32)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ValueError, match="model.extra.weight"):
        models.load_hf_decoder(tmp_path, config=LLAMA)
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        models.load_hf_decoder(tmp_path, config=LLAMA)


def test_reader_names_a_truncated_file_and_what_to_do(tmp_path, llama_vars):
    for sub, shard in (("single", "5GB"), ("sharded", 20_000)):
        directory = tmp_path / sub
        files = models.save_hf_decoder(directory, LLAMA, llama_vars, max_shard_size=shard)
        file = sorted(f for f in files if f.endswith(".safetensors"))[-1]
        with open(file, "r+b") as f:  # an interrupted download: the tail is missing
            f.truncate(os.path.getsize(file) // 2)
        with pytest.raises(ValueError, match=rf"{re.escape(file)} is not a readable .*again"):
            models.load_hf_decoder(directory, config=LLAMA)
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match=rf"{re.escape(str(index))} is not valid JSON"):
        models.load_hf_decoder(tmp_path / "sharded", config=LLAMA)


def test_the_default_bfloat16_compute_is_said_where_a_user_reads(tmp_path, llama_vars):
    models.save_hf_decoder(tmp_path, LLAMA, llama_vars)
    config, _ = models.load_hf_decoder(tmp_path)
    assert (config.dtype, config.param_dtype) == ("bfloat16", "float32")
    assert models.config_from_hf(tmp_path, dtype="float32").dtype == "float32"
    assert "bfloat16" in models.load_hf_decoder.__doc__.splitlines()[0]
    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "decoder.md"
    text = " ".join(guide.read_text().split())
    assert "computes in **bfloat16**" in text
    assert 'config=models.config_from_hf(checkpoint, dtype="float32")' in text


_SHARDED_LOAD = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from lowrank_jax import models
    from lowrank_jax.models.hf_decoder_config import config_from_hf
    directory = sys.argv[1]
    config = config_from_hf(directory, dtype="float32")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    def sharding(path):
        if path.endswith("kernel") and "/layers/" in path:  # (L, n, m): n over fsdp, m over tp
            return NamedSharding(mesh, P(None, "fsdp", "tp"))
        return NamedSharding(mesh, P())
    _, variables = models.load_hf_decoder(directory, config=config, shardings=sharding)
    q = variables["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    shard = q.addressable_shards[0].data.shape
    flat = {"/".join(str(k.key) for k in p): np.asarray(x).tolist()
            for p, x in jax.tree_util.tree_flatten_with_path(variables)[0]}
    print(json.dumps({"spec": str(q.sharding.spec), "shard": shard, "devices": len(jax.devices()),
                      "params": flat}))
    """
)


def test_sharded_load_on_eight_devices(tmp_path, llama_vars):
    variables = llama_vars
    models.save_hf_decoder(tmp_path, LLAMA, variables, max_shard_size=20_000)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED_LOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=env,
        cwd=os.getcwd(),
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["devices"] == 8 and got["spec"] == str(
        jax.sharding.PartitionSpec(None, "fsdp", "tp")
    )
    assert got["shard"] == [2, 8, 16]  # (L, 32/4, 32/2)
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        path = "/".join(str(k.key) for k in keypath)
        np.testing.assert_array_equal(np.asarray(got["params"][path], np.float32), leaf)


def test_forward_lowers_for_gpu_and_tpu():
    tokens, mask = _batch()
    config = GEMMA.replace(dtype="bfloat16", remat_policy="dots_with_no_batch_dims_saveable")
    variables = jax.eval_shape(models.DecoderLM(config).init, jax.random.key(0), tokens)
    exported = jax.export.export(
        jax.jit(models.DecoderLM(config).apply), platforms=("cuda", "tpu")
    )(variables, tokens, mask)
    assert exported.platforms == ("cuda", "tpu")


def test_bfloat16_checkpoint_reads_into_float32_params(tmp_path, llama_vars):
    models.save_hf_decoder(tmp_path, LLAMA, llama_vars, dtype="bfloat16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    _, back = models.load_hf_decoder(tmp_path, config=LLAMA)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(llama_vars), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16).astype(jnp.float32))
