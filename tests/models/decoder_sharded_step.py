# ruff: noqa: E402
"""LoRA training steps on the decoder, sharded on 8 fake devices vs one; run by
test_decoder_sharding.py as a subprocess (the device count must be set before JAX starts).

Mesh (data=2, fsdp=2, tp=2): the batch is split over (data, fsdp), the frozen kernels by
`decoder_partition_specs` and the factors by `adapters.partition_specs`. Prints one JSON line:
the losses and final adapters of both runs, and the factors' shardings after the steps.
"""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax import adapters, models
from lowrank_jax.adapters.paths import named_leaves

CONFIG = models.DecoderConfig(
    family="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    qkv_bias=True,
    remat_policy="nothing_saveable",
    dtype="float32",
)
RULES = [(r".*_proj/kernel", adapters.lora(4, alpha=8.0, in_ndim=1, out_ndim=1))]

model = models.DecoderLM(CONFIG)
tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, 64)
mask = jnp.ones(tokens.shape, jnp.bool_).at[:2, :3].set(False)  # two left-padded rows
variables = jax.jit(model.init)(jax.random.key(1), tokens)
lora = adapters.init(jax.random.key(2), variables, RULES)
lora = jax.tree.map(lambda f: f + 0.02, lora)  # B != 0: the adapters change the function
fwd = adapters.adapt(model.apply)
tx = optax.adam(1e-2)


def step(lora, opt_state, variables, tokens, mask):
    def loss_fn(ad):
        logits = fwd(variables, ad, tokens, mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        w = mask[:, 1:].astype(jnp.float32)
        return jnp.sum(ce * w) / jnp.sum(w)

    loss, grads = jax.value_and_grad(loss_fn)(lora)
    updates, opt_state = tx.update(grads, opt_state, lora)
    return optax.apply_updates(lora, updates), opt_state, loss


def train(lora, variables, tokens, mask, jitted):
    opt_state = tx.init(lora)
    losses = []
    for _ in range(3):
        lora, opt_state, loss = jitted(lora, opt_state, variables, tokens, mask)
        losses.append(float(loss))
    return lora, losses


one_lora, one_losses = train(lora, variables, tokens, mask, jax.jit(step))

mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
specs = models.decoder_partition_specs(variables, mesh=mesh)
lora_specs = adapters.partition_specs(lora, specs)
named = lambda t: jax.tree.map(
    lambda s: NamedSharding(mesh, s), t, is_leaf=lambda s: isinstance(s, P)
)
var_sh, lora_sh = named(specs), named(lora_specs)
batch_sh = NamedSharding(mesh, P(("data", "fsdp")))
sharded = jax.jit(
    step,
    in_shardings=(lora_sh, None, var_sh, batch_sh, batch_sh),
    out_shardings=(lora_sh, None, NamedSharding(mesh, P())),
)
put = lambda t, s: jax.device_put(t, s)
eight_lora, eight_losses = train(
    put(lora, lora_sh), put(variables, var_sh), put(tokens, batch_sh), put(mask, batch_sh), sharded
)

flat = lambda t: {k: np.asarray(v).tolist() for k, v in named_leaves(t).items()}
q, o = "params/model/layers/self_attn/q_proj/kernel", "params/model/layers/self_attn/o_proj/kernel"
kernel = variables["params"]["model"]["layers"]["self_attn"]
print(
    json.dumps(
        {
            "one": {"losses": one_losses, "lora": flat(one_lora)},
            "eight": {"losses": eight_losses, "lora": flat(eight_lora)},
            "q_kernel": str(specs["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"]),
            "q_a": str(eight_lora[q].factors["a"].sharding.spec),
            "q_b": str(eight_lora[q].factors["b"].sharding.spec),
            "o_a": str(eight_lora[o].factors["a"].sharding.spec),
            "o_b": str(eight_lora[o].factors["b"].sharding.spec),
            "k_bias": str(specs["params"]["model"]["layers"]["self_attn"]["k_proj"]["bias"]),
            "devices": len(jax.devices()),
            "kernel_shape": list(kernel["q_proj"]["kernel"].shape),
        }
    )
)
