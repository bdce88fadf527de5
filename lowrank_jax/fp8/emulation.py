"""FP8 format emulation: the formats, scaled quantise-dequantise, overflow counts.

A scaled FP8 cast of a float tensor ``x`` with scale ``s`` stores ``q = cast_fp8(clip(x·s, ±R))``
and reads back ``q / s``; ``R`` is the largest finite value of the format (E4M3: 448, E5M2:
57344). This module simulates that round trip in float32 (or the input's float dtype) with JAX's
``float8_e4m3fn`` / ``float8_e5m2`` dtypes, so FP8 numerics can be studied on any backend.

Scale convention everywhere in :mod:`lowrank_jax.fp8`: the quantised value is ``cast(x · s)`` and
the dequantised value ``cast(x · s) / s`` (Transformer Engine's ``scale``; Flax's ``fp8_ops``
stores ``1/s``).

References:
    Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433 (E4M3 / E5M2);
    NVIDIA Transformer Engine (scaled casts, saturation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "FP8_FORMATS",
    "fp8_dtype",
    "fp8_max",
    "fp8_overflow_count",
    "fp8_quantize_dequantize",
]

FP8_FORMATS = {
    "e4m3": (jnp.float8_e4m3fn, 448.0),
    "e5m2": (jnp.float8_e5m2, 57344.0),
}


def _fmt(fmt: str) -> str:
    if not isinstance(fmt, str):
        fmt = jnp.dtype(fmt).name
    key = fmt.lower().replace("float8_", "").replace("fn", "")
    if key not in FP8_FORMATS:
        raise ValueError(f"Unknown FP8 format {fmt!r}; use one of {sorted(FP8_FORMATS)}.")
    return key


def fp8_max(fmt: str = "e4m3") -> float:
    """Largest finite value ``R`` of an FP8 format: 448 for ``"e4m3"``, 57344 for ``"e5m2"``.

    Args:
        fmt: ``"e4m3"``, ``"e5m2"`` or a JAX FP8 dtype (``jnp.float8_e4m3fn``).

    Raises:
        ValueError: on an unknown format.
    """
    return FP8_FORMATS[_fmt(fmt)][1]


def fp8_dtype(fmt: str = "e4m3") -> jnp.dtype:
    """The JAX dtype of an FP8 format (``float8_e4m3fn`` or ``float8_e5m2``)."""
    return jnp.dtype(FP8_FORMATS[_fmt(fmt)][0])


def fp8_quantize_dequantize(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike,
    *,
    fmt: str = "e4m3",
    saturate: bool = True,
) -> jax.Array:
    """Simulated FP8: ``cast_fp8(x · s) / s`` in ``x``'s float dtype.

    Args:
        x: values (e.g. ``(b, H, n, n)`` attention logits).
        scale: scales broadcastable to ``x`` (e.g. ``(H, 1, 1)``).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        saturate: clip ``x · s`` to ``[−R, R]`` before the cast (what FP8 kernels do). With
            ``False`` an overflow becomes NaN for E4M3 (no infinities) and inf for E5M2.

    Returns:
        The dequantised array, shape and dtype of ``x``. Gradients pass straight through the
        rounding (zero where saturated).

    Raises:
        TypeError: if ``x`` is not floating point.

    Example:
        >>> y = fp8_quantize_dequantize(jnp.array([1.0, 500.0]), 1.0)  # [1., 448.]
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating point, got {x.dtype}.")
    scale = jnp.asarray(scale, x.dtype)
    y = x * scale
    if saturate:
        r = fp8_max(fmt)
        y = jnp.clip(y, -r, r)
    q = y.astype(fp8_dtype(fmt)).astype(x.dtype)
    q = y + jax.lax.stop_gradient(q - y)  # straight-through estimator of the rounding
    return q / scale


def fp8_overflow_count(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike,
    *,
    fmt: str = "e4m3",
    rtol: float = 0.0,
    axis: int | tuple[int, ...] | None = None,
) -> jax.Array:
    """Number of entries with ``|x · s| > R (1 + rtol)`` (they saturate or become NaN).

    Args:
        x: values.
        scale: scales broadcastable to ``x``.
        fmt: FP8 format giving ``R``.
        rtol: relative tolerance, e.g. ``1e-5`` so that ``s = R/amax`` (current scaling) does not
            count its own maximum, which lands on ``R`` up to float32 rounding.
        axis: axes to count over (default all).

    Returns:
        int32 counts (scalar, or the remaining axes).
    """
    x = jnp.asarray(x)
    over = jnp.abs(x * jnp.asarray(scale, x.dtype)) > fp8_max(fmt) * (1.0 + rtol)
    return jnp.sum(over, axis=axis, dtype=jnp.int32)
