"""DecoderLM against PyTorch `transformers` on random tiny Llama / Qwen2 / Gemma-2 / Gemma-3 models.

For each family a random model is built from a config (no download), every parameter redrawn
(so that norm weights, biases and soft-caps matter), saved with `save_pretrained`, and read with
`load_hf_decoder`. Checked in float32: logits on a batch with left and right padding (<= 1e-4),
32 greedy tokens equal to `generate(do_sample=False)` token for token, and our writer read back by
`from_pretrained` (sharded) giving the same logits.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import adapters, models
from lowrank_jax.models.hf_decoder_config import config_from_hf

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-4
_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)
_WINDOWED = dict(
    head_dim=16,
    sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def _hf_config(family: str):
    if family == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
        return transformers.LlamaConfig(**_COMMON, rope_parameters=rope)
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False)
    if family == "gemma2":
        return transformers.Gemma2Config(
            **_COMMON,
            **_WINDOWED,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
        )
    return transformers.Gemma3TextConfig(
        **_COMMON,
        **_WINDOWED,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def _batch():
    """Tokens (3, 12) and a mask with a full row, a left-padded row and a right-padded row."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, _COMMON["vocab_size"], size=(3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0
    mask[2, 9:] = 0
    tokens = np.where(mask == 1, tokens, 0)
    return tokens, mask


def _positions(mask):
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def _lora_rules(rslora: bool):
    """All seven projections; attention and MLP with different ranks and alphas (patterns)."""
    kw = dict(in_ndim=1, out_ndim=1, rslora=rslora)  # kernels (L, n, m): one matrix per layer
    return [
        (r".*self_attn/(q|k|v|o)_proj/kernel", adapters.lora(4, alpha=8.0, **kw)),
        (r".*mlp/(gate|up|down)_proj/kernel", adapters.lora(2, alpha=3.0, **kw)),
    ]


def _hf_logits(hf, tokens, mask):
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(_positions(mask)),
        )
    return out.logits.numpy()


@pytest.fixture(scope="module", params=list(_CLASSES))
def family(request, tmp_path_factory):
    """(name, HF model, its directory, our config, our variables) for one family."""
    name = request.param
    torch.manual_seed(0)
    cls = getattr(transformers, _CLASSES[name])
    hf = cls._from_config(_hf_config(name), attn_implementation="eager").eval()
    # Every parameter random (norms, biases and Gemma's 1 + w all matter); small embeddings and
    # large layer weights, so greedy samples vary rather than repeat the last token.
    with torch.no_grad():
        for key, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if "embed_tokens" in key else 0.3))
    directory = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory)
    config = config_from_hf(directory, dtype="float32")
    config, variables = models.load_hf_decoder(directory, config=config)
    return name, hf, directory, config, variables


def test_config_switches(family):
    name, _, _, config, variables = family
    assert config.family == name
    params = variables["params"]
    q = params["model"]["layers"]["self_attn"]["q_proj"]
    assert q["kernel"].shape == (3, 64, 4 * config.dims_per_head)
    assert ("bias" in q) == (name == "qwen2")
    assert ("lm_head" in params) == (not config.tie_word_embeddings)
    assert config.qk_norm == (name == "gemma3")
    if name == "llama":
        assert config.rope.rope_type == "llama3" and config.rope.factor == 8.0
    if name == "gemma3":
        assert config.rope.rope_type == "linear" and config.local_rope.theta == 1e4
        assert config.types == ("sliding_attention", "full_attention", "sliding_attention")


def test_padded_logits_match_transformers(family):
    _, hf, _, config, variables = family
    tokens, mask = _batch()
    ours = jax.jit(models.DecoderLM(config).apply)(variables, jnp.asarray(tokens), mask)
    theirs = _hf_logits(hf, tokens, mask)
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(ours)[valid], theirs[valid], atol=TOL, rtol=0)
    # A left-padded row equals the same tokens without padding (mask and positions handled).
    alone = models.DecoderLM(config).apply(variables, jnp.asarray(tokens[1:2, 4:]))
    np.testing.assert_allclose(np.asarray(ours)[1, 4:], np.asarray(alone)[0], atol=TOL, rtol=0)


def test_greedy_tokens_match_generate(family):
    _, hf, _, config, variables = family
    tokens, mask = _batch()
    prompt, prompt_mask = tokens[:2, :10], mask[:2, :10]  # a full row and a left-padded one
    with torch.no_grad():
        hf_out = hf.generate(
            input_ids=torch.tensor(prompt),
            attention_mask=torch.tensor(prompt_mask),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
    theirs = hf_out[:, prompt.shape[1] :].numpy()
    # HF stops when every row has ended (eos, then pad_token_id): pad to 32 columns.
    theirs = np.pad(theirs, ((0, 0), (0, 32 - theirs.shape[1])), constant_values=0)
    ours = models.generate(
        models.DecoderLM(config),
        variables,
        jnp.asarray(prompt),
        jnp.asarray(prompt_mask),
        max_new_tokens=32,
        eos_token_id=config.eos_token_id,
        pad_token_id=0,
    )
    np.testing.assert_array_equal(np.asarray(ours), theirs)
    assert len(set(theirs[0].tolist())) > 3  # the samples are not one repeated token


def test_writer_round_trips_through_from_pretrained(family, tmp_path):
    name, hf, _, config, variables = family
    files = models.save_hf_decoder(tmp_path, config, variables, max_shard_size=60_000)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") and len(files) > 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "model.layers.2.self_attn.q_proj.weight" in index["weight_map"]
    cls = getattr(transformers, _CLASSES[name])
    back = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens, mask = _batch()
    valid = mask.astype(bool)
    np.testing.assert_allclose(
        _hf_logits(back, tokens, mask)[valid], _hf_logits(hf, tokens, mask)[valid], atol=TOL, rtol=0
    )
    # Our reader of our sharded files gives the same variables.
    _, again = models.load_hf_decoder(tmp_path, config=config)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stacked_lora_loads_in_pytorch_peft_and_back(family, tmp_path):
    peft = pytest.importorskip("peft")
    name, _, directory, config, variables = family
    rslora = name in ("llama", "gemma3")
    lora = adapters.init(jax.random.key(1), variables, _lora_rules(rslora))
    assert lora["params/model/layers/mlp/down_proj/kernel"].factors["a"].shape == (3, 96, 2)
    lora = jax.tree.map(  # non-zero B, as after training
        lambda f: f + 0.2 * jax.random.normal(jax.random.key(2), f.shape), lora
    )
    adapters.save_peft(tmp_path / "ours", lora, module_name=models.decoder_module_name)
    saved = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert len(saved["target_modules"]) == 7 * 3 and saved["use_rslora"] == rslora
    assert saved["rank_pattern"]["model.layers.1.mlp.up_proj"] == 2

    tokens, mask = _batch()
    ours = jax.jit(adapters.adapt(models.DecoderLM(config).apply))(
        variables, lora, jnp.asarray(tokens), mask
    )
    base = getattr(transformers, _CLASSES[name]).from_pretrained(
        directory, attn_implementation="eager"
    )
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    valid = mask.astype(bool)
    theirs = _hf_logits(peft_model, tokens, mask)
    np.testing.assert_allclose(np.asarray(ours)[valid], theirs[valid], atol=TOL, rtol=0)
    with peft_model.disable_adapter():  # the adapter changes the logits
        assert np.abs(theirs - _hf_logits(peft_model, tokens, mask))[valid].max() > 1e-2

    # And back: PEFT's own files load into the same stacked adapters.
    peft_model.save_pretrained(tmp_path / "theirs")
    back = adapters.load_peft(
        tmp_path / "theirs", variables, module_path=models.decoder_path_from_module
    )
    assert sorted(back) == sorted(lora)
    for path, adapter in lora.items():
        assert back[path].kind.scale == adapter.kind.scale
        for k in ("a", "b"):
            np.testing.assert_array_equal(back[path].factors[k], adapter.factors[k])
