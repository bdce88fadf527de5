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
