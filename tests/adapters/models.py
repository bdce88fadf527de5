"""Small models shared by the adapter tests."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class Block(nn.Module):
    """Dense + DenseGeneral heads + output projection, the shapes of an attention block."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name="fc1")(x))
        h = nn.DenseGeneral((2, 4), name="qkv")(h)
        return nn.DenseGeneral(5, axis=(-2, -1), name="out")(h)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(6, name="dense")(h)), None


class Scanned(nn.Module):
    """Three layers stacked with nn.scan (kernels (3, 6, 6)) inside remat."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6, name="inp")(x)
        layers = nn.scan(
            nn.remat(_Layer), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        h, _ = layers(name="layers")(h, None)
        return nn.Dense(3, name="head")(h)


def perturb(adapters, value=0.1):
    """Makes zero-initialised B factors non-zero so that deltas are visible."""
    return jax.tree.map(lambda t: t + value, adapters)


def plain_function(p, x):
    """A plain JAX function over a dict of kernels: matmul, scan over stacked kernels, remat,
    and a transposed (tied-embedding style) use of ``emb``."""
    h = jnp.tanh(x @ p["w1"])
    h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, p["stack"])
    h = jax.checkpoint(lambda h: h @ p["w2"])(h)
    return h @ p["emb"].T  # the kernel's output axis is contracted


def plain_params():
    """Kernels for :func:`plain_function` (input width 8) and their LoRA rules."""
    from lowrank_jax import adapters as A

    keys = jax.random.split(jax.random.key(3), 4)
    p = {
        "w1": jax.random.normal(keys[0], (8, 6)),
        "stack": jax.random.normal(keys[1], (3, 6, 6)) / 3,
        "w2": jax.random.normal(keys[2], (6, 5)),
        "emb": jax.random.normal(keys[3], (7, 5)),
    }
    rules = [("stack", A.lora(2, in_ndim=1, out_ndim=1)), ("w1|w2|emb", A.lora(2))]
    return p, rules


def perturb_torch(model, scale, seed=0):
    """Moves every trainable tensor of a PyTorch (PEFT) model by seeded noise, as training would."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return model
