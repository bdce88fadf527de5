"""Tests of the cached bottom layers of a split BERT encoder (``bert_prefix.encode_prefix``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrank_jax import models
from lowrank_jax.models.bert import BertTopClassifier, split_encoder
from lowrank_jax.models.bert_prefix import encode_prefix, prefix_encoder

CONFIG = models.BertConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)


@pytest.fixture(scope="module")
def encoder():
    ids = jnp.ones((1, 6), jnp.int32)
    variables = models.BertEncoder(CONFIG).init(jax.random.key(0), ids, jnp.ones_like(ids))
    return variables, np.asarray(jax.random.randint(jax.random.key(1), (7, 6), 1, 50))


def test_chunked_prefix_equals_the_prefix_encoder_at_once_and_feeds_the_top(encoder):
    variables, ids = encoder
    prefix_config, prefix_vars, top = split_encoder(CONFIG, variables, 2)
    whole = models.BertEncoder(prefix_config).apply(prefix_vars, ids, np.ones_like(ids))
    got = encode_prefix(CONFIG, variables, ids, first_layer=2, chunk_size=3)  # 3 + 3 + 1
    assert isinstance(got, np.ndarray) and got.shape == (7, 6, 16)
    np.testing.assert_allclose(got, np.asarray(whole), rtol=0, atol=1e-6)
    jitted = prefix_encoder(prefix_config)(prefix_vars, ids)
    np.testing.assert_allclose(got, np.asarray(jitted), rtol=0, atol=1e-6)
    # The cached states + the top layers are the whole encoder (identity head: pooled features).
    full = models.BertEncoder(CONFIG).apply(variables, ids, np.ones_like(ids))
    pooled = models.mean_pool(full, jnp.ones(ids.shape, jnp.int32))
    eye = {"kernel": jnp.eye(16), "bias": jnp.zeros(16)}
    top_out = BertTopClassifier(CONFIG, 2, 16).apply({"params": {**top, "head": eye}}, got)
    np.testing.assert_allclose(np.asarray(top_out), np.asarray(pooled), rtol=0, atol=1e-5)


def test_bad_input_raises(encoder):
    variables, ids = encoder
    with pytest.raises(ValueError, match="input_ids must be"):
        encode_prefix(CONFIG, variables, ids[0], first_layer=1)
    with pytest.raises(ValueError, match="input_ids must be"):
        encode_prefix(CONFIG, variables, ids.astype(np.float32), first_layer=1)
    with pytest.raises(ValueError, match="chunk_size"):
        encode_prefix(CONFIG, variables, ids, first_layer=1, chunk_size=0)
    with pytest.raises(ValueError, match="first_layer"):
        encode_prefix(CONFIG, variables, ids, first_layer=3)
