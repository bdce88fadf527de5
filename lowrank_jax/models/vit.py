"""A Vision Transformer: small ones trained from scratch (MNIST, sklearn digits) and the
Hugging Face ViT checkpoints (`lowrank_jax.models.load_hf_vit`, ViT-B/16 and the like).

Parameter paths (d = dim, p = patch, c = channels, n = number of patches)::

    params/patch_embed/{kernel (p*p*c, d), bias}
    params/cls_token (1, 1, d)
    params/pos_embed (1, n + 1, d)
    params/encoder/layer_i/...        (see `lowrank_jax.models.layers`; i = 0..depth-1)
    params/encoder/layers/...         (instead, with scan_layers=True: leading axis depth)
    params/ln_final/{scale,bias}
    params/pooler/{kernel (d, pooler_dim), bias}   (pooler_dim > 0 only)
    params/head/{kernel (d or pooler_dim, num_classes), bias}   (num_classes > 0 only)

so adapter rules read `.*attention/(query|key|value|out)/kernel` and `.*mlp/(fc1|fc2)/kernel`;
on the scanned stack a kernel is (depth, n, m) and the rule's kind takes
`lora(r, in_ndim=1, out_ndim=1)`, as for the decoder stack.

References:
  Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image Recognition at
  Scale", ICLR 2021 (patch embedding as a linear map of flattened patches, class token,
  learned position embeddings, pre-LN blocks).
"""

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.models.layers import TransformerStack

__all__ = ["ViT"]


class ViT(nn.Module):
    """Vision Transformer classifier with a linear (2-D `nn.Dense`) patch embedding.

    Images (b, H, W) or (b, H, W, c) are cut into non-overlapping p x p patches, flattened to
    (b, n, p*p*c) in (row, column, channel) order, embedded by `patch_embed`, prefixed with a
    class token, added to learned position embeddings, passed through `depth` pre-LN blocks,
    normalised, and the class token is mapped to logits by `head`::

        f = LN(blocks([cls; patches W_e + b_e] + pos))[:, 0]       (the features, (b, d))
        f = activation_p(f W_p + b_p)                               (pooler_dim > 0 only)
        logits = f W_h + b_h                                        (num_classes > 0 only)

    With `num_classes=0` the model returns the features. The defaults are those of the small
    ViTs trained here; a Hugging Face checkpoint sets `layer_norm_eps=1e-12`, the exact GELU
    and its pooler (`load_hf_vit` builds the module from its `config.json`).

    Attributes:
      patch: patch side p, or (p_h, p_w); must divide H and W.
      dim: width d.
      depth: number of blocks.
      heads: attention heads; must divide d.
      mlp_dim: MLP hidden width.
      num_classes: output width; 0: no head, the features are returned.
      dropout_rate: dropout on the embeddings and inside the blocks (active when
        `deterministic=False`).
      scan_layers: run the blocks under `nn.scan` (parameters stacked along a leading axis).
      layer_norm_eps: epsilon of every LayerNorm.
      activation: the MLPs' non-linearity (default: tanh-approximated GELU).
      qkv_bias: whether the query, key and value projections have biases.
      pooler_dim: width of the pooler (a dense layer and `pooler_activation` on the class
        token, Hugging Face's `pooler_output`); 0: no pooler.
      pooler_activation: the pooler's non-linearity.
      dtype: computation dtype (None: inferred from inputs and params).

    Example:
      >>> model = ViT(7, 64, 2, 4, 128, 10)  # MNIST 28x28: 16 patches
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 28, 28)))  # doctest: +SKIP
    """

    patch: int | tuple[int, int]
    dim: int
    depth: int
    heads: int
    mlp_dim: int
    num_classes: int
    dropout_rate: float = 0.0
    scan_layers: bool = False
    layer_norm_eps: float = 1e-6
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    qkv_bias: bool = True
    pooler_dim: int = 0
    pooler_activation: Callable[[jax.Array], jax.Array] = jnp.tanh
    dtype: Any = None

    @nn.compact
    def __call__(self, images: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Maps images (b, H, W) or (b, H, W, c) to logits (b, num_classes), or to the features
        (b, pooler_dim or d) when `num_classes=0`.

        Raises:
          ValueError: if the images are not 3-D/4-D, or `patch` does not divide H and W.
        """
        if images.ndim == 3:
            images = images[..., None]
        if images.ndim != 4:
            raise ValueError(f"ViT expects images (b, H, W) or (b, H, W, c); got {images.shape}.")
        b, height, width, c = images.shape
        ph, pw = (self.patch, self.patch) if isinstance(self.patch, int) else tuple(self.patch)
        if ph < 1 or pw < 1 or height % ph or width % pw:
            raise ValueError(f"patch={self.patch} must divide the image size {height}x{width}.")
        gh, gw = height // ph, width // pw
        patches = images.reshape(b, gh, ph, gw, pw, c).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(b, gh * gw, ph * pw * c)
        x = nn.Dense(self.dim, dtype=self.dtype, name="patch_embed")(patches)
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)).astype(x.dtype), x], axis=1)
        pos = self.param(
            "pos_embed", nn.initializers.normal(stddev=0.02), (1, gh * gw + 1, self.dim)
        )
        x = x + pos.astype(x.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
        x = TransformerStack(
            self.depth,
            self.heads,
            self.mlp_dim,
            dropout_rate=self.dropout_rate,
            scan_layers=self.scan_layers,
            layer_norm_eps=self.layer_norm_eps,
            activation=self.activation,
            qkv_bias=self.qkv_bias,
            dtype=self.dtype,
            name="encoder",
        )(x, deterministic=deterministic)
        x = nn.LayerNorm(epsilon=self.layer_norm_eps, dtype=self.dtype, name="ln_final")(x)
        features = x[:, 0]
        if self.pooler_dim:
            pooled = nn.Dense(self.pooler_dim, dtype=self.dtype, name="pooler")(features)
            features = self.pooler_activation(pooled)
        if not self.num_classes:
            return features
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(features)
