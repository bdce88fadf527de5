"""A multilayer perceptron classifier with readable parameter names."""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

__all__ = ["MLP"]


class MLP(nn.Module):
    """Multilayer perceptron `head(act(dense_{k-1}(…act(dense_0(flatten(x))))))`.

    Parameter paths: `params/dense_i/{kernel,bias}` with kernels (n_i, features[i]), and
    `params/head/{kernel,bias}` with kernel (features[-1], num_classes).

    Attributes:
      features: widths of the hidden layers (may be empty: a linear classifier).
      num_classes: output width.
      activation: hidden non-linearity (default ReLU).
      dtype: computation dtype (None: inferred from inputs and params).

    Example:
      >>> model = MLP((64, 64), 10)
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8)))  # doctest: +SKIP
    """

    features: Sequence[int]
    num_classes: int
    activation: Callable[[jax.Array], jax.Array] = nn.relu
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps inputs (b, ...) (flattened to (b, n)) to logits (b, num_classes).

        Raises:
          ValueError: if x has no batch axis, or a width is not positive.
        """
        if x.ndim < 1:
            raise ValueError(f"MLP expects inputs of shape (b, ...); got a scalar {x.shape}.")
        if any(f < 1 for f in self.features) or self.num_classes < 1:
            raise ValueError(
                f"widths must be positive; got features={tuple(self.features)}, "
                f"num_classes={self.num_classes}."
            )
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.features):
            x = self.activation(nn.Dense(width, dtype=self.dtype, name=f"dense_{i}")(x))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
