"""Mixed-adapter batches: a different adapter for each example of one batch (S-LoRA / Punica style).

:func:`stack_adapters` stacks ``N`` adapter sets of one model into a *bank*: per kernel, one
:class:`Adapter` of kind :class:`AdapterBank` whose factors carry an adapter axis of size ``N``
(after any stacked-layer axes). The adapted forward of :func:`lowrank_jax.adapters.adapt` then
takes ``adapter_ids`` (``(b,)`` ints in ``[0, N)``) and computes, for example ``i`` of the batch,

    ``x_i @ W + apply_delta(factors[adapter_ids[i]], x_i)``   (for LoRA: ``s · (x_i A_j) B_j``),

by gathering each example's factors (``O(b · r (n + m))`` memory) and ``vmap``-ing the kind's
factorised rule over the batch: no per-example weight ``W + ΔW_j`` is formed. The bank and the ids
are ordinary arguments, so a jitted forward compiled once serves any bank of the same shapes
(swap, retrain or reorder adapters without recompiling) and any assignment of adapters to
examples.

The batch must be the leading axis of the input of every adapted matmul (``(b, ..., n)``), as in
the models of :mod:`lowrank_jax.models` and any Flax ``Dense``/``DenseGeneral`` stack.

Example::

    bank = adapters.stack_adapters([lora_0, lora_1, lora_2])   # three tasks' LoRAs
    fwd = jax.jit(adapters.adapt(model.apply))
    logits = fwd(variables, bank, tokens, adapter_ids=jnp.array([2, 0, 0, 1]))

With the sampler, pass the bank and the ids inside ``generate``'s variables, so that one
compilation serves any bank and any assignment of adapters to rows::

    adapted = adapters.adapt(model.apply)

    def forward(state, *args, **kwargs):
        return adapted(state["base"], state["bank"], *args, adapter_ids=state["ids"], **kwargs)

    state = {"base": variables, "bank": bank, "ids": jnp.array([2, 0, 0, 1])}
    out = models.generate(model, state, prompt, mask, max_new_tokens=32, forward=forward)

Concrete ids are checked to lie in ``[0, N)``; ids that are traced where the bank is applied (as
``state["ids"]`` above) cannot be, and an out-of-range id is clamped into ``[0, N)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.core import Adapter, AdapterSet, as_sets, needs_kernel
from lowrank_jax.adapters.kinds import AdapterKind, LoRA

__all__ = ["AdapterBank", "select_adapters", "stack_adapters"]


@dataclasses.dataclass(frozen=True)
class AdapterBank(AdapterKind):
    """Adapter kind: ``size`` adapters of kind ``inner`` on one kernel, one chosen per example.

    The factors are ``inner``'s with a leading adapter axis ``(size, ...)``; after
    :func:`select_adapters` they also hold ``ids`` ``(batch,)`` and ``batch`` is set, and
    ``apply_delta`` applies adapter ``ids[i]`` to example ``i`` of ``x`` (``(batch · t, n)``,
    examples contiguous). A bank has no single update, so ``materialize`` (folding) raises.

    Attributes:
      inner: the kind of every adapter in the bank.
      size: ``N``, the number of adapters.
      batch: ``b``, the batch size the ids select for (``None``: a bank not yet selected).
    """

    inner: Any
    size: int
    batch: int | None = None

    @property
    def in_ndim(self) -> int | None:
        return self.inner.in_ndim

    @property
    def out_ndim(self) -> int | None:
        return self.inner.out_ndim

    def check_shape(self, n: int, m: int, path: str) -> None:
        self.inner.check_shape(n, m, path)

    def init_factors(self, key: jax.Array, kernel: jax.Array) -> dict[str, jax.Array]:
        keys = jax.random.split(key, self.size)
        out = jax.vmap(lambda k: self.inner.init_factors(k, kernel))(keys)
        if self.batch is not None:
            out["ids"] = jnp.zeros((self.batch,), jnp.int32)
        return out

    def _per_example(self, factors: dict, x: jax.Array) -> tuple[dict, jax.Array]:
        if self.batch is None or "ids" not in factors:
            raise ValueError(
                "an adapter bank (adapters.stack_adapters) needs adapter_ids: call the adapted "
                "function with adapter_ids=(batch,) ints, one adapter index per example."
            )
        tokens = x.shape[0]
        if tokens % self.batch:
            raise ValueError(
                f"adapter_ids has {self.batch} entries but an adapted matmul sees {tokens} rows; "
                "the batch must be the leading axis of every adapted matmul's input."
            )
        ids = factors["ids"]
        # gather: (b, ...); traced ids are not checked, an id out of [0, size) is clamped into it.
        picked = {
            k: jnp.take(v, ids, axis=0, mode="clip") for k, v in factors.items() if k != "ids"
        }
        return picked, x.reshape(self.batch, tokens // self.batch, *x.shape[1:])

    def apply_delta(
        self,
        factors: dict[str, jax.Array],
        x: jax.Array,
        *,
        shape: tuple[int, int] | None = None,
        key: jax.Array | None = None,
    ) -> jax.Array:
        picked, xb = self._per_example(factors, x)
        if key is None:
            out = jax.vmap(lambda f, xi: self.inner.apply_delta(f, xi, shape=shape))(picked, xb)
        else:
            keys = jax.random.split(key, self.batch)
            out = jax.vmap(lambda f, xi, k: self.inner.apply_delta(f, xi, shape=shape, key=k))(
                picked, xb, keys
            )
        return out.reshape(x.shape[0], -1)

    def apply_delta_transposed(
        self, factors: dict[str, jax.Array], y: jax.Array, *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        picked, yb = self._per_example(factors, y)
        one = lambda f, yi: self.inner.apply_delta_transposed(f, yi, shape=shape)  # noqa: E731
        return jax.vmap(one)(picked, yb).reshape(y.shape[0], -1)

    def materialize(
        self, factors: dict[str, jax.Array], *, shape: tuple[int, int] | None = None
    ) -> jax.Array:
        raise ValueError(
            "an adapter bank has one update per adapter, not one ΔW: fold one adapter set "
            "(before stack_adapters), or apply the bank with adapter_ids."
        )

    def factor_specs(self, in_spec: Any, out_spec: Any) -> dict[str, tuple[Any, ...]]:
        specs = {k: (None, *v) for k, v in self.inner.factor_specs(in_spec, out_spec).items()}
        if self.batch is not None:
            specs["ids"] = (None,)
        return specs


def _as_scale_one_lora(adapter: Adapter, rank: int) -> dict[str, jax.Array]:
    """The product form's factors with the scale folded into ``b`` and zero-padded to ``rank``."""
    a, b, scale = adapter.kind.lowrank_factors(adapter.factors)
    pad = rank - a.shape[-1]
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    b = jnp.pad(b * jnp.asarray(scale, b.dtype), [(0, 0)] * (b.ndim - 2) + [(0, pad), (0, 0)])
    return {"a": a, "b": b}


def stack_adapters(sets: Sequence[AdapterSet]) -> AdapterSet:
    """Stacks ``N`` adapter sets of one model into a bank for mixed-adapter batches.

    Adapters of one kind at a kernel are stacked as they are. Kinds in product form
    (``lowrank_factors``: LoRAs) that differ in rank or alpha are first rewritten exactly as
    scale-1 LoRAs of the largest rank (``b ← s · b``, zero-padded), so a bank may mix ranks.

    Args:
      sets: ``N`` adapter sets over the same kernel paths (e.g. one per task or user).

    Returns:
      ``{path: Adapter}`` of kind :class:`AdapterBank` with factors ``(*stack, N, ...)``; pass
      it with ``adapter_ids`` to the function from :func:`lowrank_jax.adapters.adapt`.

    Raises:
      ValueError: no sets, sets over different paths, or adapters at a path that differ in
        kind (other than LoRA rank/alpha), layout, shape or dropout.

    Example:
      >>> bank = stack_adapters([lora_a, lora_b])
      >>> y = adapt(model.apply)(variables, bank, x, adapter_ids=jnp.array([1, 0, 1]))
    """
    sets = [s for item in sets for s in as_sets(item)] if isinstance(sets, list | tuple) else None
    if not sets:
        raise ValueError("stack_adapters needs a non-empty list of adapter sets.")
    paths = sorted(sets[0])
    for i, s in enumerate(sets):
        if sorted(s) != paths:
            diff = sorted(set(s) ^ set(paths))[:5]
            raise ValueError(
                f"adapter set {i} covers other kernels than set 0 (differing: {diff}); a bank "
                "needs the same paths in every set."
            )
    out = {}
    for path in paths:
        ads = [s[path] for s in sets]
        if any(needs_kernel(a) for a in ads):
            raise TypeError(
                f"the adapters at {path!r} include a DoRA adapter, whose update depends on the "
                "frozen kernel: a bank holds factor-only kinds (LoRA, VeRA, ...); apply DoRA sets "
                "one at a time."
            )
        kinds = {a.kind for a in ads}
        layouts = {(a.in_ndim, a.out_ndim, a.matrix) for a in ads}
        if len(layouts) != 1:
            raise ValueError(f"the adapters at {path!r} differ in layout or shape: {layouts}.")
        if len(kinds) == 1:
            inner = ads[0].kind
            factors = [a.factors for a in ads]
        elif (
            all(a.kind.lowrank_factors(a.factors) is not None for a in ads)
            and len({(k.dropout, k.in_ndim, k.out_ndim) for k in kinds}) == 1
        ):
            rank = max(a.kind.lowrank_factors(a.factors)[0].shape[-1] for a in ads)
            first = ads[0].kind
            inner = LoRA(
                rank=rank,
                alpha=float(rank),
                dropout=first.dropout,
                in_ndim=first.in_ndim,
                out_ndim=first.out_ndim,
            )
            factors = [_as_scale_one_lora(a, rank) for a in ads]
        else:
            raise ValueError(
                f"the adapters at {path!r} are of different kinds {sorted(map(str, kinds))}; a "
                "bank holds one kind per kernel (LoRAs may differ in rank and alpha only)."
            )
        stack = ads[0].stack_ndim()
        stacked = jax.tree.map(lambda *f, axis=stack: jnp.stack(f, axis=axis), *factors)
        out[path] = Adapter(
            factors=stacked,
            kind=AdapterBank(inner=inner, size=len(sets)),
            in_ndim=ads[0].in_ndim,
            out_ndim=ads[0].out_ndim,
            matrix=ads[0].matrix,
        )
    return out


def _concrete(ids: Any) -> np.ndarray | None:
    """The ids on the host if they are concrete (eager, or closed over by a traced function, where
    ``ids.min()`` would be traced), else None."""
    if isinstance(ids, jax.core.Tracer):
        return None
    try:
        return np.asarray(ids)
    except jax.errors.TracerArrayConversionError:  # a list holding tracers
        return None


def select_adapters(bank: AdapterSet, adapter_ids: jax.Array) -> AdapterSet:
    """The bank with each kernel's adapter chosen per example (what ``adapter_ids=`` does).

    Args:
      bank: from :func:`stack_adapters`.
      adapter_ids: ``(b,)`` integer indices into the bank, one per example (traced values are
        fine: changing them never recompiles). Concrete ids are checked, also when a jitted
        function closes over them (as ``generate``'s ``forward`` does); traced ids cannot be
        checked and an id out of ``[0, N)`` is clamped into it (below 0: adapter 0, from ``N``
        on: adapter ``N - 1``), with no error.

    Returns:
      ``{path: Adapter}`` of kind ``AdapterBank(batch=b)`` with ``ids`` among the factors
      (broadcast over stacked-layer axes, so ``scan`` over layers slices them).

    Raises:
      ValueError: ``bank`` holds an adapter that is not a bank, ``adapter_ids`` is not 1-D, or
        concrete ids lie outside ``[0, N)``.
      TypeError: ``adapter_ids`` is not an integer array.
    """
    ids = jnp.asarray(adapter_ids)
    if ids.ndim != 1:
        raise ValueError(f"adapter_ids must be (batch,) ints; got shape {ids.shape}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"adapter_ids must be integers; got dtype {ids.dtype}.")
    size = next((a.kind.size for a in bank.values() if isinstance(a.kind, AdapterBank)), None)
    host = _concrete(adapter_ids) if size is not None and ids.size else None
    if host is not None:
        low, high = int(host.min()), int(host.max())
        if low < 0 or high >= size:
            raise ValueError(
                f"adapter_ids must lie in [0, {size}) for a bank of {size} adapters; got "
                f"{low}..{high}: pass indices into the list given to stack_adapters."
            )
    out = {}
    for path, adapter in bank.items():
        if not isinstance(adapter.kind, AdapterBank):
            raise ValueError(
                f"{path!r} holds a {type(adapter.kind).__name__}, not an adapter bank: with "
                "adapter_ids, pass the bank from adapters.stack_adapters."
            )
        kind = dataclasses.replace(adapter.kind, batch=int(ids.shape[0]))
        leaf = jax.tree.leaves(adapter.factors)[0]
        stack = leaf.shape[: adapter.stack_ndim()]
        factors = dict(
            adapter.factors, ids=jnp.broadcast_to(ids.astype(jnp.int32), (*stack, ids.shape[0]))
        )
        out[path] = adapter.replace(factors=factors, kind=kind)
    return out
