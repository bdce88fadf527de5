"""A small causal character-level GPT (pre-LN decoder-only transformer).

Parameter paths (d = dim, V = vocab_size, T = max_len)::

    params/tok_embed/embedding (V, d)
    params/pos_embed (T, d)
    params/decoder/layer_i/...        (see `lowrank_jax.models.layers`; i = 0..depth-1)
    params/decoder/layers/...         (instead, with scan_layers=True: leading axis depth)
    params/ln_final/{scale,bias}
    params/head/{kernel (d, V), bias}

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019:
  decoder-only, pre-LayerNorm blocks, final LayerNorm, learned position embeddings.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.models.layers import TransformerStack

__all__ = ["CharGPT"]


class CharGPT(nn.Module):
    """Causal language model over token ids: logits for the next token at every position.

    Position i attends to positions j <= i only, so the logits at i depend on tokens 0..i only.

    Attributes:
      vocab_size: number of tokens V.
      dim: width d.
      depth: number of blocks.
      heads: attention heads; must divide d.
      max_len: longest sequence T (size of the position table).
      mlp_dim: MLP hidden width (default 4 d).
      dropout_rate: dropout inside the blocks (active when `deterministic=False`).
      scan_layers: run the blocks under `nn.scan` (parameters stacked along a leading axis).
      dtype: computation dtype (None: inferred from inputs and params).

    Example:
      >>> model = CharGPT(65, 64, 2, 4, 128)
      >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))  # doctest: +SKIP
    """

    vocab_size: int
    dim: int
    depth: int
    heads: int
    max_len: int
    mlp_dim: int | None = None
    dropout_rate: float = 0.0
    scan_layers: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Maps token ids (b, t), t <= max_len, to next-token logits (b, t, V).

        Raises:
          ValueError: if tokens are not 2-D integers or t > max_len.
        """
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"CharGPT expects integer token ids (b, t); got {tokens.dtype} {tokens.shape}."
            )
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}; crop it.")
        x = nn.Embed(self.vocab_size, self.dim, dtype=self.dtype, name="tok_embed")(tokens)
        pos = self.param("pos_embed", nn.initializers.normal(stddev=0.02), (self.max_len, self.dim))
        x = x + pos[:t].astype(x.dtype)
        mask = nn.make_causal_mask(tokens, dtype=jnp.bool_)  # (b, 1, t, t)
        x = TransformerStack(
            self.depth,
            self.heads,
            self.mlp_dim if self.mlp_dim is not None else 4 * self.dim,
            dropout_rate=self.dropout_rate,
            scan_layers=self.scan_layers,
            dtype=self.dtype,
            name="decoder",
        )(x, mask, deterministic=deterministic)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x)
