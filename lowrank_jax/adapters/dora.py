r"""DoRA: weight-decomposed low-rank adaptation, a magnitude vector times a LoRA direction.

The adapted kernel (matrix view ``W: (n, m)``, column ``j`` feeds output ``j``) is

    W' = (W + s·A B) · diag(c),     c = mag / ‖W + s·A B‖_col,

with ``A: (n, r)``, ``B: (r, m)``, ``s`` LoRA's scale and ``mag: (m,)`` a trainable magnitude per
output, initialised to ``‖W + s·A B‖_col`` (so the adapted model starts at the base model). The
column norm is treated as a constant in the backward pass (DoRA §4.3; PEFT's
``weight_norm.detach()``), so gradients reach ``mag`` through ``c`` and ``A``, ``B`` through the
LoRA product only.

In training nothing of size ``n·m`` is formed beyond what the frozen matmul reads. For ``x: (t, n)``
the adapted product is ``x·W' = c ⊙ (x·W + s·(x·A)·B)``; the kernel contributes
``(c − 1) ⊙ (x·W) + c ⊙ s·(x·A)·B`` on top of the frozen ``x·W``, which is reused (or recomputed
on the dropped-out input, as PEFT does, when dropout is active). The squared column norm expands as

    ‖W + s·A B‖²_j = ‖W_j‖² + 2s·Σ_k B_kj (AᵀW)_kj + s²·Σ_k B_kj (AᵀA B)_kj,

a fused column reduction of ``W``, the ``(r, m)`` product ``AᵀW`` (one rank-``r`` pass over the
frozen kernel, like ``r`` extra tokens) and the ``(r, r)`` Gram ``AᵀA``: memory ``O(r·(n + m))``.

Folding gives ``W ← (W + s·A B)·diag(c)``. It cannot be undone from the folded kernel alone (every
column of ``W'`` has norm ``|mag_j|`` whatever ``W`` was; PEFT caches the norms at fold time), so
:func:`unfold_dora` takes the norms :func:`dora_norms` computed from the unfolded parameters.

References:
  Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation" (ICML), Eq. (5) and §4.3; PEFT's
  ``DoraLinearLayer`` (``use_dora=True``; file key ``lora_magnitude_vector``). A PEFT adapter with
  several active DoRA adapters on one module feeds each the previous ones' output; here each DoRA
  adapter rescales the frozen kernel's product only (identical for one adapter per kernel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.core import Adapter, as_sets, delta, map_adapted
from lowrank_jax.adapters.kinds import AdapterKind, LoRA, LoraInit, dropout, lora

__all__ = ["DoRA", "dora", "dora_column_norms", "dora_norms", "unfold_dora"]


def dora_column_norms(
    kernel: jax.Array, a: jax.Array, b: jax.Array, *, scale: float | jax.Array
) -> jax.Array:
    """``‖W + s·A B‖`` over the input axis, per output column, without forming ``A B``.

    Args:
      kernel: ``W``, shape ``(n, m)``.
      a: ``A``, shape ``(n, r)``.
      b: ``B``, shape ``(r, m)``.
      scale: ``s``.

    Returns:
      ``(m,)`` column norms in the factors' dtype promoted with the kernel's (float32 for a
      bfloat16 kernel with float32 factors).
    """
    dtype = jnp.result_type(kernel.dtype, a.dtype)
    w, a, b = kernel.astype(dtype), a.astype(dtype), b.astype(dtype)
    s = jnp.asarray(scale, dtype)
    squares = jnp.sum(w * w, axis=0)
    cross = jnp.sum(b * (a.T @ w), axis=0)
    quad = jnp.sum(b * ((a.T @ a) @ b), axis=0)
    return jnp.sqrt(jnp.maximum(squares + 2 * s * cross + s * s * quad, 0))


@dataclasses.dataclass(frozen=True)
class DoRA(AdapterKind):
    """DoRA adapter: ``W' = (W + s·A B)·diag(mag / ‖W + s·A B‖_col)`` (see the module docstring).

    Factors ``{"a": (n, r), "b": (r, m), "m": (m,)}``; ``a``, ``b`` are a :class:`LoRA`'s (same
    initialisation, scale and dropout), ``m`` the magnitude. Unlike the additive kinds it needs the
    frozen kernel: ``apply_delta`` and ``materialize`` take ``kernel=`` (the ``(n, m)`` matrix view)
    and ``adapt``/``fold`` pass it (``needs_kernel``).

    Attributes:
      lora: the direction's LoRA spec (rank, alpha, rsLoRA, dropout, init, axis layout, dtype).
    """

    lora: LoRA
    needs_kernel: ClassVar[bool] = True
    peft_layout: ClassVar[str | None] = "dora"

    @property
    def in_ndim(self) -> int | None:
        return self.lora.in_ndim

    @property
    def out_ndim(self) -> int | None:
        return self.lora.out_ndim

    @property
    def rank(self) -> int:
        return self.lora.rank

    @property
    def scale(self) -> float:
        return self.lora.scale

    @property
    def alpha(self) -> float | None:
        return self.lora.alpha

    @property
    def rslora(self) -> bool:
        return self.lora.rslora

    @property
    def dropout(self) -> float:
        return self.lora.dropout

    def check_shape(self, n: int, m: int, path: str) -> None:
        self.lora.check_shape(n, m, path)

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        factors = self.lora.init_factors(key, kernel)
        mag = dora_column_norms(kernel, factors["a"], factors["b"], scale=self.scale)
        return {**factors, "m": mag.astype(factors["a"].dtype)}

    def _factor(self, factors: dict[str, jax.Array], kernel: jax.Array) -> jax.Array:
        """``c = mag / ‖W + s·A B‖_col``, the norm held constant for the gradient."""
        if kernel is None:
            raise ValueError(
                "DoRA needs the frozen kernel (kernel=, its (n, m) matrix view); apply it with "
                "adapters.adapt(..., backend='quax') and fold it with adapters.fold."
            )
        a, b, mag = factors["a"], factors["b"], factors["m"]
        norms = jax.lax.stop_gradient(dora_column_norms(kernel, a, b, scale=self.scale))
        return mag / norms.astype(mag.dtype)

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int] | None = None,
        key: jax.Array | None = None,
        kernel: jax.Array | None = None,
        base: jax.Array | None = None,
        whole: bool = False,
    ) -> jax.Array:
        """``x·W' − x·W = (c − 1) ⊙ (x_d·W) + c ⊙ s·(x_d·A)·B`` for ``x: (t, n)``, ``x_d`` the
        dropped-out input; ``base = x·W`` is reused when dropout is off. With ``whole`` (and
        ``base``), ``x·W'`` itself: ``c ⊙ (x·W + s·(x·A)·B)`` without dropout, which keeps one
        token-sized sum for the backward instead of ``x·W`` and the LoRA product apart."""
        c = self._factor(factors, kernel)
        given = base
        if key is not None and self.lora.dropout > 0.0:  # PEFT: x·W recomputed on dropout(x)
            x, base = dropout(x, key, self.lora.dropout), None
        if whole and given is None:
            raise ValueError("DoRA.apply_delta(..., whole=True) needs base = x·W.")
        if whole and base is not None:
            return c.astype(base.dtype) * (base + self.lora.apply_delta(factors, x))
        if base is None:
            base = x @ kernel.astype(x.dtype)
        delta = (c - 1).astype(base.dtype) * base + c * self.lora.apply_delta(factors, x)
        return given + delta if whole else delta

    def apply_delta_transposed(
        self,
        factors: dict[str, jax.Array],
        y: jax.Array,
        *,
        shape: tuple[int, int] | None = None,
        kernel: jax.Array | None = None,
    ) -> jax.Array:
        """``y·W'ᵀ − y·Wᵀ = (y ⊙ (c − 1))·Wᵀ + s·((y ⊙ c)·Bᵀ)·Aᵀ`` for ``y: (t, m)``."""
        c = self._factor(factors, kernel)
        y = y.astype(c.dtype)
        return (y * (c - 1)) @ kernel.astype(c.dtype).T + self.lora.apply_delta_transposed(
            factors, y * c
        )

    def materialize(
        self,
        factors: dict[str, jax.Array],
        *,
        shape: tuple[int, int] | None = None,
        kernel: jax.Array | None = None,
    ) -> jax.Array:
        """``ΔW = W' − W = (W + s·A B)·diag(c) − W`` (folding and export only)."""
        c = self._factor(factors, kernel)
        w = kernel.astype(c.dtype)
        return (w + self.lora.materialize(factors)) * c - w

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        return {**self.lora.factor_specs(in_spec, out_spec), "m": (out_spec,)}


def dora(
    rank: int,
    *,
    alpha: float | None = None,
    rslora: bool = False,
    dropout: float = 0.0,
    init: LoraInit = "kaiming",
    in_ndim: int | None = None,
    out_ndim: int | None = None,
    dtype: str | None = None,
) -> DoRA:
    """A DoRA spec for a target rule: ``(r".*query/kernel", dora(rank=8, alpha=16))``.

    The arguments are :func:`lowrank_jax.adapters.lora`'s (the direction); see :class:`DoRA`.

    Raises:
      ValueError: as :func:`lowrank_jax.adapters.lora` (a rank below 1, a negative alpha, ...).

    Example:
      >>> ad = init(key, variables, [(r".*(query|value)/kernel", dora(8, alpha=16.0))])
      >>> out = adapt(model.apply)(variables, ad, tokens)  # doctest: +SKIP
    """
    if init == "pissa":
        raise ValueError(
            "dora(init='pissa') is not supported: PiSSA moves the top singular part out of the "
            "frozen kernel, which DoRA's magnitude would then have to be taken after; use "
            "init='kaiming' or 'gaussian'."
        )
    direction = lora(
        rank,
        alpha=alpha,
        rslora=rslora,
        dropout=dropout,
        init=init,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        dtype=dtype,
    )
    return DoRA(lora=direction)


def _dora_adapters(adapters: Any) -> list[tuple[str, Adapter]]:
    return [(p, a) for s in as_sets(adapters) for p, a in s.items() if isinstance(a.kind, DoRA)]


def _stacked_norms(adapter: Adapter, kernel: jax.Array) -> jax.Array:
    """``‖W + s·A B‖_col`` for every stacked layer, shape ``(*stack, m)``."""
    stack, n, m = adapter.matrix_shape(kernel.shape)
    w = jnp.reshape(kernel, (-1, n, m))
    a = jnp.reshape(adapter.factors["a"], (-1, n, adapter.kind.rank))
    b = jnp.reshape(adapter.factors["b"], (-1, adapter.kind.rank, m))
    norms = jax.vmap(functools.partial(dora_column_norms, scale=adapter.kind.scale))(w, a, b)
    return jnp.reshape(norms, (*stack, m))


def dora_norms(params: Any, adapters: Any) -> dict[str, jax.Array]:
    """The column norms ``‖W + s·A B‖_col`` of every DoRA adapter, from the *unfolded* params.

    Take them before :func:`lowrank_jax.adapters.fold` to undo it later with
    :func:`unfold_dora` (PEFT caches the same norms when it folds).

    Args:
      params: the parameter pytree the adapters were made for (not folded).
      adapters: one adapter set, a list of sets or ``{name: set}``; only one DoRA adapter per kernel.

    Returns:
      ``{path: (*stack, m)}`` for each kernel with a DoRA adapter.

    Raises:
      ValueError: two DoRA adapters on one kernel, or adapters whose paths are not in ``params``.
    """
    found = _dora_adapters(adapters)
    seen = [p for p, _ in found]
    twice = sorted({p for p in seen if seen.count(p) > 1})
    if twice:
        raise ValueError(f"{twice} carry several DoRA adapters; fold and unfold them one by one.")
    by_path = dict(found)
    out: dict[str, jax.Array] = {}

    def collect(path, leaf, ads):
        if path in by_path:
            out[path] = _stacked_norms(by_path[path], jnp.asarray(leaf))
        return leaf

    map_adapted(params, {p: a for p, a in found}, collect)
    return out


def unfold_dora(params: Any, adapters: Any, norms: dict[str, jax.Array]) -> Any:
    """Undoes :func:`lowrank_jax.adapters.fold` of DoRA adapters: ``W = W'·diag(1/c) − s·A B``.

    Args:
      params: folded parameters (``W' = (W + s·A B)·diag(c)`` at each DoRA kernel).
      adapters: the adapter set(s) that were folded (other kinds are subtracted as in
        :func:`lowrank_jax.adapters.unfold`).
      norms: :func:`dora_norms` of the params before folding, ``c = mag / norms``.

    Returns:
      The unfolded parameters (exact up to float rounding).

    Raises:
      ValueError: a DoRA kernel has no entry in ``norms`` (or a wrong shape).
    """
    missing = sorted({p for p, _ in _dora_adapters(adapters)} - set(norms))
    if missing:
        raise ValueError(
            f"no norms for the DoRA kernels {missing}; pass norms=dora_norms(params, adapters) "
            "taken before merging."
        )

    def update(path, leaf, ads):
        out = leaf
        # fold gives W' = (W + s·A B)·diag(c) + Σ others: the others come off before the division
        for ad in sorted(ads, key=lambda ad: isinstance(ad.kind, DoRA)):
            if not isinstance(ad.kind, DoRA):
                d = delta(ad, leaf.shape)
                out = (out - d.astype(out.dtype)).astype(out.dtype)
                continue
            stack, n, m = ad.matrix_shape(leaf.shape)
            if tuple(norms[path].shape) != (*stack, m):
                raise ValueError(
                    f"norms[{path!r}] has shape {tuple(norms[path].shape)}, expected {(*stack, m)}."
                )
            c = ad.factors["m"] / norms[path]
            w = jnp.reshape(out, (*stack, n, m))
            lora_dw = delta(dataclasses.replace(ad, kind=ad.kind.lora), leaf.shape)
            w = w / c[..., None, :].astype(w.dtype) - jnp.reshape(lora_dw, w.shape).astype(w.dtype)
            out = jnp.reshape(w, leaf.shape).astype(leaf.dtype)
        return out

    return map_adapted(params, adapters, update)
