"""Low-precision frozen bases: bfloat16 kernels, or 8-bit / 4-bit NF4 weight-only quantised kernels.

Adapters train in float32 while the frozen base they sit on is stored in less memory:

* ``"bfloat16"``: every selected kernel is cast to bfloat16 (half the bytes). Inside a linen
  ``Dense`` with ``dtype=None`` the kernel is promoted back to the input's dtype before the matmul,
  so with float32 activations the layer computes ``x·bf16(W)`` in float32 and **its output is
  float32**; the adapter factors, their gradients and the optimizer state stay float32.
* ``"int8"``: every selected kernel ``W`` (``(..., m)``, output axis last) becomes a
  :class:`qwix.QArray` with ``Q = round(W / s)`` in int8 and one float32 absmax scale per output
  channel, ``s_j = max_i |W_ij| / 127.5`` (symmetric, per-channel; quantised by ``qwix.quantize``,
  a quarter of the bytes plus ``4·m``). The factorised forward never dequantises a kernel: the
  scale is constant along the contracted axis, so ``x·(Q·diag(s)) = (x·Q)·diag(s)`` is one
  int8-weight matmul followed by a per-channel rescale of the output (**float32 output**).
  :func:`lowrank_jax.adapters.fold` dequantises (``W ≈ Q·diag(s)``) and returns float32 kernels.
* ``"nf4"`` (QLoRA's base): every selected kernel ``(..., n, m)`` becomes a ``qwix.QArray`` of
  4-bit NormalFloat codes (``uint4``: 16 levels ``q_k``, the quantiles of a standard normal scaled
  to [-1, 1]) with one float32 absmax scale per block of ``block_size`` (default 64) consecutive
  input rows of each output column (and of each stacked layer): ``W_ij ≈ s_{b(i)j} · q[Q_ij]``,
  ``s = max |W| over the block``. That is 4 bits per entry plus ``32 / block_size`` (0.5 + 0.0625
  bytes per entry at 64, 0.14 of float32). The levels are not uniform, so no ``(x·Q)·diag(s)``
  shortcut exists: the matmul rule dequantises the kernel where it is used, i.e. one layer's
  kernel at a time inside a scanned stack, and computes ``x·W`` in the kernel's (cast) dtype.

Quantisation uses `qwix <https://github.com/google/qwix>`_ (Google's JAX quantisation library) for
the numerics and the ``QArray`` container. Its own weight-only ``qwix.dot_general`` dequantises the
whole kernel before the matmul; here the rescale is applied to the output instead (no float copy
of ``W`` is formed beyond XLA's int8→float convert), and the rule is a ``quax`` rule so that it
composes with the factorised adapter path of :func:`lowrank_jax.adapters.adapt` (which rewrites
the same ``dot_general``).

The absmax error bound per entry is ``|W_ij − s_j·Q_ij| ≤ s_j / 2`` for int8 and half the widest
gap between NF4 levels, ``s · (1 − 0.6962) / 2 ≈ 0.152 s``, for NF4.

NF4 uses qwix's ``"nf4"`` qtype (its levels, bucketing and ``QArray``) with qwix's tiled
(block-wise) absmax scales; what qwix lacks for this use is the matmul with a quantised
kernel inside our factorised adapter path (qwix's ``dot_general`` is a separate interception
mechanism), so that rule is ours, as for int8. QLoRA's double quantisation of the scales and its
paged optimisers are not implemented.

References:
  Dettmers et al. 2022, LLM.int8(); Dettmers et al. 2023, QLoRA (NF4 with blocks of 64; the
  int8 base here is 8-bit absmax per channel).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import quax
from jax import lax

from lowrank_jax.adapters import paths

__all__ = [
    "BASE_DTYPES",
    "DEFAULT_PATTERNS",
    "BaseDtype",
    "QuantizedArray",
    "base_bytes",
    "dequantize",
    "dequantize_base",
    "has_quantized",
    "is_quantized",
    "low_precision_base",
    "quantize_int8",
    "quantize_nf4",
    "quantized_dot_general",
    "wrap_quantized",
]

BaseDtype = Literal["float32", "bfloat16", "int8", "nf4"]
BASE_DTYPES = ("float32", "bfloat16", "int8", "nf4")
DEFAULT_PATTERNS = (r".*kernel",)


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a ``qwix.QArray`` (without importing qwix when nobody has)."""
    return paths.is_param_leaf(x)


def dequantize(x: Any) -> Any:
    """``Q·diag(s)`` for a quantised kernel (float32), anything else unchanged."""
    if is_quantized(x):
        import qwix

        return qwix.dequantize(x)
    return x


def quantize_int8(w: jax.Array) -> Any:
    """Per-output-channel (last axis) symmetric absmax int8 quantisation of one kernel.

    Returns:
      a ``qwix.QArray`` with ``qvalue`` int8 of ``w``'s shape and ``scale`` float32 of shape
      ``(1, ..., 1, m)``; ``qwix.dequantize`` of it is within ``scale / 2`` of ``w`` entrywise.
    """
    import qwix

    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"int8 quantisation takes a floating kernel of >= 2 axes, got {w.dtype}.")
    return qwix.quantize(
        w.astype(jnp.float32), jnp.int8, channelwise_axes=(w.ndim - 1,), scale_dtype=jnp.float32
    )


def quantize_nf4(w: jax.Array, *, block_size: int = 64) -> Any:
    """4-bit NormalFloat quantisation of one kernel with block-wise absmax scales (QLoRA).

    Blocks are ``block_size`` consecutive entries along the input axis (``-2``) of each output
    column and of each leading (stacked-layer) index.

    Args:
      w: a floating kernel ``(..., n, m)`` with ``n`` divisible by ``block_size``.
      block_size: entries per scale (QLoRA: 64).

    Returns:
      a ``qwix.QArray`` with ``qvalue`` ``uint4`` codes of ``w``'s shape, ``qtype="nf4"`` and
      ``scale`` float32 ``(..., n / block_size, m)``; ``qwix.dequantize`` of it is within
      ``0.152 · scale`` of ``w`` entrywise (half the widest gap between levels).

    Raises:
      TypeError: ``w`` is not a floating array with at least two axes.
      ValueError: ``block_size`` is not positive or does not divide ``n``.
    """
    import qwix

    w = jnp.asarray(w)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"nf4 quantisation takes a floating kernel of >= 2 axes, got {w.dtype}.")
    if block_size < 1 or w.shape[-2] % block_size:
        raise ValueError(
            f"nf4 block_size={block_size} must be positive and divide the input axis "
            f"{w.shape[-2]} of the kernel {w.shape}; choose a divisor (e.g. 32 or 64)."
        )
    channels = tuple(a for a in range(w.ndim) if a != w.ndim - 2)
    quantize = functools.partial(
        qwix.quantize,
        qtype="nf4",
        channelwise_axes=channels,
        tiled_axes={w.ndim - 2: block_size},
        scale_dtype=jnp.float32,
    )
    return jax.jit(quantize)(w.astype(jnp.float32))  # one program, not op-by-op bucketing


def low_precision_base(
    params: Any,
    base_dtype: BaseDtype,
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    block_size: int = 64,
) -> Any:
    """Stores the frozen kernels of ``params`` in ``base_dtype``.

    Args:
      params: a (frozen) parameter pytree; leaves that are ``None`` are left alone.
      base_dtype: ``"float32"`` (unchanged), ``"bfloat16"`` (cast), ``"int8"`` (per-channel
        absmax ``qwix.QArray``) or ``"nf4"`` (4-bit NormalFloat, block-wise scales; see the
        module docstring).
      patterns: full-match regexes over '/'-joined paths; matching floating leaves with at least
        two axes are converted (default: every ``kernel``; embeddings, biases and norms stay).
      block_size: entries per scale along the input axis for ``"nf4"``.

    Returns:
      ``params`` with the selected kernels converted. Use it with
      :func:`lowrank_jax.adapters.adapt` (either backend) after :func:`lowrank_jax.adapters.init`
      on the float32 parameters.

    Raises:
      ValueError: unknown ``base_dtype``, or no leaf matches ``patterns``.
    """
    if base_dtype not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {base_dtype!r}.")
    if base_dtype == "float32":
        return params
    compiled = [re.compile(p) for p in patterns]
    hits = []

    def convert(keypath, leaf):
        name = paths.path_to_str(keypath)
        if (
            leaf is None
            or is_quantized(leaf)
            or getattr(leaf, "ndim", 0) < 2
            or not jnp.issubdtype(leaf.dtype, jnp.floating)
            or not any(c.fullmatch(name) for c in compiled)
        ):
            return leaf
        hits.append(name)
        if base_dtype == "bfloat16":
            return jnp.asarray(leaf, jnp.bfloat16)
        if base_dtype == "nf4":
            return quantize_nf4(leaf, block_size=block_size)
        return quantize_int8(leaf)

    out = jax.tree_util.tree_map_with_path(convert, params, is_leaf=paths.is_param_leaf)
    if not hits:
        raise ValueError(
            f"no floating kernel of >= 2 axes matches {list(patterns)}; the paths are:\n  "
            + "\n  ".join(paths.named_leaves(params))
        )
    return out


def dequantize_base(params: Any) -> Any:
    """Every quantised kernel of ``params`` dequantised to float32 (for a plain ``model.apply``)."""
    return jax.tree.map(dequantize, params, is_leaf=paths.is_param_leaf)


def base_bytes(params: Any) -> int:
    """Bytes held by a parameter pytree (quantised kernels count their codes and scales; 4-bit
    codes count half a byte, as XLA packs them on accelerators)."""
    bits = sum(int(x.size) * jax.dtypes.itemsize_bits(x.dtype) for x in jax.tree.leaves(params))
    return (bits + 7) // 8


# ----------------------------------------------------------------------------------------------
# The matmul with a quantised kernel, for the quax rules of adapt().


def _scale_for_output(
    q: Any, q_is_lhs: bool, contract: Sequence[int], other_ndim: int, n_contract: int
) -> jax.Array | None:
    """The scale arranged to broadcast against ``dot_general``'s output, or ``None``.

    ``None`` when the scale varies along a contracted axis (then the kernel is dequantised).
    """
    scale = q.scale
    if any(scale.shape[ax] != 1 for ax in contract):
        return None
    free = [ax for ax in range(scale.ndim) if ax not in contract]
    s = jnp.reshape(scale, tuple(scale.shape[ax] for ax in free))
    other_free = other_ndim - n_contract
    if q_is_lhs:  # output: (q free..., other free...)
        return jnp.reshape(s, s.shape + (1,) * other_free)
    return s  # output: (other free..., q free...): trailing broadcast


_NON_UNIFORM = ("nf4",)  # levels that are not multiples of the scale: no (x·Q)·diag(s)


def quantized_dot_general(lhs: Any, rhs: Any, q: Any, q_is_lhs: bool, params: dict) -> jax.Array:
    """``dot_general`` with one operand a ``QArray``: ``(x·Q)·diag(s)`` when the scale is free."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    other = rhs if q_is_lhs else lhs
    contract = lc if q_is_lhs else rc
    scale = None
    if not (lb or rb) and q.qtype not in _NON_UNIFORM:
        scale = _scale_for_output(q, q_is_lhs, contract, other.ndim, len(contract))
    if scale is None:  # NF4 levels, or scales along the contraction: dequantise here
        w = dequantize(q).astype(other.dtype)
        return lax.dot_general_p.bind(*((w, rhs) if q_is_lhs else (lhs, w)), **params)
    out_dtype = jnp.result_type(other.dtype, q.scale.dtype)
    w = q.qvalue.astype(out_dtype)
    x = other.astype(out_dtype)
    call = dict(params, preferred_element_type=params.get("preferred_element_type") or out_dtype)
    y = lax.dot_general_p.bind(*((w, x) if q_is_lhs else (x, w)), **call)
    return y * scale.astype(y.dtype)


class QuantizedArray(quax.ArrayValue):
    """A quantised kernel that no adapter targets, seen by JAX as its float (scale) dtype."""

    q: Any

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.q.shape, self.q.dtype)

    def materialise(self) -> jax.Array:
        return dequantize(self.q)


@quax.register(lax.dot_general_p)
def _(lhs: QuantizedArray, rhs: jax.typing.ArrayLike, **params: Any) -> Any:
    return quantized_dot_general(lhs.q, rhs, lhs.q, True, params)


@quax.register(lax.dot_general_p)
def _(lhs: jax.typing.ArrayLike, rhs: QuantizedArray, **params: Any) -> Any:
    return quantized_dot_general(lhs, rhs.q, rhs.q, False, params)


def wrap_quantized(params: Any) -> Any:
    """Wraps every ``QArray`` leaf of ``params`` as a :class:`QuantizedArray` (for quaxify)."""
    return jax.tree.map(
        lambda x: QuantizedArray(x) if is_quantized(x) else x,
        params,
        is_leaf=lambda x: is_quantized(x) or isinstance(x, quax.ArrayValue),
    )


def has_quantized(params: Any) -> bool:
    return any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=paths.is_param_leaf))
