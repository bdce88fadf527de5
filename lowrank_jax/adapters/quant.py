"""Low-precision frozen bases: bfloat16 kernels, or 8-bit weight-only quantised kernels (QLoRA-style).

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
  :func:`lowrank_jax.adapters.merge` dequantises (``W ≈ Q·diag(s)``) and returns float32 kernels.

Quantisation uses `qwix <https://github.com/google/qwix>`_ (Google's JAX quantisation library) for
the numerics and the ``QArray`` container. Its own weight-only ``qwix.dot_general`` dequantises the
whole kernel before the matmul; here the rescale is applied to the output instead (no float copy
of ``W`` is formed beyond XLA's int8→float convert), and the rule is a ``quax`` rule so that it
composes with the factorised adapter path of :func:`lowrank_jax.adapters.adapt` (which rewrites
the same ``dot_general``).

The absmax error bound per entry is ``|W_ij − s_j·Q_ij| ≤ s_j / 2``.

References:
  Dettmers et al. 2022, LLM.int8(); Dettmers et al. 2023, QLoRA (4-bit NF4 there, 8-bit absmax
  per channel here).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import quax
from jax import lax

from lowrank_jax.adapters import paths

BaseDtype = Literal["float32", "bfloat16", "int8"]
BASE_DTYPES = ("float32", "bfloat16", "int8")
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


def low_precision_base(
    params: Any, base_dtype: BaseDtype, *, patterns: Sequence[str] = DEFAULT_PATTERNS
) -> Any:
    """Stores the frozen kernels of ``params`` in ``base_dtype``.

    Args:
      params: a (frozen) parameter pytree; leaves that are ``None`` are left alone.
      base_dtype: ``"float32"`` (unchanged), ``"bfloat16"`` (cast) or ``"int8"`` (per-channel
        absmax ``qwix.QArray``, see the module docstring).
      patterns: full-match regexes over '/'-joined paths; matching floating leaves with at least
        two axes are converted (default: every ``kernel``; embeddings, biases and norms stay).

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
    """Bytes held by a parameter pytree (quantised kernels count their int8 values and scales)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


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


def quantized_dot_general(lhs: Any, rhs: Any, q: Any, q_is_lhs: bool, params: dict) -> jax.Array:
    """``dot_general`` with one operand a ``QArray``: ``(x·Q)·diag(s)`` when the scale is free."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    other = rhs if q_is_lhs else lhs
    contract = lc if q_is_lhs else rc
    scale = None
    if not (lb or rb):
        scale = _scale_for_output(q, q_is_lhs, contract, other.ndim, len(contract))
    if scale is None:
        w = dequantize(q)
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
