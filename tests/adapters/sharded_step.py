# ruff: noqa: E402
"""A few LoRA training steps on a (data, model) mesh; run as a script by test_sharding.py.

Prints the losses as JSON. With --devices=8 it shards the batch over 'data', kernels and their
factors over 'model' (A gets the kernel's input axis, B its output axis); with --devices=1 it runs
the same steps unsharded.
"""

import json
import os
import sys

n_devices = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from lowrank_jax import adapters as A


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(32, name="up")(x))
        return nn.Dense(8, name="down")(h)


model = Mlp()
x = jax.random.normal(jax.random.key(0), (16, 8))
y = jax.random.normal(jax.random.key(1), (16, 8))
variables = model.init(jax.random.key(2), x)
ad = A.init(jax.random.key(3), variables, [(r".*(up|down)/kernel", A.lora(4, alpha=8.0))])
opt = optax.adam(1e-2)
fwd = A.adapt(model.apply)

if n_devices > 1:
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    param_specs = {
        "params": {
            "up": {"kernel": P(None, "model"), "bias": P("model")},
            "down": {"kernel": P("model", None), "bias": P()},
        }
    }
    to = lambda tree, specs: jax.tree.map(
        lambda t, s: jax.device_put(t, NamedSharding(mesh, s)), tree, specs
    )
    variables = to(variables, param_specs)
    specs = A.partition_specs(ad, param_specs)
    assert specs["params/up/kernel"].factors["b"] == P(None, "model"), specs
    assert specs["params/down/kernel"].factors["a"] == P("model", None), specs
    ad = to(ad, specs)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))


@jax.jit
def step(ad, opt_state, variables, x, y):
    loss, g = jax.value_and_grad(lambda a: jnp.mean((fwd(variables, a, x) - y) ** 2))(ad)
    updates, opt_state = opt.update(g, opt_state, ad)
    return optax.apply_updates(ad, updates), opt_state, loss


opt_state = opt.init(ad)
losses = []
for _ in range(5):
    ad, opt_state, loss = step(ad, opt_state, variables, x, y)
    losses.append(float(loss))
spec = getattr(ad["params/up/kernel"].factors["b"].sharding, "spec", None)
print(json.dumps({"losses": losses, "b_spec": str(spec)}))
