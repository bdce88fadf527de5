"""Task-vector merges on factorised adapters: task arithmetic, TIES and DARE.

A *task vector* is a flat ``{path: update}`` dict over kernel paths (see
:mod:`lowrank_jax.adapters.paths`) whose values are either :class:`~lowrank_jax.adapters.Adapter`
records (an adapter set from :func:`lowrank_jax.adapters.init`, e.g. a trained LoRA) or dense
updates in the kernel's shape (``W_finetuned - W_base``, see :func:`task_vector`). Every merge here
works on the *product* ``ΔW = s · A B`` of a LoRA (or the materialised update of any adapter kind),
never on ``A`` and ``B`` separately: merging factors separately, as PEFT's ``add_weighted_adapter``
does for ``combination_type="linear" | "ties" | "dare_linear"``, multiplies out to cross terms
``s_i s_j A_i B_j`` between different adapters (PEFT issues #3004, #3013). The merged update is
re-factorised into a LoRA of a stated rank by a truncated SVD (the best rank-``r`` approximation
in Frobenius and spectral norm); task arithmetic of LoRAs does this through a QR of the stacked
factors, so no ``n × m`` matrix is formed.

Per kernel, with updates ``Δ_1..Δ_K`` (matrix views ``(n, m)``) and weights ``w_k``:

* task arithmetic: ``Δ = Σ_k w_k Δ_k``;
* TIES (Yadav et al. 2023): trim each task vector to its ``⌊density · D⌋`` largest-magnitude
  entries (``T_k``); elect a sign per entry, ``γ = sign(Σ_k T_k)`` (``"total"``) or
  ``sign(Σ_k sign T_k)`` (``"frequency"``), with ``γ = +1`` at 0; disjoint mean ``Δ = Σ_k w_k T_k
  [sign T_k = γ] / max(1, Σ_k [sign T_k = γ])``;
* DARE (Yu et al. 2024): keep each entry with probability ``density`` and rescale,
  ``Δ = Σ_k w_k (M_k ⊙ Δ_k) / density`` with ``M_k ~ Bernoulli(density)`` (``dare_linear``).

**Where TIES trims.** The paper trims each task vector as a whole: ``D`` is the number of entries of
*all* its kernels, and one magnitude ranking runs over them (:func:`merge_ties`'s default,
``trim="global"``), so a kernel with large updates keeps more than ``density`` of its entries and
one with small updates fewer. ``trim="per_kernel"`` ranks each kernel matrix (each stacked layer)
on its own, ``D = n m``: this is what PEFT does (read in peft 0.21's source:
``LoraModel.add_weighted_adapter`` loops over the target modules and calls
``merge_utils.ties`` per module, whose ``magnitude_based_pruning`` ranks that one tensor, for
``combination_type="ties_svd"`` on the module's product and for ``"ties"`` on its ``A`` and ``B``
factors apart). The two differ (on random task vectors by about a third of the merge's norm).

The other steps follow PEFT's ``peft.utils.merge_utils`` step by step (the sign elected from the
unweighted trimmed updates, the weights applied in the disjoint mean, exactly ``⌊density · D⌋``
entries kept, ties broken by position), so ``merge_ties(..., trim="per_kernel")`` and
:func:`merge_dare` equal PEFT's ``add_weighted_adapter(combination_type="ties_svd" |
"dare_linear_svd")`` on the same adapters, same density and DARE mask
(``tests/merging/test_peft_agreement.py``). The paper's official code keeps entries ``≥`` the
``k``-th magnitude (more than ``k`` on exact ties) and applies one scale ``λ`` after the merge
(``weights = (λ, …, λ)`` here gives the same merge for ``majority="total"``).

References:
  Ilharco et al. 2023, Editing models with task arithmetic; Yadav et al. 2023, TIES-Merging;
  Yu et al. 2024, Language models are Super Mario (DARE); PEFT ``LoraModel.add_weighted_adapter``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters import paths as paths_lib
from lowrank_jax.adapters.core import Adapter, needs_kernel
from lowrank_jax.adapters.kinds import LoRA
from lowrank_jax.merging import trees
from lowrank_jax.merging.sparsify import (
    Majority,
    check_density,
    check_trim,
    dare_delta,
    dare_masks,
    dare_ties_delta,
    keep_largest,
    magnitude_prune_delta,
    task_weights,
    ties_delta,
    trim_matrix,
)
from lowrank_jax.spectral import svd

__all__ = [
    "TaskVector",
    "merge_dare",
    "merge_dare_ties",
    "merge_magnitude_prune",
    "merge_per_kernel",
    "merge_task_arithmetic",
    "merge_ties",
    "task_vector",
    "task_vector_matrices",
    "to_lora",
    "trim_task_vectors",
]

TaskVector = Mapping[str, Any]  # {path: Adapter | dense update in the kernel's shape}
Trim = Literal["global", "per_kernel"]


# ----------------------------------------------------------------------------------------------
# Validation and matrix views.


def _check_same_paths(trees_: Sequence[Mapping[str, Any]], what: str) -> None:
    """:func:`~lowrank_jax.merging.trees.check_same_tree` (``compare="paths"``) over a list."""
    signature = None
    for i, t in enumerate(trees_):
        signature = trees.check_same_tree(
            trees_[0],
            t,
            what=f"{what}[{i}]",
            reference_what=f"{what}[0]",
            signature=signature,
            compare="paths",
        )


def _matrix_view(value: Any, layout: tuple[int, int] | None, path: str) -> jax.Array:
    """``(L, n, m)`` float32 matrix views of one update (``L`` stacked layers, 1 if none)."""
    if isinstance(value, Adapter):
        if needs_kernel(value):
            raise TypeError(
                f"the adapter at {path!r} is DoRA, whose update depends on the frozen kernel: "
                "merge its dense update instead, adapters.delta(ad, kernel.shape, kernel)."
            )
        if value.matrix is None:
            raise ValueError(f"the Adapter at {path!r} does not record its (n, m) shape.")
        n, m = value.matrix
        stack = value.stack_ndim()
        flat = jax.tree.map(lambda f: jnp.reshape(f, (-1, *f.shape[stack:])), value.factors)
        return jax.vmap(value.kind.materialize)(flat).astype(jnp.float32).reshape(-1, n, m)
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"the update at {path!r} has dtype {x.dtype}; pass a floating array.")
    if layout is None:
        if x.ndim != 2:
            raise ValueError(
                f"the dense update at {path!r} has shape {x.shape}: only 2-D kernels are read "
                "without an Adapter at the same path to give the layout; pass one, or reshape."
            )
        layout = (1, 1)
    i, o = layout
    stack = x.ndim - i - o
    if stack < 0:
        raise ValueError(f"the dense update at {path!r} of shape {x.shape} has too few axes.")
    n = int(jnp.prod(jnp.asarray(x.shape[stack : stack + i])))
    m = int(jnp.prod(jnp.asarray(x.shape[stack + i :])))
    return x.astype(jnp.float32).reshape(-1, n, m)


def _layout(values: Sequence[Any]) -> tuple[int, int, tuple[int, ...]] | None:
    """``(in_ndim, out_ndim, stack_shape)`` of the first Adapter among ``values`` (else None)."""
    for v in values:
        if isinstance(v, Adapter):
            stack = jax.tree.leaves(v.factors)[0].shape[: v.stack_ndim()]
            return v.in_ndim, v.out_ndim, tuple(stack)
    return None


def task_vector_matrices(
    task_vectors: Sequence[TaskVector],
) -> dict[str, tuple[jax.Array, tuple[int, int, tuple[int, ...]]]]:
    """``{path: ((K, L, n, m) stacked matrix views, (in_ndim, out_ndim, stack_shape))}``.

    An Adapter's matrix view is its materialised update ``ΔW`` (``(L, n, m)``, ``L`` the product
    of its stacked-layer axes, 1 if none); a dense update takes the layout of an Adapter at the
    same path, or must be 2-D.

    Raises:
      ValueError: the task vectors have different paths, or the matrix views at a path differ in
        shape (the message names the first such path).
    """
    if isinstance(task_vectors, Mapping) or not len(task_vectors):
        raise TypeError("pass a non-empty sequence of task vectors ({path: update} dicts).")
    _check_same_paths(task_vectors, "task vectors")
    out = {}
    for path in task_vectors[0]:
        values = [tv[path] for tv in task_vectors]
        layout = _layout(values)
        views = [_matrix_view(v, None if layout is None else layout[:2], path) for v in values]
        shapes = [tuple(v.shape) for v in views]
        if len(set(shapes)) != 1:
            raise ValueError(
                f"the task vectors differ at path {path!r}: matrix views of shapes {shapes}. "
                "Merge updates of the same kernels."
            )
        out[path] = (jnp.stack(views), layout if layout is not None else (1, 1, ()))
    return out


def task_vector(finetuned: Any, base: Any, *, targets: Sequence[str] | None = None) -> dict:
    """``{path: finetuned - base}`` over the kernels of two parameter pytrees of one model.

    Args:
      finetuned, base: parameter pytrees of the same structure (linen variables, dicts, ...).
      targets: full-match regexes over '/'-joined paths selecting the kernels (default: every
        floating leaf with at least 2 axes).

    Returns:
      ``{path: (kernel shape) difference}``, a dense task vector for the merges of this module.

    Raises:
      ValueError: the trees have different paths or shapes (the message names the first
        differing path), or ``targets`` selects nothing.
    """
    fine, start = paths_lib.named_leaves(finetuned), paths_lib.named_leaves(base)
    trees.check_same_tree(start, fine, what="finetuned", reference_what="base", compare="paths")
    compiled = [re.compile(t) for t in targets] if targets is not None else None
    out = {}
    for path, x in start.items():
        y = fine[path]
        if jnp.shape(x) != jnp.shape(y):
            raise ValueError(
                f"the parameter trees differ at path {path!r}: shapes {jnp.shape(y)} (finetuned) "
                f"and {jnp.shape(x)} (base)."
            )
        floating = jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
        wanted = (
            any(c.fullmatch(path) for c in compiled) if compiled else floating and jnp.ndim(x) >= 2
        )
        if wanted:
            out[path] = jnp.asarray(y, jnp.float32) - jnp.asarray(x, jnp.float32)
    if not out:
        raise ValueError(f"targets {targets!r} select no parameter; paths: {sorted(start)[:20]}")
    return out


# ----------------------------------------------------------------------------------------------
# Per-matrix cores.


@functools.partial(jax.jit, static_argnames=("density",))
def _trim_global(deltas: dict[str, jax.Array], *, density: float) -> dict[str, jax.Array]:
    """Trims every task vector as a whole: ``deltas`` ``{path: (K, ...)}``; task ``k`` keeps its
    ``⌊density · D⌋`` largest-magnitude entries among all ``D`` entries of all its paths."""
    paths = sorted(deltas)
    sizes = [int(np.prod(deltas[p].shape[1:])) for p in paths]
    flat = jnp.concatenate([deltas[p].reshape(deltas[p].shape[0], -1) for p in paths], axis=1)
    count = int(density * flat.shape[1])
    kept = jax.vmap(lambda f: jnp.where(keep_largest(f, count), f, 0.0))(flat)
    parts = jnp.split(kept, np.cumsum(sizes)[:-1], axis=1)
    return {p: x.reshape(deltas[p].shape) for p, x in zip(paths, parts, strict=True)}


def trim_task_vectors(
    task_vectors: Sequence[TaskVector], *, density: float, trim: Trim = "global"
) -> dict[str, jax.Array]:
    """The trimming step of TIES: ``{path: (K, L, n, m)}`` matrix views with all but the largest
    magnitudes of each task vector set to zero.

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      density: kept fraction in ``(0, 1]``.
      trim: ``"global"`` (the TIES paper): each task vector keeps its ``⌊density · D⌋`` largest
        ``|entries|`` over all its kernels together (``D`` entries in all); ``"per_kernel"``
        (PEFT): every kernel matrix (every stacked layer) keeps ``⌊density · n m⌋`` of its own.

    Returns:
      ``{path: (K, L, n, m)}`` trimmed matrix views (float32), as :func:`task_vector_matrices`.

    Raises:
      ValueError: a bad density or ``trim``; task vectors with different paths or shapes.
    """
    density = check_density(density)
    check_trim(trim)
    views = {p: v for p, (v, _) in task_vector_matrices(task_vectors).items()}
    if density >= 1.0:
        return views
    if trim == "global":
        return _trim_global(views, density=density)
    per = jax.vmap(jax.vmap(lambda d: trim_matrix(d, density)))
    return {p: per(v) for p, v in views.items()}


def _lora_sum_factors(
    tvs: Sequence[TaskVector], path: str, w: jax.Array, rank: int | None
) -> tuple[jax.Array, jax.Array] | None:
    """Task arithmetic of LoRAs through a QR of the stacked factors (no ``n × m`` matrix).

    ``Σ_k w_k s_k A_k B_k = [w_k s_k A_k]_k [B_k]_k = Q_a (R_a R_bᵀ) Q_bᵀ``; the SVD of the small
    core ``R_a R_bᵀ`` gives the truncated factors. ``None`` if some update is not a LoRA.
    """
    ads = [tv[path] for tv in tvs]
    if not all(isinstance(a, Adapter) and isinstance(a.kind, LoRA) for a in ads):
        return None
    stacks = {a.stack_ndim() for a in ads}
    if len(stacks) != 1:
        return None
    (stack,) = stacks
    n, m = ads[0].matrix
    a_cat = jnp.concatenate(
        [
            (w[i] * ad.kind.scale)
            * ad.factors["a"].astype(jnp.float32).reshape(-1, n, ad.kind.rank)
            for i, ad in enumerate(ads)
        ],
        axis=-1,
    )
    b_cat = jnp.concatenate(
        [ad.factors["b"].astype(jnp.float32).reshape(-1, ad.kind.rank, m) for ad in ads], axis=-2
    )
    total = a_cat.shape[-1]
    r = min(total, n, m) if rank is None else rank

    def one(a, b):
        keep = min(r, total)
        u, s, vt = svd.product_svd(a, b.T, rank=keep)
        root = jnp.sqrt(s)
        fa, fb = u * root, root[:, None] * vt
        pad = r - keep  # rank above the stacked rank: zero directions
        return jnp.pad(fa, ((0, 0), (0, pad))), jnp.pad(fb, ((0, pad), (0, 0)))

    del stack
    return jax.vmap(one)(a_cat, b_cat)


# ----------------------------------------------------------------------------------------------
# Pytree-level merges.


def to_lora(
    factors: tuple[jax.Array, jax.Array], layout: tuple[int, int, tuple[int, ...]], n: int, m: int
) -> Adapter:
    """An :class:`Adapter` of kind ``LoRA(rank=r, alpha=r)`` (scale 1) from ``(L, n, r), (L, r, m)``
    factors, with the stacked-layer axes and kernel layout of ``layout``."""
    a, b = factors
    in_ndim, out_ndim, stack = layout
    r = a.shape[-1]
    kind = LoRA(rank=r, alpha=float(r), in_ndim=in_ndim, out_ndim=out_ndim)
    return Adapter(
        factors={"a": a.reshape(*stack, n, r), "b": b.reshape(*stack, r, m)},
        kind=kind,
        in_ndim=in_ndim,
        out_ndim=out_ndim,
        matrix=(n, m),
    )


def _check_rank(rank: int | None, n: int, m: int, path: str) -> int:
    if rank is None:
        return min(n, m)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(n, m):
        raise ValueError(
            f"rank={rank!r} does not fit {path!r}, a ({n}, {m}) matrix view: pass an int in "
            f"[1, {min(n, m)}] (or None for the exact, untruncated update)."
        )
    return rank


@functools.partial(jax.jit, static_argnums=1)
def _factorize(merged: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    return svd.balanced_factors(merged, rank=rank)


@functools.partial(jax.jit, static_argnames=("density",))
def _prune_layers(ds, w, *, density):
    one = functools.partial(magnitude_prune_delta, weights=w, density=density)
    return jax.vmap(one, in_axes=1)(ds)


@functools.partial(jax.jit, static_argnames=("density", "majority"))
def _ties_layers(ds, w, *, density, majority):
    one = functools.partial(ties_delta, weights=w, density=density, majority=majority)
    return jax.vmap(one, in_axes=1)(ds)


@functools.partial(jax.jit, static_argnames=("density", "majority"))
def _dare_layers(ds, key, w, *, density, majority=None):
    def one(layer_ds, layer):
        keep = dare_masks(jax.random.fold_in(key, layer), layer_ds.shape, density=density)
        if majority is None:
            return dare_delta(layer_ds, keep, density=density, weights=w)
        return dare_ties_delta(layer_ds, keep, density=density, weights=w, majority=majority)

    return jax.vmap(one, in_axes=(1, 0))(ds, jnp.arange(ds.shape[1]))


def _merge(tvs, combine, *, rank, relative_to, lora_shortcut=None, prepare=None):
    """Runs ``combine(path_index, (K, L, n, m)) -> (L, n, m)`` per kernel and re-factorises.

    ``prepare({path: (K, L, n, m)}) -> same`` optionally transforms the stacked updates of all
    kernels at once first (TIES's global trimming).
    """
    if not isinstance(tvs, Sequence) or isinstance(tvs, Mapping) or not tvs:
        raise TypeError("task_vectors must be a non-empty list of {path: update} dicts.")
    extra = [relative_to] if relative_to is not None else []
    mats = task_vector_matrices([*tvs, *extra])
    if isinstance(rank, Mapping) and set(rank) != set(mats):
        raise ValueError(
            f"rank as a dict must give one rank per kernel path; missing "
            f"{sorted(set(mats) - set(rank))[:5]}, extra {sorted(set(rank) - set(mats))[:5]}."
        )
    num = len(tvs)
    prepared = None
    if prepare is not None:
        prepared = prepare({path: stacked[:num] for path, (stacked, _) in mats.items()})
    out = {}
    for index, (path, (stacked, layout)) in enumerate(mats.items()):
        _, _, n, m = stacked.shape
        wanted = rank.get(path) if isinstance(rank, Mapping) else rank
        r = _check_rank(wanted, n, m, path)
        factors = None
        if lora_shortcut is not None and relative_to is None:
            factors = lora_shortcut(path, wanted)
        if factors is None:
            rel = stacked[-1] if relative_to is not None else jnp.zeros_like(stacked[0])
            deltas = stacked[:num] if prepared is None else prepared[path]
            factors = _factorize(combine(index, deltas) - rel, r)
        out[path] = to_lora(factors, layout, n, m)
    return out


def merge_task_arithmetic(
    task_vectors: Sequence[TaskVector],
    *,
    weights: Sequence[float] | None = None,
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """Task arithmetic ``Σ_k w_k ΔW_k`` per kernel, re-factorised as a rank-``r`` LoRA.

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      weights: ``K`` weights (default 1 each).
      rank: output rank per kernel (``None``: ``min(n, m)``, or the stacked rank ``Σ r_k`` for
        LoRAs: exact), or ``{path: rank | None}``, one per kernel (per-module ranks, which
        :func:`lowrank_jax.adapters.save_peft` writes as PEFT's ``rank_pattern``).
      relative_to: optional task vector ``τ_0`` subtracted before re-factorising: the adapter then
        encodes ``merge - τ_0``, to be loaded on a model that already holds ``τ_0`` (a target
        ``W_t = W_s + τ_0``).

    Returns:
      ``{path: Adapter}`` of kind ``LoRA(rank, alpha=rank)`` (scale 1), ready for
      :func:`lowrank_jax.adapters.fold` or the adapted forward.

    Raises:
      ValueError: the task vectors have different paths or shapes (naming the first differing
        path), a bad rank or weights.
      TypeError: an entry is not a ``{path: update}`` dict.

    Example:
      >>> merged = merge_task_arithmetic([lora_a, lora_b], weights=(0.5, 0.5), rank=8)
    """
    w = task_weights(weights, len(task_vectors)) if isinstance(task_vectors, Sequence) else None

    def combine(_, ds):
        return jnp.einsum("k,kl...->l...", w, ds)

    return _merge(
        task_vectors,
        combine,
        rank=rank,
        relative_to=relative_to,
        lora_shortcut=lambda path, r: _lora_sum_factors(task_vectors, path, w, r),
    )


def merge_ties(
    task_vectors: Sequence[TaskVector],
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
    trim: Trim = "global",
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """TIES merge of the products (trim, elect sign, disjoint mean) as a rank-``r`` LoRA.

    ``trim="global"`` (default, the TIES paper) ranks magnitudes over each whole task vector (all
    its kernels and stacked layers at once, :func:`trim_task_vectors`); ``trim="per_kernel"``
    ranks each kernel matrix (each stacked layer) alone and equals PEFT's
    ``add_weighted_adapter(combination_type="ties_svd")``. Sign election and the disjoint mean
    are per entry (:func:`ties_delta`). Args, returns and errors as
    :func:`merge_task_arithmetic`, plus ``density`` (kept fraction in ``(0, 1]``), ``majority``
    (``"total"`` or ``"frequency"``) and ``trim``. ``relative_to`` is not trimmed.

    Example:
      >>> merged = merge_ties([lora_a, lora_b], density=0.2, rank=16)  # the paper's TIES
      >>> like_peft = merge_ties([lora_a, lora_b], density=0.2, rank=16, trim="per_kernel")
    """
    density = check_density(density)
    check_trim(trim)
    if majority not in ("total", "frequency"):
        raise ValueError(f"majority must be 'total' or 'frequency'; got {majority!r}.")
    per_kernel = trim == "per_kernel"

    def combine(_, ds):
        w = task_weights(weights, ds.shape[0])
        return _ties_layers(ds, w, density=density if per_kernel else 1.0, majority=majority)

    def prepare(views):
        return _trim_global(views, density=density) if density < 1.0 else views

    return _merge(
        task_vectors,
        combine,
        rank=rank,
        relative_to=relative_to,
        prepare=None if per_kernel else prepare,
    )


def merge_dare(
    task_vectors: Sequence[TaskVector],
    key: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """DARE merge (:func:`dare_delta`, masks from ``key``) of the products, as a rank-``r`` LoRA.

    Kernel ``i`` (in path order) and stacked layer ``l`` draw their ``(K, n, m)`` masks from
    ``fold_in(fold_in(key, i), l)``. Args, returns and errors as :func:`merge_task_arithmetic`, plus
    ``key`` and ``density`` (keep probability in ``(0, 1]``).
    """
    density = check_density(density)

    def combine(index, ds):
        w = task_weights(weights, ds.shape[0])
        return _dare_layers(ds, jax.random.fold_in(key, index), w, density=density)

    return _merge(task_vectors, combine, rank=rank, relative_to=relative_to)


def merge_dare_ties(
    task_vectors: Sequence[TaskVector],
    key: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """DARE-TIES merge (:func:`dare_ties_delta`) of the products, as a rank-``r`` LoRA.

    Masks are drawn as in :func:`merge_dare` (same ``key``: same masks). Args, returns and errors
    as :func:`merge_dare`, plus ``majority`` (``"total"`` or ``"frequency"``).

    Example:
      >>> merged = merge_dare_ties([lora_a, lora_b], jax.random.key(0), density=0.5, rank=8)
    """
    density = check_density(density)
    if majority not in ("total", "frequency"):
        raise ValueError(f"majority must be 'total' or 'frequency'; got {majority!r}.")

    def combine(index, ds):
        w = task_weights(weights, ds.shape[0])
        key_i = jax.random.fold_in(key, index)
        return _dare_layers(ds, key_i, w, density=density, majority=majority)

    return _merge(task_vectors, combine, rank=rank, relative_to=relative_to)


def merge_magnitude_prune(
    task_vectors: Sequence[TaskVector],
    *,
    density: float,
    weights: Sequence[float] | None = None,
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """Magnitude pruning per kernel then task arithmetic (:func:`magnitude_prune_delta`) of the
    products, as a rank-``r`` LoRA. Args, returns and errors as :func:`merge_task_arithmetic`,
    plus ``density`` (kept fraction per kernel matrix, in ``(0, 1]``)."""
    density = check_density(density)

    def combine(_, ds):
        return _prune_layers(ds, task_weights(weights, ds.shape[0]), density=density)

    return _merge(task_vectors, combine, rank=rank, relative_to=relative_to)


def merge_per_kernel(
    task_vectors: Sequence[TaskVector],
    combine: Callable[..., jax.Array],
    *,
    weights: Sequence[float] | None = None,
    key: jax.Array | None = None,
    rank: int | Mapping[str, int | None] | None = None,
    relative_to: TaskVector | None = None,
) -> dict[str, Adapter]:
    """Any per-matrix merge rule over task vectors, re-factorised as a rank-``r`` LoRA.

    For every kernel path and stacked layer, ``combine(deltas, w)`` (``combine(deltas, w, key)``
    when ``key`` is given) gets the ``(K, n, m)`` matrix views of the ``K`` updates (float32),
    the ``(K,)`` weights (and a key, ``fold_in(fold_in(key, i), l)`` for kernel ``i`` in path
    order and layer ``l``, as :func:`merge_dare` draws its masks) and returns the ``(n, m)``
    merged update; it is ``vmap``-ed over stacked layers and jitted.

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      combine: the per-matrix rule, e.g. ``lambda d, w: jnp.tensordot(w, d, 1)``.
      weights: ``K`` weights (default 1 each).
      key: optional PRNG key for random rules.
      rank: as in :func:`merge_task_arithmetic` (``None``: exact).
      relative_to: as in :func:`merge_task_arithmetic`.

    Returns:
      ``{path: Adapter}`` of kind ``LoRA(rank, alpha=rank)``.

    Raises:
      ValueError, TypeError: as :func:`merge_task_arithmetic`.

    Example:
      >>> mean = merge_per_kernel([tv_a, tv_b], lambda d, w: d.mean(0), rank=8)
    """
    w = task_weights(weights, len(task_vectors)) if isinstance(task_vectors, Sequence) else None
    if key is None:
        layers = jax.jit(jax.vmap(combine, in_axes=(1, None)))
        return _merge(task_vectors, lambda _, ds: layers(ds, w), rank=rank, relative_to=relative_to)

    @jax.jit
    def keyed(ds, w, key_i):
        keys = jax.vmap(lambda layer: jax.random.fold_in(key_i, layer))(jnp.arange(ds.shape[1]))
        return jax.vmap(combine, in_axes=(1, None, 0))(ds, w, keys)

    def combine_path(index, ds):
        return keyed(ds, w, jax.random.fold_in(key, index))

    return _merge(task_vectors, combine_path, rank=rank, relative_to=relative_to)
