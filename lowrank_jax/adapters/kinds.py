"""Adapter kinds: what is added to a frozen kernel, and how it is applied without forming it.

Every kind works on the *matrix view* of a kernel: a kernel of shape ``(*stack, *in_shape,
*out_shape)`` is seen as ``stack`` copies of an ``(n, m)`` matrix with ``n = prod(in_shape)`` and
``m = prod(out_shape)``. A kind is a frozen (hashable, static) dataclass with

* ``init_factors(key, kernel) -> factors``: trainable arrays for one ``(n, m)`` matrix;
* ``apply_delta(factors, x, *, shape, key=None) -> (..., m)``: ``x @ ΔW`` for ``x`` of shape
  ``(..., n)``, computed factorised (``ΔW`` is never formed);
* ``apply_delta_transposed(factors, y, *, shape) -> (..., n)``: ``y @ ΔWᵀ`` (tied embeddings,
  ``x @ W.T``);
* ``materialize(factors, *, shape) -> (n, m)``: ``ΔW`` itself, for folding and export only;
* ``factor_specs(in_spec, out_spec)``: each factor's partitioning given the mesh axes of the
  kernel's input and output dimensions (for ``jax.sharding``);

so new kinds (FrameFT, spectral SBVI adapters) slot in beside :class:`LoRA`. A kind whose update
depends on the frozen kernel (DoRA, :mod:`lowrank_jax.adapters.dora`) sets ``needs_kernel = True``;
its ``apply_delta``, ``apply_delta_transposed`` and ``materialize`` then also take ``kernel=`` (the
``(n, m)`` matrix view), and ``apply_delta`` may take ``base = x @ W`` to reuse it. ``shape = (n, m)``
is the matrix view (``Adapter.matrix``); the callers pass it, so kinds whose trainable arrays do
not reveal ``m`` (FrameFT, FourierFT, VeRA) keep no shape record in their factors.

**Capabilities.** The code that treats kinds differently (the fused and quax forwards, PEFT
export, adapter banks, the merges) asks the kind, never its class; a kind subclasses
:class:`AdapterKind`, which gives every capability its default, and overrides the ones it has:

* ``needs_kernel: bool`` (default ``False``): the update depends on the frozen kernel (DoRA); see
  above. Merges then need the base parameters (``base=``) to form ``ΔW``.
* ``lowrank_factors(factors) -> (a, b, scale) | None`` (default ``None``): the *product form*
  ``ΔW = scale · a b`` with ``a: (..., n, r)``, ``b: (..., r, m)`` (stacked-layer axes in front),
  offered only when ``apply_delta`` is exactly ``scale · (dropout(x) a) b`` (rate ``dropout``).
  The fused LoRA matmul, the quax backend's embedding gather and convolution, adapter banks that
  mix ranks, PEFT's ``cat`` and task arithmetic without an ``n × m`` matrix read it (:class:`LoRA`).
* ``dropout: float`` (default ``0.0``): the rate of dropout on the adapter's input.
* ``peft_layout: str | None`` (default ``None``: not writable): how
  :func:`lowrank_jax.adapters.save_peft` writes the kind, ``"lora"`` (``lora_A``, ``lora_B`` from
  factors ``a``, ``b``) or ``"dora"`` (and ``lora_magnitude_vector`` from ``m``); such a kind has
  LoRA's ``rank``, ``alpha``, ``rslora`` and ``dropout``.

A new kind thus touches its own module only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal, Protocol

import jax
import jax.numpy as jnp

from lowrank_jax.spectral import svd

__all__ = [
    "AdapterKind",
    "LoRA",
    "LoraInit",
    "dropout",
    "lora",
    "matrix_dims",
]

LoraInit = Literal["kaiming", "gaussian", "pissa"]
_LORA_INITS = ("kaiming", "gaussian", "pissa")


def matrix_dims(shape: Any, kind: str = "this adapter kind") -> tuple[int, int]:
    """``(n, m)`` as ints from the ``shape`` argument of a kind method (``Adapter.matrix``).

    Raises:
      ValueError: ``shape`` is not an ``(n, m)`` pair (e.g. ``None`` from an ``Adapter`` built
        without ``matrix``).
    """
    if shape is None or len(shape) != 2:
        raise ValueError(
            f"{kind} needs the (n, m) matrix view of the kernel: pass shape=adapter.matrix "
            f"(got {shape!r})."
        )
    n, m = shape
    return int(n), int(m)


def dropout(x: jax.Array, key: jax.Array | None, rate: float) -> jax.Array:
    """Inverted dropout of an adapter's input: ``x`` itself when ``key`` is ``None`` or ``rate`` 0.

    Args:
      x: the input, any shape.
      key: PRNG key, or ``None`` (no dropout, e.g. at evaluation).
      rate: the probability of zeroing an entry, in ``[0, 1)``.

    Returns:
      ``x`` with entries zeroed with probability ``rate`` and the rest scaled by ``1/(1 − rate)``.
    """
    if key is None or rate <= 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class AdapterKind(Protocol):
    """The interface every adapter kind implements, and the capabilities' defaults (see the module
    docstring): subclass it to inherit them."""

    in_ndim: int | None
    out_ndim: int | None
    needs_kernel: ClassVar[bool] = False
    peft_layout: ClassVar[str | None] = None
    dropout: float = 0.0

    def lowrank_factors(
        self, factors: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array, float] | None:
        """``(a, b, scale)`` with ``ΔW = scale · a b``, or ``None`` (no product form)."""
        del factors
        return None

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]: ...

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int],
        key: jax.Array | None = None,
    ) -> jax.Array: ...

    def apply_delta_transposed(
        self, factors: dict[str, jax.Array], y: jax.Array, *, shape: tuple[int, int]
    ) -> jax.Array: ...

    def materialize(
        self, factors: dict[str, jax.Array], *, shape: tuple[int, int]
    ) -> jax.Array: ...

    def check_shape(self, n: int, m: int, path: str) -> None: ...

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]: ...


@dataclasses.dataclass(frozen=True)
class LoRA(AdapterKind):
    """Low-rank adaptation ``ΔW = s · A B`` with ``A: (n, r)``, ``B: (r, m)``.

    The adapted matmul is ``x @ W + s · ((dropout(x) @ A) @ B)`` with ``s = alpha / r`` (or
    ``alpha / sqrt(r)`` for rsLoRA). Initialisations:

    * ``"kaiming"``: ``A ~ U(-1/sqrt(n), 1/sqrt(n))`` (PyTorch's Kaiming-uniform with ``a=sqrt(5)``,
      PEFT's default), ``B = 0``: the adapted model starts equal to the base model.
    * ``"gaussian"``: ``A ~ N(0, 1/r²)``, ``B = 0`` (PEFT's ``init_lora_weights="gaussian"``).
    * ``"pissa"``: ``A = U_r sqrt(S_r / s)``, ``B = sqrt(S_r / s) V_rᵀ`` from the top-``r`` SVD
      ``W = U S Vᵀ``, so ``s · A B`` is the principal part of ``W``. Follow with
      ``params = unfold(params, adapters)`` to train on the residual ``W - s A B`` and start at the
      base model's function.

    Attributes:
      rank: ``r``, at most ``min(n, m)``.
      alpha: scale numerator; ``None`` means ``alpha = r`` (``s = 1``).
      rslora: rank-stabilised scaling ``s = alpha / sqrt(r)``.
      dropout: dropout rate on the adapter's input (active when a key is given to the forward).
      init: one of ``"kaiming"``, ``"gaussian"``, ``"pissa"``.
      in_ndim, out_ndim: how many kernel axes are inputs and outputs. ``None`` infers them for 2-D
        kernels; leading axes beyond ``in_ndim + out_ndim`` are stacked layers (``nn.scan``).
      dtype: dtype of the factors (``None``: the kernel's).

    References:
      Hu et al. 2021, LoRA; Kalajdzievski 2023, rsLoRA; Meng et al. 2024, PiSSA.
    """

    rank: int
    alpha: float | None = None
    rslora: bool = False
    dropout: float = 0.0
    init: LoraInit = "kaiming"
    in_ndim: int | None = None
    out_ndim: int | None = None
    dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora(rank=...) must be a positive int, got {self.rank!r}.")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"lora(alpha=...) must be positive or None, got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora(dropout=...) must be in [0, 1), got {self.dropout!r}.")
        if self.init not in _LORA_INITS:
            raise ValueError(f"lora(init=...) must be one of {_LORA_INITS}, got {self.init!r}.")
        for name in ("in_ndim", "out_ndim"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"lora({name}=...) must be a positive int or None, got {v!r}.")

    @property
    def scale(self) -> float:
        alpha = self.rank if self.alpha is None else self.alpha
        return alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_shape(self, n: int, m: int, path: str) -> None:
        if self.rank > min(n, m):
            raise ValueError(
                f"lora(rank={self.rank}) at {path!r} exceeds min(n, m) = {min(n, m)} of its "
                f"({n}, {m}) matrix view; use a rank of at most {min(n, m)} (a rule per layer "
                "can set its own rank)."
            )

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        n, m = kernel.shape
        dtype = jnp.dtype(self.dtype or kernel.dtype)
        if self.init == "pissa":
            a, b = svd.balanced_factors(
                kernel.astype(jnp.float32), rank=self.rank, scale=self.scale
            )
            return {"a": a.astype(dtype), "b": b.astype(dtype)}
        if self.init == "kaiming":
            bound = 1.0 / math.sqrt(n)
            a = jax.random.uniform(key, (n, self.rank), dtype, -bound, bound)
        else:
            a = jax.random.normal(key, (n, self.rank), dtype) / self.rank
        return {"a": a, "b": jnp.zeros((self.rank, m), dtype)}

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int] | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        del shape  # A and B carry it.
        x = dropout(x, key, self.dropout)
        a, b = factors["a"], factors["b"]
        return ((x.astype(a.dtype) @ a) @ b) * jnp.asarray(self.scale, a.dtype)

    def apply_delta_transposed(
        self, factors: dict[str, jax.Array], y: jax.Array, *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        del shape
        a, b = factors["a"], factors["b"]
        return ((y.astype(b.dtype) @ b.T) @ a.T) * jnp.asarray(self.scale, a.dtype)

    def materialize(
        self, factors: dict[str, jax.Array], *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        del shape
        return (factors["a"] @ factors["b"]) * jnp.asarray(self.scale, factors["a"].dtype)

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {"a": (in_spec, None), "b": (None, out_spec)}

    peft_layout: ClassVar[str | None] = "lora"

    def lowrank_factors(
        self, factors: dict[str, jax.Array]
    ) -> tuple[jax.Array, jax.Array, float] | None:
        return factors["a"], factors["b"], self.scale


def lora(
    rank: int,
    *,
    alpha: float | None = None,
    rslora: bool = False,
    dropout: float = 0.0,
    init: LoraInit = "kaiming",
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> LoRA:
    """A LoRA spec for a target rule: ``(r".*query/kernel", lora(rank=8, alpha=16))``.

    See :class:`LoRA` for the arguments and the maths.
    """
    return LoRA(
        rank=rank,
        alpha=alpha,
        rslora=rslora,
        dropout=dropout,
        init=init,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=None if dtype is None else jnp.dtype(dtype).name,
    )
