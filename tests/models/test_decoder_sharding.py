"""Partition rules of the decoder: specs per parameter, factors like their kernels, and a sharded
LoRA step on 8 fake devices that equals the one-device step."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves

CONFIG = models.DecoderConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=6,
    qkv_bias=True,
    dtype="float32",
)


def _shapes(config):
    return jax.eval_shape(models.DecoderLM(config).init, jax.random.key(0), jnp.zeros((1, 4), int))


def test_specs_follow_the_layout_and_drop_axes_that_do_not_divide():
    variables = _shapes(CONFIG)
    specs = models.decoder_partition_specs(variables, mesh=AbstractMesh((2, 4), ("fsdp", "tp")))
    flat = named_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    layer = "params/model/layers/"
    assert flat["params/model/embed_tokens/embedding"] == P("tp", "fsdp")
    assert flat[layer + "self_attn/q_proj/kernel"] == P(None, "fsdp", "tp")  # (2, 32, 24)
    assert flat[layer + "self_attn/k_proj/kernel"] == P(None, "fsdp")  # (2, 32, 6): 6 % 4 != 0
    assert flat[layer + "self_attn/q_proj/bias"] == P(None, "tp")
    assert flat[layer + "self_attn/o_proj/kernel"] == P(None, "tp", "fsdp")  # row-parallel
    assert flat[layer + "mlp/down_proj/kernel"] == P(None, "tp", "fsdp")
    assert flat[layer + "mlp/up_proj/kernel"] == P(None, "fsdp", "tp")
    assert flat["params/lm_head/kernel"] == P("fsdp", "tp")
    assert flat[layer + "input_layernorm/scale"] == P()
    assert flat["params/model/norm/scale"] == P()
    # Without a mesh the rules apply as written; with tp=None only FSDP remains.
    loose = named_leaves(models.decoder_partition_specs(variables), is_leaf=lambda s: isinstance(s, P))  # fmt: skip
    assert loose[layer + "self_attn/k_proj/kernel"] == P(None, "fsdp", "tp")
    fsdp_only = named_leaves(models.decoder_partition_specs(variables, tp=None), is_leaf=lambda s: isinstance(s, P))  # fmt: skip
    assert fsdp_only[layer + "mlp/down_proj/kernel"] == P(None, None, "fsdp")
    with pytest.raises(ValueError, match="tp=..."):
        models.decoder_partition_specs(variables, mesh=AbstractMesh((8,), ("data",)))


def test_lora_factors_are_split_like_their_kernel():
    variables = _shapes(CONFIG)
    rules = [(r".*_proj/kernel", adapters.lora(4, in_ndim=1, out_ndim=1))]
    lora = jax.eval_shape(lambda v: adapters.init(jax.random.key(0), v, rules), variables)
    specs = models.decoder_partition_specs(variables, mesh=AbstractMesh((2, 4), ("fsdp", "tp")))
    factors = adapters.partition_specs(lora, specs)
    layer = "params/model/layers/"
    q, o = factors[layer + "self_attn/q_proj/kernel"], factors[layer + "mlp/down_proj/kernel"]
    assert q.factors == {"a": P(None, "fsdp", None), "b": P(None, None, "tp")}
    assert o.factors == {"a": P(None, "tp", None), "b": P(None, None, "fsdp")}


def test_sharded_lora_step_on_eight_devices_equals_one_device():
    out = subprocess.run(
        [sys.executable, "-m", "tests.models.decoder_sharded_step"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["devices"] == 8
    assert (got["q_kernel"], got["q_a"], got["q_b"]) == (
        str(P(None, "fsdp", "tp")), str(P(None, "fsdp", None)), str(P(None, None, "tp"))
    )  # fmt: skip
    assert (got["o_a"], got["o_b"]) == (str(P(None, "tp", None)), str(P(None, None, "fsdp")))
    np.testing.assert_allclose(got["eight"]["losses"], got["one"]["losses"], rtol=0, atol=1e-5)
    assert got["one"]["losses"][-1] < got["one"]["losses"][0]
    for path, one in got["one"]["lora"].items():
        np.testing.assert_allclose(got["eight"]["lora"][path], one, rtol=0, atol=1e-5, err_msg=path)
