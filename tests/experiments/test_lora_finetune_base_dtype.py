"""``model.base_dtype`` of the MiniLM fine-tuning experiment: a bfloat16 / int8 frozen base."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs import lora_finetune as lora_config
from experiments import common, lora_finetune
from lowrank_jax.adapters.paths import named_leaves
from lowrank_jax.adapters.quant import dequantize


@pytest.fixture(scope="module")
def minilm():
    config = lora_config.get_config("smoke")
    return lora_finetune._build_model(config, 3, jax.random.key(0))


def test_int8_base_is_quantised_and_starts_near_the_pretrained_model(minilm):
    """``model.base_dtype=int8``: frozen kernels are int8 QArrays, the rest (and the adapters and
    optimizer state) float32; logits within int8 rounding of the float32 model's."""
    model, variables = minilm
    config = lora_config.get_config("smoke")
    config.model.base_dtype = "int8"
    lora_finetune.check_config(config)
    state, frozen, logits_fn, _ = lora_finetune.init_state(
        config, model, variables, jax.random.key(1)
    )
    kernels = {p: v for p, v in named_leaves(frozen).items() if p.endswith("kernel")}
    assert kernels and all(dequantize(v) is not v for v in kernels.values())
    assert {str(v.dtype) for v in jax.tree.leaves((state["adapters"], state["opt_state"]))} <= {
        "float32",
        "int32",
    }
    from lowrank_jax import models

    _, _, tokenizer = models.load_minilm()
    batch = models.tokenize(tokenizer, ["Now is the winter of our discontent"], max_len=16)
    ours = jax.jit(lambda s, f, b: logits_fn(s, f, b, train=False, key=None))(state, frozen, batch)
    base = model.apply(variables, batch["input_ids"], batch["attention_mask"])
    assert ours.dtype == base.dtype
    np.testing.assert_allclose(ours, base, atol=0.05)


@pytest.mark.parametrize("arg, base_dtype", [("smoke", "int4"), ("smoke,method=full", "int8")])
def test_bad_base_dtype_is_rejected(arg, base_dtype):
    config = lora_config.get_config(arg)
    config.model.base_dtype = base_dtype
    with pytest.raises(common.ConfigError, match="base_dtype"):
        lora_finetune.check_config(config)
