"""A small convolutional classifier with readable parameter names (P19 channel pruning)."""

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

__all__ = ["CNN"]


class CNN(nn.Module):
    """``head(act(dense_k(…flatten(pool(act(conv_j(…pool(act(conv_0(x))))))))))``.

    Every conv is ``kernel_size × kernel_size``, stride 1, ``SAME`` padding, followed by the
    activation and a 2×2 max-pool (stride 2); the last feature map ``(b, h, w, c)`` is flattened
    in NHWC order (channel fastest, so a following kernel row ``i`` belongs to channel
    ``i mod c``).

    Parameter paths: ``params/conv_j/{kernel,bias}`` with kernels ``(k, k, c_in, channels[j])``,
    ``params/dense_i/{kernel,bias}`` with kernels ``(n_i, features[i])``, ``params/head``.

    Attributes:
      channels: output channels of the conv layers.
      features: widths of the hidden dense layers (may be empty).
      num_classes: output width.
      kernel_size: spatial size of every conv kernel.
      activation: hidden non-linearity (default ReLU).
      dtype: computation dtype (None: inferred).

    Example:
      >>> model = CNN((16, 32), (64,), 10)
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))  # doctest: +SKIP
    """

    channels: Sequence[int]
    features: Sequence[int]
    num_classes: int
    kernel_size: int = 3
    activation: Callable[[jax.Array], jax.Array] = nn.relu
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps images ``(b, h, w, c)`` to logits ``(b, num_classes)``.

        Raises:
          ValueError: if ``x`` is not 4-D or a width is not positive.
        """
        if x.ndim != 4:
            raise ValueError(f"CNN expects images (b, h, w, c); got shape {x.shape}.")
        widths = (*self.channels, *self.features, self.num_classes, self.kernel_size)
        if any(int(f) < 1 for f in widths):
            raise ValueError(
                f"widths must be positive; got channels={tuple(self.channels)}, "
                f"features={tuple(self.features)}, num_classes={self.num_classes}, "
                f"kernel_size={self.kernel_size}."
            )
        k = (self.kernel_size, self.kernel_size)
        for j, c in enumerate(self.channels):
            x = nn.Conv(c, k, padding="SAME", dtype=self.dtype, name=f"conv_{j}")(x)
            x = nn.max_pool(self.activation(x), (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.features):
            x = self.activation(nn.Dense(width, dtype=self.dtype, name=f"dense_{i}")(x))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
