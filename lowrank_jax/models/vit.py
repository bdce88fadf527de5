"""A small Vision Transformer for 28x28 (MNIST) and 8x8 (sklearn digits) images.

Parameter paths (d = dim, p = patch, c = channels, n = number of patches)::

    params/patch_embed/{kernel (p*p*c, d), bias}
    params/cls_token (1, 1, d)
    params/pos_embed (1, n + 1, d)
    params/encoder/layer_i/...        (see `lowrank_jax.models.layers`; i = 0..depth-1)
    params/encoder/layers/...         (instead, with scan_layers=True: leading axis depth)
    params/ln_final/{scale,bias}
    params/head/{kernel (d, num_classes), bias}

References:
  Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at
  Scale", ICLR 2021 (patch embedding as a linear map of flattened patches, class token,
  learned position embeddings, pre-LN blocks).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.models.layers import TransformerStack

__all__ = ["ViT"]


class ViT(nn.Module):
    """Vision Transformer classifier with a linear (2-D `nn.Dense`) patch embedding.

    Images (b, H, W) or (b, H, W, c) are cut into non-overlapping p x p patches, flattened to
    (b, n, p*p*c), embedded by `patch_embed`, prefixed with a class token, added to learned
    position embeddings, passed through `depth` pre-LN blocks, normalised, and the class token
    is mapped to logits by `head`.

    Attributes:
      patch: patch side p; must divide H and W.
      dim: width d.
      depth: number of blocks.
      heads: attention heads; must divide d.
      mlp_dim: MLP hidden width.
      num_classes: output width.
      dropout_rate: dropout inside the blocks (active when `deterministic=False`).
      scan_layers: run the blocks under `nn.scan` (parameters stacked along a leading axis).
      dtype: computation dtype (None: inferred from inputs and params).

    Example:
      >>> model = ViT(7, 64, 2, 4, 128, 10)  # MNIST 28x28: 16 patches
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 28, 28)))  # doctest: +SKIP
    """

    patch: int
    dim: int
    depth: int
    heads: int
    mlp_dim: int
    num_classes: int
    dropout_rate: float = 0.0
    scan_layers: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Maps images (b, H, W) or (b, H, W, c) to logits (b, num_classes).

        Raises:
          ValueError: if the images are not 3-D/4-D, or `patch` does not divide H and W.
        """
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4:
            raise ValueError(f"ViT expects images (b, H, W) or (b, H, W, c); got {images.shape}.")
        b, height, width, c = images.shape
        p = self.patch
        if p < 1 or height % p or width % p:
            raise ValueError(f"patch={p} must divide the image size {height}x{width}.")
        gh, gw = height // p, width // p
        patches = images.reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(b, gh * gw, p * p * c)
        x = nn.Dense(self.dim, dtype=self.dtype, name="patch_embed")(patches)
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)).astype(x.dtype), x], axis=1)
        pos = self.param(
            "pos_embed", nn.initializers.normal(stddev=0.02), (1, gh * gw + 1, self.dim)
        )
        x = x + pos.astype(x.dtype)
        x = TransformerStack(
            self.depth,
            self.heads,
            self.mlp_dim,
            dropout_rate=self.dropout_rate,
            scan_layers=self.scan_layers,
            dtype=self.dtype,
            name="encoder",
        )(x, deterministic=deterministic)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x[:, 0])
