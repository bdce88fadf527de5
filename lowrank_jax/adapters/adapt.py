"""``adapt``: turn a model's apply function into one that takes adapters, computed factorised."""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import quax

from lowrank_jax.adapters import fused, mixed, quant
from lowrank_jax.adapters.core import Adapter, group_by_path, map_adapted
from lowrank_jax.adapters.quax_backend import wrap_kernel

__all__ = [
    "Backend",
    "LoraMatmul",
    "adapt",
]

Backend = Literal["quax", "linen"]
LoraMatmul = Literal["factorised", "fused"]


def _dropout_keys(key: jax.Array | None, path: str, adapters: list[Adapter], shape: tuple) -> list:
    if key is None:
        return [None] * len(adapters)
    out = []
    for i, a in enumerate(adapters):
        k = jax.random.fold_in(jax.random.fold_in(key, zlib.crc32(path.encode())), i)
        stack = shape[: len(shape) - a.in_ndim - a.out_ndim]
        out.append(jax.random.split(k, stack) if stack else k)
    return out


def _wrap_params(
    params: Any, adapters: Any, key: jax.Array | None, allow_dense: bool, fuse: bool = False
) -> Any:
    def wrap(path, leaf, ads):
        keys = _dropout_keys(key, path, ads, leaf.shape)
        return wrap_kernel(leaf, ads, keys, path, allow_dense, fused=fuse)

    # Quantised kernels that no adapter targets become quax values too (int8 matmul rule).
    return quant.wrap_quantized(map_adapted(params, adapters, wrap))


def _check_found(by_path: dict, found: set, what: str) -> None:
    missing = sorted(set(by_path) - found)
    if missing:
        raise ValueError(f"adapters for {missing} {what}; were they made for these params?")


def _linen_delta(module: nn.Module, x: jax.Array, ads: list, keys: list, path: str) -> jax.Array:
    """``x·ΔW`` for a linen Dense / DenseGeneral call, arranged like the layer's output."""
    if isinstance(module, nn.Dense):
        axes = (x.ndim - 1,)
    elif isinstance(module, nn.DenseGeneral) and not module.batch_dims:
        axis = module.axis if isinstance(module.axis, tuple | list) else (module.axis,)
        axes = tuple(a % x.ndim for a in axis)
    else:
        raise NotImplementedError(
            f"the linen backend has no factorised rule for {type(module).__name__} at {path!r}; "
            "use adapt(..., backend='quax')."
        )
    x = jnp.moveaxis(x, axes, range(x.ndim - len(axes), x.ndim))
    free = x.shape[: x.ndim - len(axes)]
    x = jnp.reshape(x, (math.prod(free), -1))  # 2-D: XLA:CPU then needs no transposed cotangent
    total = sum(
        a.kind.apply_delta(a.factors, x, shape=a.matrix, key=k)
        for a, k in zip(ads, keys, strict=True)
    )
    return jnp.reshape(total, (*free, -1))


def _is_stacked(adapter: Adapter, kernel_shape: tuple[int, ...]) -> bool:
    """Whether the factors carry layer axes that the kernel seen by the layer does not."""
    stack, n, m = adapter.matrix_shape(kernel_shape)
    one = jax.eval_shape(
        adapter.kind.init_factors, jax.random.key(0), jax.ShapeDtypeStruct((n, m), jnp.float32)
    )
    return any(
        f.ndim != len(stack) + o.ndim
        for f, o in zip(jax.tree.leaves(adapter.factors), jax.tree.leaves(one), strict=True)
    )


def _linen_fused(module: nn.Dense, x: jax.Array, ads: list) -> jax.Array:
    """``nn.Dense``'s output with the fused LoRA product ``x·(W + Σ sAB) + bias``."""
    kernel = module.variables["params"]["kernel"]
    bias = module.variables["params"].get("bias") if module.use_bias else None
    x, _, bias = module.promote_dtype(x, jnp.zeros((), kernel.dtype), bias, dtype=module.dtype)
    n, m = kernel.shape
    y = fused.apply_fused(jnp.reshape(x, (-1, n)), kernel, ads, n, m)
    y = jnp.reshape(y, (*x.shape[:-1], m)).astype(x.dtype)
    return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def _linen_apply(apply_fn, params, by_path, key, allow_dense, args, kwargs, fuse=False):
    if allow_dense:
        raise ValueError("allow_dense applies to backend='quax' only.")
    hit: set[str] = set()
    fuse = fuse and not quant.has_quantized(params)  # int8 under linen: quaxify, factorised

    def interceptor(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.Dense | nn.DenseGeneral):
            return next_fun(*call_args, **call_kwargs)
        path = "/".join(("params", *module.path, "kernel"))
        if path not in by_path:
            return next_fun(*call_args, **call_kwargs)
        hit.add(path)
        ads = by_path[path]
        shape = module.variables["params"]["kernel"].shape
        keys = _dropout_keys(key, path, ads, shape)
        if fuse and type(module) is nn.Dense and len(shape) == 2 and fused.fusable(ads, keys):
            return _linen_fused(module, call_args[0], ads)
        y = next_fun(*call_args, **call_kwargs)
        if any(_is_stacked(a, shape) for a in ads):
            raise NotImplementedError(
                f"{path!r} is a stacked kernel (nn.scan); use adapt(..., backend='quax')."
            )
        d = _linen_delta(module, call_args[0], ads, keys, path)
        return y + jnp.reshape(d, y.shape).astype(y.dtype)

    with nn.intercept_methods(interceptor):
        if quant.has_quantized(params):  # int8 kernels: their matmul rule is a quax rule
            out = quax.quaxify(apply_fn)(quant.wrap_quantized(params), *args, **kwargs)
        else:
            out = apply_fn(params, *args, **kwargs)
    _check_found(
        by_path,
        hit,
        "were never used by a linen Dense/DenseGeneral call, so the linen backend cannot apply "
        "them (use backend='quax')",
    )
    return out


def adapt(
    apply_fn: Callable[..., Any],
    *,
    backend: Backend = "quax",
    allow_dense: bool = False,
    lora_matmul: LoraMatmul = "factorised",
) -> Callable[..., Any]:
    """Makes ``apply_fn(params, *args, **kw)`` into ``adapted(params, adapters, *args, **kw)``.

    At every matmul with a targeted kernel the adapted function computes
    ``x @ W + Σ_adapters apply_delta(x)`` (for LoRA ``x @ W + s·((x @ A) @ B)``); neither ``ΔW`` nor
    a gradient of its size is formed, so ``jax.grad`` with respect to ``adapters`` costs
    ``O(r·(n + m))`` per kernel beyond the frozen forward/backward.

    Args:
      apply_fn: a function of a parameter pytree first: a linen ``model.apply`` (params are the
        variables dict), ``lambda state, x: nnx.merge(graphdef, state)(x)``, or any JAX function.
      backend: ``"quax"`` (default) works for any function, under ``jit``, ``grad``, ``vmap``,
        ``lax.scan``/``nn.scan`` over stacked kernels and ``remat``; ``"linen"`` intercepts linen
        ``Dense``/``DenseGeneral`` calls with ``nn.intercept_methods`` (linen only, no ``nn.scan``).
      allow_dense: with ``"quax"``, let operations that have no factorised rule use the
        materialised ``W + ΔW`` instead of raising.
      lora_matmul: ``"factorised"`` (default) computes ``x·W + s·(x·A)·B``; ``"fused"`` computes
        LoRA-only kernels without active dropout as ``x·(W + s·A·B)`` with the hand-written
        backward of ``lowrank_jax.adapters.fused.lora_matmul``: the same values and adapter
        gradients, one token-sized product per projection instead of two (less XLA temp memory,
        no weight gradient; it forms the ``(n, m)`` sum ``W + sAB`` as a temporary). Other kernels
        (other kinds, dropout keys, stacked or transposed uses, linen ``DenseGeneral``, int8
        kernels under the linen backend) stay factorised.

    Returns:
      ``adapted(params, adapters, *args, adapter_key=None, adapter_ids=None, **kwargs)``;
      ``adapters`` is one set from :func:`init`, a list of sets or ``{name: set}`` (their
      updates add up), and ``adapter_key`` (a PRNG key) switches adapter dropout on. With
      ``adapter_ids`` (``(b,)`` ints), ``adapters`` is a bank from :func:`stack_adapters` and
      example ``i`` of the batch gets adapter ``adapter_ids[i]`` (:func:`select_adapters`; the
      batch must lead every adapted matmul's input).

    Raises:
      ValueError: unknown backend; adapters whose paths are not in ``params``.
      NotImplementedError: at trace time, a targeted kernel reaches an operation with no
        factorised rule (and ``allow_dense`` is off).

    Example:
      >>> fwd = adapt(model.apply)
      >>> logits = fwd(variables, adapters, tokens)
      >>> grads = jax.grad(lambda ad: loss(fwd(variables, ad, tokens)))(adapters)
    """
    if backend not in ("quax", "linen"):
        raise ValueError(f"backend must be 'quax' or 'linen', got {backend!r}.")
    if lora_matmul not in ("factorised", "fused"):
        raise ValueError(f"lora_matmul must be 'factorised' or 'fused', got {lora_matmul!r}.")
    fuse = lora_matmul == "fused"

    @functools.wraps(apply_fn)
    def adapted(params, adapters, *args, adapter_key=None, adapter_ids=None, **kwargs):
        if adapter_ids is not None:  # a bank from stack_adapters, one adapter per example
            adapters = mixed.select_adapters(adapters, adapter_ids)
        if backend == "linen":
            by_path = group_by_path(adapters)
            return _linen_apply(
                apply_fn, params, by_path, adapter_key, allow_dense, args, kwargs, fuse
            )
        wrapped = _wrap_params(params, adapters, adapter_key, allow_dense, fuse)
        return quax.quaxify(apply_fn)(wrapped, *args, **kwargs)

    return adapted
