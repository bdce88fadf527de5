"""Task-vector merges on adapter products: task arithmetic, TIES, DARE and any per-matrix rule.

Every merge reads its task vectors (:mod:`~lowrank_jax.merging.task_vectors`: adapter sets of any
kind, DoRA with ``base=``, or dense updates) as the *products* ``ΔW = s · A B`` of a LoRA (the
materialised update of any adapter kind), never ``A`` and ``B`` separately: merging factors
separately, as PEFT's ``add_weighted_adapter`` does for ``combination_type="linear" | "ties" |
"dare_linear"``, multiplies out to cross terms ``s_i s_j A_i B_j`` between different adapters (PEFT
issues #3004, #3013). Each rule is a function of one kernel matrix's ``K`` updates, run by one
driver, :func:`merge_per_kernel`, over every kernel and stacked layer; the merged update is
re-factorised into a LoRA of a stated rank by a truncated SVD (the best rank-``r`` approximation in
Frobenius and spectral norm); task arithmetic of kinds in product form (LoRAs) does this through a
QR of the stacked factors, so no ``n × m`` matrix is formed.

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
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.core import Adapter
from lowrank_jax.merging.per_kernel import Rank, merge_matrices
from lowrank_jax.merging.sparsify import (
    Majority,
    check_density,
    check_trim,
    dare_delta,
    dare_masks,
    dare_ties_delta,
    keep_largest,
    magnitude_prune_delta,
    ties_delta,
    trim_matrix,
)
from lowrank_jax.merging.task_vectors import TaskVector, task_vector_matrices
from lowrank_jax.spectral import svd

__all__ = [
    "merge_dare",
    "merge_dare_ties",
    "merge_magnitude_prune",
    "merge_task_arithmetic",
    "merge_ties",
    "trim_task_vectors",
]

Trim = Literal["global", "per_kernel"]


# ----------------------------------------------------------------------------------------------
# TIES's trimming and task arithmetic's product-form shortcut.


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


def _global_trim(density: float) -> Callable[[dict[str, jax.Array]], dict[str, jax.Array]]:
    return functools.partial(_trim_global, density=density)


def trim_task_vectors(
    task_vectors: Sequence[TaskVector], *, density: float, trim: Trim = "global", base: Any = None
) -> dict[str, jax.Array]:
    """The trimming step of TIES: ``{path: (K, L, n, m)}`` matrix views with all but the largest
    magnitudes of each task vector set to zero.

    Args:
      task_vectors: ``K`` ``{path: Adapter | dense update}`` dicts with the same paths.
      density: kept fraction in ``(0, 1]``.
      base: the parameters the adapters were trained on (DoRA only, see
        :func:`~lowrank_jax.merging.task_vectors.task_vector_matrices`).
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
    views = {p: v for p, (v, _) in task_vector_matrices(task_vectors, base=base).items()}
    if density >= 1.0:
        return views
    if trim == "global":
        return _trim_global(views, density=density)
    per = jax.vmap(jax.vmap(lambda d: trim_matrix(d, density)))
    return {p: per(v) for p, v in views.items()}


def _lowrank_sum(
    tvs: Sequence[TaskVector], path: str, w: jax.Array, rank: int | None
) -> tuple[jax.Array, jax.Array] | None:
    """Task arithmetic of LoRAs through a QR of the stacked factors (no ``n × m`` matrix).

    ``Σ_k w_k s_k A_k B_k = [w_k s_k A_k]_k [B_k]_k = Q_a (R_a R_bᵀ) Q_bᵀ``; the SVD of the small
    core ``R_a R_bᵀ`` gives the truncated factors. ``None`` if some update has no product form
    (``lowrank_factors``: a dense update, DoRA, VeRA, ...).
    """
    ads = [tv[path] for tv in tvs]
    if not all(isinstance(a, Adapter) for a in ads):
        return None
    forms = [a.kind.lowrank_factors(a.factors) for a in ads]
    if any(f is None for f in forms) or len({a.stack_ndim() for a in ads}) != 1:
        return None
    n, m = ads[0].matrix
    a_cat = jnp.concatenate(
        [
            (w[i] * scale) * a.astype(jnp.float32).reshape(-1, n, a.shape[-1])
            for i, (a, _, scale) in enumerate(forms)
        ],
        axis=-1,
    )
    b_cat = jnp.concatenate(
        [b.astype(jnp.float32).reshape(-1, b.shape[-2], m) for _, b, _ in forms], axis=-2
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

    return jax.vmap(one)(a_cat, b_cat)


# ----------------------------------------------------------------------------------------------
# The rules.


def _weighted_sum(d, w):
    return jnp.einsum("k,k...->...", w, d)


def _ties(d, w, *, density, majority):
    return ties_delta(d, weights=w, density=density, majority=majority)


def _dare(d, w, key, *, density, majority=None):
    keep = dare_masks(key, d.shape, density=density)
    if majority is None:
        return dare_delta(d, keep, density=density, weights=w)
    return dare_ties_delta(d, keep, density=density, weights=w, majority=majority)


def _prune(d, w, *, density):
    return magnitude_prune_delta(d, weights=w, density=density)


def _check_majority(majority: str) -> None:
    if majority not in ("total", "frequency"):
        raise ValueError(f"majority must be 'total' or 'frequency'; got {majority!r}.")


def merge_task_arithmetic(
    task_vectors: Sequence[TaskVector],
    *,
    weights: Sequence[float] | None = None,
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """Task arithmetic ``Σ_k w_k ΔW_k`` per kernel, re-factorised as a rank-``r`` LoRA.

    Args, returns and errors as :func:`merge_per_kernel`; ``rank=None`` is exact (for LoRAs the
    stacked rank ``Σ r_k``, without forming ``ΔW``).

    Example:
      >>> merged = merge_task_arithmetic([lora_a, lora_b], weights=(0.5, 0.5), rank=8)
      >>> merged_dora = merge_task_arithmetic([dora_a, dora_b], rank=8, base=variables)
    """
    return merge_matrices(
        task_vectors,
        _weighted_sum,
        weights=weights,
        key=None,
        rank=rank,
        relative_to=relative_to,
        base=base,
        shortcut=_lowrank_sum,
    )


def merge_ties(
    task_vectors: Sequence[TaskVector],
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
    trim: Trim = "global",
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """TIES merge of the products (trim, elect sign, disjoint mean) as a rank-``r`` LoRA.

    ``trim="global"`` (default, the TIES paper) ranks magnitudes over each whole task vector (all
    its kernels and stacked layers at once, :func:`trim_task_vectors`); ``trim="per_kernel"``
    ranks each kernel matrix (each stacked layer) alone and equals PEFT's
    ``add_weighted_adapter(combination_type="ties_svd")``. Sign election and the disjoint mean
    are per entry (:func:`~lowrank_jax.merging.sparsify.ties_delta`). Args, returns and errors as
    :func:`merge_per_kernel`, plus ``density`` (kept fraction in ``(0, 1]``), ``majority``
    (``"total"`` or ``"frequency"``) and ``trim``. ``relative_to`` is not trimmed.

    Example:
      >>> merged = merge_ties([lora_a, lora_b], density=0.2, rank=16)  # the paper's TIES
      >>> like_peft = merge_ties([lora_a, lora_b], density=0.2, rank=16, trim="per_kernel")
    """
    density = check_density(density)
    check_trim(trim)
    _check_majority(majority)
    per_kernel = trim == "per_kernel"
    return merge_matrices(
        task_vectors,
        _ties,
        weights=weights,
        key=None,
        rank=rank,
        relative_to=relative_to,
        base=base,
        options=(("density", density if per_kernel else 1.0), ("majority", majority)),
        prepare=None if per_kernel or density >= 1.0 else _global_trim(density),
    )


def merge_dare(
    task_vectors: Sequence[TaskVector],
    key: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """DARE merge (:func:`~lowrank_jax.merging.sparsify.dare_delta`, masks from ``key``) of the
    products, as a rank-``r`` LoRA.

    Kernel ``i`` (in path order) and stacked layer ``l`` draw their ``(K, n, m)`` masks from
    ``fold_in(fold_in(key, i), l)``. Args, returns and errors as :func:`merge_per_kernel`, plus
    ``key`` and ``density`` (keep probability in ``(0, 1]``).
    """
    density = check_density(density)
    return merge_matrices(
        task_vectors,
        _dare,
        weights=weights,
        key=key,
        rank=rank,
        relative_to=relative_to,
        base=base,
        options=(("density", density),),
    )


def merge_dare_ties(
    task_vectors: Sequence[TaskVector],
    key: jax.Array,
    *,
    density: float,
    weights: Sequence[float] | None = None,
    majority: Majority = "total",
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """DARE-TIES merge (:func:`~lowrank_jax.merging.sparsify.dare_ties_delta`) of the products,
    as a rank-``r`` LoRA.

    Masks are drawn as in :func:`merge_dare` (same ``key``: same masks). Args, returns and errors
    as :func:`merge_dare`, plus ``majority`` (``"total"`` or ``"frequency"``).

    Example:
      >>> merged = merge_dare_ties([lora_a, lora_b], jax.random.key(0), density=0.5, rank=8)
    """
    density = check_density(density)
    _check_majority(majority)
    return merge_matrices(
        task_vectors,
        _dare,
        weights=weights,
        key=key,
        rank=rank,
        relative_to=relative_to,
        base=base,
        options=(("density", density), ("majority", majority)),
    )


def merge_magnitude_prune(
    task_vectors: Sequence[TaskVector],
    *,
    density: float,
    weights: Sequence[float] | None = None,
    rank: Rank = None,
    relative_to: TaskVector | None = None,
    base: Any = None,
) -> dict[str, Adapter]:
    """Magnitude pruning per kernel then task arithmetic
    (:func:`~lowrank_jax.merging.sparsify.magnitude_prune_delta`) of the products, as a rank-``r``
    LoRA. Args, returns and errors as :func:`merge_per_kernel`, plus ``density`` (kept fraction
    per kernel matrix, in ``(0, 1]``)."""
    density = check_density(density)
    return merge_matrices(
        task_vectors,
        _prune,
        weights=weights,
        key=None,
        rank=rank,
        relative_to=relative_to,
        base=base,
        options=(("density", density),),
    )
