"""Transformer building blocks whose projections are plain 2-D `nn.Dense` kernels.

Every projection is an `nn.Dense` with a kernel of shape (n, m) (in, out); heads are split by a
reshape *after* the projection. Adapter rules over '/'-joined parameter paths therefore see one
2-D matrix per projection, e.g. `.../attention/query/kernel` (n, m), `.../mlp/fc1/kernel`.

Parameter names of one pre-LN block (`PreLNBlock`)::

    ln_attention/{scale,bias}
    attention/{query,key,value,out}/{kernel,bias}     kernels (d, d)
    ln_mlp/{scale,bias}
    mlp/fc1/{kernel,bias}                             kernel (d, mlp_dim)
    mlp/fc2/{kernel,bias}                             kernel (mlp_dim, d)

`TransformerStack` names its blocks `layer_0`, ..., `layer_{L-1}`, or, with `scan_layers=True`, holds
one `layers` block whose parameters carry a leading layer axis (kernels (L, n, m)).
`stack_layers` / `unstack_layers` convert between the two layouts.
"""

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FeedForward",
    "PreLNBlock",
    "SelfAttention",
    "TransformerStack",
    "stack_layers",
    "unstack_layers",
]

Initializer = Callable[..., jax.Array]


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate 2-D `query`, `key`, `value`, `out` kernels.

    With x (b, t, d), h heads of size k = d / h and W_q, W_k, W_v, W_o (d, d):

        Q = x W_q + b_q,  K = x W_k + b_k,  V = x W_v + b_v     (reshaped to (b, t, h, k))
        P = softmax(Q K^T / sqrt(k), masked entries set to the dtype's minimum)
        out = concat_heads(P V) W_o + b_o

    Attributes:
      num_heads: number of heads h; must divide d.
      dropout_rate: dropout on the attention probabilities (active when `deterministic=False`).
      kernel_init: initialiser of the four kernels.
      qkv_bias: whether `query`, `key` and `value` have biases (`out` always has one).
      dtype: computation dtype (None: inferred from inputs and params).
    """

    num_heads: int
    dropout_rate: float = 0.0
    kernel_init: Initializer = nn.initializers.lecun_normal()
    qkv_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        """Attends over the sequence.

        Args:
          x: (b, t, d) inputs.
          mask: optional boolean array broadcastable to (b, h, t, t); True where query i may
            attend to key j.
          deterministic: disables dropout when True.

        Returns:
          (b, t, d) outputs.

        Raises:
          ValueError: if x is not 3-D or `num_heads` does not divide d.
        """
        if x.ndim != 3:
            raise ValueError(f"SelfAttention expects x of shape (b, t, d); got {x.shape}.")
        b, t, d = x.shape
        if d % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide the width d={d}.")
        k = d // self.num_heads

        def dense(name: str, use_bias: bool = True) -> nn.Dense:
            return nn.Dense(
                d, use_bias=use_bias, kernel_init=self.kernel_init, dtype=self.dtype, name=name
            )

        q = dense("query", self.qkv_bias)(x).reshape(b, t, self.num_heads, k)
        key = dense("key", self.qkv_bias)(x).reshape(b, t, self.num_heads, k)
        v = dense("value", self.qkv_bias)(x).reshape(b, t, self.num_heads, k)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, key) / jnp.sqrt(k).astype(q.dtype)
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
        ctx = jnp.einsum("bhqs,bshk->bqhk", probs, v).reshape(b, t, d)
        return dense("out")(ctx)


class FeedForward(nn.Module):
    """Two-layer MLP `fc2(activation(fc1(x)))` with kernels fc1 (d, mlp_dim), fc2 (mlp_dim, d).

    Attributes:
      mlp_dim: hidden width.
      activation: elementwise non-linearity (default: tanh-approximated GELU).
      kernel_init: initialiser of both kernels.
      dtype: computation dtype.
    """

    mlp_dim: int
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    kernel_init: Initializer = nn.initializers.lecun_normal()
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps (..., d) to (..., d)."""
        d = x.shape[-1]
        h = nn.Dense(self.mlp_dim, kernel_init=self.kernel_init, dtype=self.dtype, name="fc1")(x)
        h = self.activation(h)
        return nn.Dense(d, kernel_init=self.kernel_init, dtype=self.dtype, name="fc2")(h)


class PreLNBlock(nn.Module):
    """Pre-LayerNorm transformer block.

        x = x + drop(attention(ln_attention(x), mask))
        x = x + drop(mlp(ln_mlp(x)))

    Attributes:
      num_heads: attention heads.
      mlp_dim: hidden width of the MLP.
      dropout_rate: dropout on attention probabilities and on both residual branches.
      deterministic: disables dropout when True (a field, so that the block can be scanned).
      layer_norm_eps: epsilon of both LayerNorms.
      activation: the MLP's non-linearity (default: tanh-approximated GELU).
      qkv_bias: whether the query, key and value projections have biases.
      dtype: computation dtype.
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    deterministic: bool = True
    layer_norm_eps: float = 1e-6
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    qkv_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Maps (b, t, d) to (b, t, d); `mask` as in `SelfAttention`."""
        drop = nn.Dropout(self.dropout_rate, deterministic=self.deterministic)
        eps = self.layer_norm_eps
        y = nn.LayerNorm(epsilon=eps, dtype=self.dtype, name="ln_attention")(x)
        y = SelfAttention(
            self.num_heads,
            dropout_rate=self.dropout_rate,
            qkv_bias=self.qkv_bias,
            dtype=self.dtype,
            name="attention",
        )(y, mask, deterministic=self.deterministic)
        x = x + drop(y)
        y = nn.LayerNorm(epsilon=eps, dtype=self.dtype, name="ln_mlp")(x)
        y = FeedForward(self.mlp_dim, self.activation, dtype=self.dtype, name="mlp")(y)
        return x + drop(y)


class _ScanBlock(PreLNBlock):
    """`PreLNBlock` with the `(carry, xs) -> (carry, ys)` signature that `nn.scan` needs."""

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, None]:
        return super().__call__(x, mask), None


class TransformerStack(nn.Module):
    """`depth` pre-LN blocks, unrolled (`layer_i`) or scanned over a stacked `layers` block.

    With `scan_layers=True` the blocks run under `nn.scan`; every parameter of the single
    `layers` block gains a leading layer axis of size `depth` (kernels (L, n, m)). The two
    layouts compute the same function when their parameters are related by
    `stack_layers` / `unstack_layers`.

    Attributes:
      depth: number of blocks L.
      num_heads: attention heads per block.
      mlp_dim: MLP hidden width.
      dropout_rate: dropout rate inside the blocks.
      scan_layers: scan over stacked layers instead of unrolling.
      layer_norm_eps, activation, qkv_bias: as in `PreLNBlock`.
      dtype: computation dtype.
    """

    depth: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    scan_layers: bool = False
    layer_norm_eps: float = 1e-6
    activation: Callable[[jax.Array], jax.Array] = nn.gelu
    qkv_bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(
        self, x: jax.Array, mask: jax.Array | None = None, *, deterministic: bool = True
    ) -> jax.Array:
        """Maps (b, t, d) to (b, t, d); `mask` as in `SelfAttention`."""
        kwargs = dict(
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            dropout_rate=self.dropout_rate,
            deterministic=deterministic,
            layer_norm_eps=self.layer_norm_eps,
            activation=self.activation,
            qkv_bias=self.qkv_bias,
            dtype=self.dtype,
        )
        if self.scan_layers:
            scanned = nn.scan(
                _ScanBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=self.depth,
            )
            x, _ = scanned(**kwargs, name="layers")(x, mask)
            return x
        for i in range(self.depth):
            x = PreLNBlock(**kwargs, name=f"layer_{i}")(x, mask)
        return x


def _layer_index(name: str) -> int | None:
    prefix = "layer_"
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def stack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Converts unrolled `layer_0`, ..., `layer_{L-1}` subtrees into one stacked `layers` subtree.

    Applied recursively: wherever a mapping holds children `layer_0`, ..., `layer_{L-1}`, they are
    replaced by a child `layers` whose leaves are `jnp.stack` of the L layer leaves along a new
    axis 0 (a kernel (n, m) becomes (L, n, m)). This is the layout of
    `TransformerStack(scan_layers=True)`.

    Args:
      tree: nested mapping, e.g. the variables `{"params": ...}` of an unrolled model.

    Returns:
      A new nested dict with stacked layers (the input is not modified).

    Raises:
      ValueError: if the layer indices are not exactly 0..L-1, if a mapping holds both
        `layer_i` and `layers`, or if the layers' trees differ in structure or shape.

    Example:
      >>> scanned_vars = stack_layers(unrolled_vars)  # doctest: +SKIP
    """
    if not isinstance(tree, Mapping):
        return tree
    out: dict[str, Any] = {}
    layers: dict[int, Any] = {}
    for name, child in tree.items():
        i = _layer_index(name)
        if i is None:
            out[name] = stack_layers(child)
        else:
            layers[i] = child
    if layers:
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"layer indices must be 0..L-1; got {sorted(layers)}.")
        if "layers" in out:
            raise ValueError("a mapping holds both `layer_i` and `layers`; cannot stack.")
        trees = [layers[i] for i in range(len(layers))]
        structs = {jax.tree.structure(t) for t in trees}
        if len(structs) != 1:
            raise ValueError("the `layer_i` subtrees differ in structure; cannot stack them.")
        shapes = [tuple(np.shape(x) for x in jax.tree.leaves(t)) for t in trees]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("the `layer_i` subtrees differ in leaf shapes; cannot stack them.")
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    return out


def unstack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `stack_layers`: splits every `layers` subtree along axis 0 into `layer_i`.

    Args:
      tree: nested mapping with stacked `layers` subtrees (leaves (L, ...)).

    Returns:
      A new nested dict with children `layer_0`, ..., `layer_{L-1}` (leaves (...)).

    Raises:
      ValueError: if the leaves of a `layers` subtree disagree on L or are scalars, or if the
        mapping already holds a `layer_i` child.
    """
    if not isinstance(tree, Mapping):
        return tree
    out: dict[str, Any] = {}
    for name, child in tree.items():
        if name != "layers":
            out[name] = unstack_layers(child)
            continue
        leaves = jax.tree.leaves(child)
        sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"`layers` leaves must share a leading layer axis; got leading sizes {sizes}."
            )
        (depth,) = sizes
        for i in range(depth):
            if f"layer_{i}" in tree:
                raise ValueError(f"the mapping already holds `layer_{i}`; cannot unstack.")
            out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], child)
    return out
