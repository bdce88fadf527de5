"""Generic backend: adapted kernels as ``quax`` array values with factorised matmul rules.

Each targeted kernel is replaced by an :class:`AdaptedArray` that carries the frozen ``W`` and the
adapters' factors. Inside ``quax.quaxify(apply_fn)``, a ``dot_general`` that contracts the kernel's
input axes becomes ``x·W + Σ apply_delta(x)`` (and one that contracts its output axes, as in
``x @ E.T``, the transposed form); dtype casts cast every part; ``scan``, ``cond``, ``while`` and
``jit`` are traced through by quax (stacked layers are sliced factor by factor). Any other
operation on an adapted kernel raises, unless ``allow_dense=True`` lets it fall back to the
materialised ``W + ΔW``. No full-size ``ΔW`` nor its gradient is ever formed on the factorised path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import quax
from jax import lax

from lowrank_jax.adapters import fused, quant
from lowrank_jax.adapters.core import Adapter, delta, needs_kernel
from lowrank_jax.adapters.kinds import dropout

__all__ = [
    "AdaptedArray",
    "wrap_kernel",
]


class AdaptedArray(quax.ArrayValue):
    """A frozen kernel ``w`` plus adapters, seen by JAX as an array of ``w``'s shape and dtype.

    ``w`` may be a quantised ``qwix.QArray`` (:mod:`lowrank_jax.adapters.quant`); its dtype is then
    the scale's (float32) and the base matmul is ``(x·Q)·diag(s)``. A floating cast is recorded
    in ``dtype`` and applied where ``w`` is used, so a bfloat16 kernel promoted to float32 by a
    layer is never stored as a float32 copy between forward and backward. ``fused``: LoRA-only
    kernels take :func:`lowrank_jax.adapters.fused.lora_matmul`.
    """

    w: Any
    adapters: tuple[Adapter, ...]
    keys: tuple[jax.Array | None, ...]
    path: str = eqx.field(static=True)
    allow_dense: bool = eqx.field(static=True)
    transposed: bool = eqx.field(static=True, default=False)
    fused: bool = eqx.field(static=True, default=False)
    dtype_: str | None = eqx.field(static=True, default=None)

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.w.shape, self.dtype_ or self.w.dtype)

    def base(self) -> Any:
        """The frozen kernel in its logical dtype (a ``QArray`` stays quantised)."""
        if self.dtype_ is None or quant.is_quantized(self.w):
            return self.w
        return self.w.astype(self.dtype_)

    def materialise(self) -> jax.Array:
        if not self.allow_dense:
            raise NotImplementedError(
                f"the adapted kernel {self.path!r} reached an operation that has no factorised "
                "rule (only matmuls over its input or output axes and dtype casts have one). "
                "Target only kernels used in matmuls, or pass allow_dense=True to adapt(...) to "
                "materialise W + ΔW for such operations (this forms the full-size update)."
            )
        stack, first, second = self.blocks()
        perm = (*range(stack), *second, *first) if self.transposed else tuple(range(self.ndim))
        shape = tuple(self.w.shape[p] for p in perm)  # the kernel's shape before transposition
        total = quant.dequantize(self.base())
        kernel = jnp.transpose(total, np.argsort(perm))  # as before transposition
        for a in self.adapters:
            total = total + jnp.transpose(delta(a, shape, kernel), perm).astype(total.dtype)
        return total

    def kernel_matrix(self) -> jax.Array:
        """The frozen kernel's ``(n, m)`` matrix view (unstacked kernels; dequantised)."""
        n, m = self.adapters[0].matrix
        dense = quant.dequantize(self.base())
        return jnp.reshape(dense, (m, n)).T if self.transposed else jnp.reshape(dense, (n, m))

    def blocks(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Number of stacked axes, then the axes of the first and second block after them.

        The first block holds the kernel's input axes, or its output axes when ``transposed``.
        """
        a = self.adapters[0]
        stack = self.w.ndim - a.in_ndim - a.out_ndim
        k = a.out_ndim if self.transposed else a.in_ndim
        return stack, tuple(range(stack, stack + k)), tuple(range(stack + k, self.w.ndim))


def _flatten_input(x: jax.Array, xc, wc, axes) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` with its contracted axes last, in the kernel's order ``axes``, as a 2-D array
    ``(tokens, n)`` (2-D: XLA:CPU then needs no transposed cotangent); and the free shape."""
    pair = dict(zip(wc, xc, strict=True))
    x_contract = [pair[ax] for ax in axes]
    x = jnp.moveaxis(x, x_contract, range(x.ndim - len(x_contract), x.ndim))
    free = x.shape[: x.ndim - len(x_contract)]
    return jnp.reshape(x, (math.prod(free), -1)), free


def _delta_matmul(
    lhs: Any,
    rhs: Any,
    w: AdaptedArray,
    w_is_lhs: bool,
    dimension_numbers: Any,
    base: jax.Array | None = None,
    whole: bool = False,
    with_flag: bool = False,
) -> Any:
    """``x·ΔW`` arranged like ``dot_general``'s output, or ``None`` if there is no rule.

    ``base`` (the frozen product ``x·W`` as ``dot_general`` arranges it) is handed to kinds that
    rescale it (DoRA), so they do not recompute it; with ``whole`` (one such adapter) the kind
    returns ``x·W + x·ΔW`` itself (DoRA: ``c ⊙ (x·W + s·(x·A)·B)``, one token-sized sum kept for
    the backward instead of two). ``with_flag``: return ``(result, includes_base)``."""
    (lc, rc), (lb, rb) = dimension_numbers
    x = rhs if w_is_lhs else lhs
    xc, wc = (rc, lc) if w_is_lhs else (lc, rc)
    if lb or rb:
        return None
    stack, first, second = w.blocks()
    if stack:
        return None
    if sorted(wc) == list(first):
        transposed, axes, result_axes = w.transposed, first, second
    elif sorted(wc) == list(second):
        transposed, axes, result_axes = not w.transposed, second, first
    else:
        return None
    x, free = _flatten_input(x, xc, wc, axes)
    result_shape = tuple(w.w.shape[ax] for ax in result_axes)
    total, includes_base = None, False
    for adapter, key in zip(w.adapters, w.keys, strict=True):
        extra = {}
        if needs_kernel(adapter):  # DoRA: the frozen kernel's matrix view and x·W
            extra["kernel"] = w.kernel_matrix()
            if not transposed and base is not None:
                b = jnp.moveaxis(base, range(len(result_shape)), range(-len(result_shape), 0))
                extra["base"] = jnp.reshape(b if w_is_lhs else base, (x.shape[0], -1))
                extra["whole"] = includes_base = whole
        if transposed:
            d = adapter.kind.apply_delta_transposed(
                adapter.factors, x, shape=adapter.matrix, **extra
            )
        else:
            d = adapter.kind.apply_delta(adapter.factors, x, shape=adapter.matrix, key=key, **extra)
        total = d if total is None else total + d
    total = jnp.reshape(total, (*free, *result_shape))
    if w_is_lhs:  # dot_general puts the kernel's free axes first.
        total = jnp.moveaxis(total, range(len(free), total.ndim), range(len(result_shape)))
    return (total, includes_base) if with_flag else total


def _fused_matmul(
    lhs: Any, rhs: Any, w: AdaptedArray, w_is_lhs: bool, dimension_numbers: Any
) -> jax.Array | None:
    """The whole adapted product ``x·(W + Σ sAB)`` via the fused custom_vjp, or ``None``."""
    (lc, rc), (lb, rb) = dimension_numbers
    x = rhs if w_is_lhs else lhs
    xc, wc = (rc, lc) if w_is_lhs else (lc, rc)
    stack, first, second = w.blocks()
    if lb or rb or stack or w.transposed or sorted(wc) != list(first):
        return None
    if not fused.fusable(w.adapters, w.keys):
        return None
    x, free = _flatten_input(x, xc, wc, first)
    n, m = (math.prod(w.w.shape[ax] for ax in block) for block in (first, second))
    y = fused.apply_fused(x, w.w, w.adapters, n, m)  # casts the kernel inside (lazy dtype)
    y = jnp.reshape(y, (*free, *(w.w.shape[ax] for ax in second)))
    if w_is_lhs:
        y = jnp.moveaxis(y, range(len(free), y.ndim), range(len(second)))
    return y


def _base_matmul(lhs: Any, rhs: Any, w: Any, w_is_lhs: bool, params: dict) -> jax.Array:
    """``dot_general`` with the frozen kernel ``w`` (a float array or a quantised ``QArray``)."""
    if quant.is_quantized(w):
        return quant.quantized_dot_general(lhs, rhs, w, w_is_lhs, params)
    return lax.dot_general_p.bind(*((w, rhs) if w_is_lhs else (lhs, w)), **params)


def _dot_general(lhs: Any, rhs: Any, w: AdaptedArray, w_is_lhs: bool, params: dict) -> Any:
    dn = params["dimension_numbers"]
    if w.fused:
        y = _fused_matmul(lhs, rhs, w, w_is_lhs, dn)
        if y is not None:
            out_dtype = params.get("preferred_element_type") or jnp.result_type(lhs, rhs)
            return y.astype(out_dtype)
    if not any(needs_kernel(a) for a in w.adapters):
        d = _delta_matmul(lhs, rhs, w, w_is_lhs, dn)
        if d is None:
            dense = w.materialise()  # raises unless allow_dense
            return lax.dot_general_p.bind(*((dense, rhs) if w_is_lhs else (lhs, dense)), **params)
        base = _base_matmul(lhs, rhs, w.base(), w_is_lhs, params)
        return base + d.astype(base.dtype)
    base = _base_matmul(lhs, rhs, w.base(), w_is_lhs, params)
    whole = len(w.adapters) == 1
    d = _delta_matmul(lhs, rhs, w, w_is_lhs, dn, base, whole, with_flag=True)
    if d is None:
        dense = w.materialise()  # raises unless allow_dense
        return lax.dot_general_p.bind(*((dense, rhs) if w_is_lhs else (lhs, dense)), **params)
    d, includes_base = d
    return d.astype(base.dtype) if includes_base else base + d.astype(base.dtype)


@quax.register(lax.dot_general_p)
def _(lhs: AdaptedArray, rhs: jax.typing.ArrayLike, **params: Any) -> Any:
    return _dot_general(lhs, rhs, lhs, True, params)


@quax.register(lax.dot_general_p)
def _(lhs: jax.typing.ArrayLike, rhs: AdaptedArray, **params: Any) -> Any:
    return _dot_general(lhs, rhs, rhs, False, params)


@quax.register(lax.dot_general_p)
def _(lhs: AdaptedArray, rhs: AdaptedArray, **params: Any) -> Any:
    return lax.dot_general_p.bind(lhs.materialise(), rhs.materialise(), **params)


def _lora_only(w: AdaptedArray) -> bool:
    return (
        not w.blocks()[0]
        and not w.transposed
        and all(a.kind.lowrank_factors(a.factors) is not None for a in w.adapters)
    )


@quax.register(lax.gather_p)
def _(operand: AdaptedArray, indices: jax.typing.ArrayLike, **params: Any) -> Any:
    """Embedding lookup ``W[ids]`` (rows of the kernel) as ``W[ids] + Σ s·A[ids]·B`` (PEFT's
    embedding LoRA); any other gather of an adapted kernel materialises (``allow_dense``)."""
    dn, sizes = params["dimension_numbers"], params["slice_sizes"]
    w = operand
    rows = (
        w.ndim == 2
        and _lora_only(w)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not dn.operand_batching_dims
        and tuple(sizes) == (1, w.shape[1])
    )
    if not rows:
        return lax.gather_p.bind(w.materialise(), indices, **params)
    out = lax.gather_p.bind(quant.dequantize(w.base()), indices, **params)
    for ad in w.adapters:
        a, b, scale = ad.kind.lowrank_factors(ad.factors)
        picked = lax.gather_p.bind(a, indices, **{**params, "slice_sizes": (1, a.shape[1])})
        d = (picked @ b) * jnp.asarray(scale, a.dtype)  # (..., r) -> (..., m)
        out = out + d.astype(out.dtype)
    return out


@quax.register(lax.conv_general_dilated_p)
def _(lhs: jax.typing.ArrayLike, rhs: AdaptedArray, **params: Any) -> Any:
    """A convolution with an adapted kernel in flax's layout ``(*window, in, out)`` as
    ``conv(x, W) + Σ s·conv(dropout(x), A)·B`` with ``A`` reshaped to ``(*window, in, r)``: PEFT's
    Conv LoRA (``lora_A`` a convolution to ``r`` channels, ``lora_B`` a 1×1 one)."""
    w = rhs
    dn = params["dimension_numbers"]
    flax_layout = (
        _lora_only(w)
        and tuple(dn.rhs_spec[:2]) == (w.ndim - 1, w.ndim - 2)
        and all(a.out_ndim == 1 for a in w.adapters)
        and params["feature_group_count"] == 1
        and params["batch_group_count"] == 1
    )
    if not flax_layout:
        return lax.conv_general_dilated_p.bind(lhs, w.materialise(), **params)
    out = lax.conv_general_dilated_p.bind(lhs, quant.dequantize(w.base()), **params)
    feature = dn.out_spec[1]
    for ad, key in zip(w.adapters, w.keys, strict=True):
        a, b, scale = ad.kind.lowrank_factors(ad.factors)
        x = dropout(jnp.asarray(lhs), key, ad.kind.dropout).astype(a.dtype)
        kernel_a = jnp.reshape(a, (*w.shape[:-1], a.shape[-1]))
        u = lax.conv_general_dilated_p.bind(
            x, kernel_a, **{**params, "preferred_element_type": None}
        )
        u = jnp.moveaxis(u, feature, -1)
        d = (u @ b) * jnp.asarray(scale, a.dtype)
        out = out + jnp.moveaxis(d, -1, feature).astype(out.dtype)
    return out


@quax.register(lax.convert_element_type_p)
def _(x: AdaptedArray, *, new_dtype: Any, **params: Any) -> AdaptedArray:
    cast = lambda a: lax.convert_element_type_p.bind(a, new_dtype=new_dtype, **params)
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return cast(x.materialise())

    def cast_float(a):  # integer factors (a bank's adapter ids) keep their dtype
        return cast(a) if jnp.issubdtype(a.dtype, jnp.floating) else a

    adapters = tuple(a.replace(factors=jax.tree.map(cast_float, a.factors)) for a in x.adapters)
    if quant.is_quantized(x.w):  # a QArray's dtype is its scale's
        return dataclasses.replace(x, w=x.w.astype(new_dtype), adapters=adapters)
    # Lazy: the kernel is cast where it is used (see AdaptedArray).
    return dataclasses.replace(x, adapters=adapters, dtype_=jnp.dtype(new_dtype).name)


@quax.register(lax.transpose_p)
def _(x: AdaptedArray, *, permutation: tuple[int, ...]) -> Any:
    stack, first, second = x.blocks()
    if tuple(permutation) == tuple(range(x.ndim)):
        return x
    if tuple(permutation) == (*range(stack), *second, *first):
        w = (
            x.w.transpose(permutation)
            if quant.is_quantized(x.w)
            else lax.transpose(x.w, permutation)
        )
        return dataclasses.replace(x, w=w, transposed=not x.transposed)
    return lax.transpose(x.materialise(), permutation)


@quax.register(lax.copy_p)
def _(x: AdaptedArray, **params: Any) -> AdaptedArray:
    return x


def _checkpoint_rule(*args: Any, jaxpr: Any, prevent_cse: bool, policy: Any, **_: Any) -> Any:
    body = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, ()))
    fn = jax.checkpoint(quax.quaxify(body), prevent_cse=prevent_cse, policy=policy)
    return fn(*args)


def _register_checkpoint() -> None:
    """``jax.checkpoint``/``nn.remat`` bodies are re-traced with the quax rules inside."""
    from jax._src.ad_checkpoint import remat_p  # the primitive behind jax.checkpoint

    quax.register(remat_p)(_checkpoint_rule)


_register_checkpoint()


def wrap_kernel(
    w: jax.Array,
    adapters: list[Adapter],
    keys: list[jax.Array | None],
    path: str,
    allow_dense: bool,
    fused: bool = False,
) -> AdaptedArray:
    """Wraps one kernel; checks that all adapters on it agree on its layout."""
    layouts = {(a.in_ndim, a.out_ndim) for a in adapters}
    if len(layouts) != 1:
        raise ValueError(f"adapters on {path!r} disagree on its axis layout: {sorted(layouts)}.")
    for a in adapters:
        stack, n, m = a.matrix_shape(w.shape)
        leading = {f.shape[: len(stack)] for f in jax.tree.leaves(a.factors)}
        if leading - {stack} or math.prod(w.shape) != math.prod(stack) * n * m:
            raise ValueError(
                f"adapter factors for {path!r} do not fit its kernel of shape {w.shape}; were they "
                "made with adapters.init on these params?"
            )
    return AdaptedArray(w, tuple(adapters), tuple(keys), path, allow_dense, fused=fused)
