"""PEFT's ``add_weighted_adapter`` combination types, computed on the adapters' products.

:func:`add_weighted_adapter` takes PEFT's eleven ``combination_type`` names and merges the
products ``ΔW_k = s_k A_k B_k`` (never ``A`` and ``B`` apart), so every type is exact where PEFT
is and correct where PEFT is not:

==========================  =====================================  =================================
``combination_type``        ours (per kernel, weights ``w_k``)      PEFT 0.21
==========================  =====================================  =================================
``cat``                     ``[w_k s_k A_k]_k [B_k]_k``, rank       the same (exact)
                            ``Σ r_k``
``linear``                  ``Σ w_k ΔW_k``, exact (rank ≤ Σ r_k)    ``(Σ c_k A_k)(Σ c_k B_k)``,
                                                                    ``c_k = √|w_k s_k|``: cross terms
                                                                    ``A_i B_j`` (issue #3004)
``svd``                     ``Σ w_k ΔW_k``, truncated SVD           the same
``ties`` / ``ties_svd``     TIES (per-kernel trim) of the           ``ties``: on ``A`` and ``B``
                            products; ``_svd``: truncated           apart; ``ties_svd``: the same
``dare_linear[_svd]``       DARE of the products                    as ``ties``
``dare_ties[_svd]``         DARE then TIES sign election            as ``ties``
``magnitude_prune[_svd]``   top-``density`` entries per kernel,     as ``ties``
                            then weighted sum
==========================  =====================================  =================================

The types without ``_svd`` (and ``linear``) keep the merged update exact: a LoRA of rank
``min(n, m)`` (``Σ r_k`` for ``linear`` of LoRAs). The ``_svd`` types and ``svd`` truncate to
``svd_rank``, by default the largest rank among the adapters *at that kernel* (PEFT: the largest
over the whole adapter), so adapters with per-module ranks merge to per-module ranks, which
:func:`lowrank_jax.adapters.save_peft` writes as ``rank_pattern`` and
:func:`lowrank_jax.adapters.load_peft` (or PEFT) reloads (PEFT issue #3737: its merge of adapters
with a ``rank_pattern`` cannot be reloaded). Kernels of any layout (Conv1d ``(k, c_in, c_out)``,
Conv3d, ``DenseGeneral``) merge on their ``(n, m)`` matrix views (PEFT issue #3769: its SVD merges
fail on Conv1d/Conv3d).

Not offered: PEFT's ``svd_clamp`` (a quantile of the SVD factors' entries, which depends on the
SVD's arbitrary signs) and ``svd_driver`` (cuSOLVER only). The random types draw their masks from
``key`` (:func:`~lowrank_jax.merging.merge_dare`); PEFT draws them with ``torch.bernoulli``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from lowrank_jax.adapters.core import Adapter, AdapterSet
from lowrank_jax.adapters.kinds import LoRA
from lowrank_jax.merging import task_merges as tm
from lowrank_jax.merging.task_vectors import task_vector_matrices

__all__ = ["COMBINATION_TYPES", "add_weighted_adapter"]

CombinationType = Literal[
    "svd",
    "linear",
    "cat",
    "ties",
    "ties_svd",
    "dare_ties",
    "dare_linear",
    "dare_ties_svd",
    "dare_linear_svd",
    "magnitude_prune",
    "magnitude_prune_svd",
]
COMBINATION_TYPES: tuple[str, ...] = CombinationType.__args__
_NEEDS_DENSITY = ("ties", "dare", "magnitude_prune")


def _lowrank_forms(
    adapters: Sequence[AdapterSet], path: str, what: str
) -> list[tuple[jax.Array, jax.Array, float]]:
    """Each set's product form ``(a, b, scale)`` at ``path`` (the kind's ``lowrank_factors``)."""
    ads = [s[path] for s in adapters]
    forms = [a.kind.lowrank_factors(a.factors) if isinstance(a, Adapter) else None for a in ads]
    if any(f is None for f in forms):
        raise TypeError(
            f"combination_type={what!r} needs adapters in product form (LoRA); {path!r} has "
            "another kind or a dense update."
        )
    return forms


def _cat(adapters: Sequence[AdapterSet], weights: jax.Array) -> AdapterSet:
    """``[w_k s_k a_k]_k [b_k]_k`` per kernel: PEFT's exact ``cat``."""
    out = {}
    for path in adapters[0]:
        forms = _lowrank_forms(adapters, path, "cat")
        ads = [s[path] for s in adapters]
        layouts = {
            (ad.in_ndim, ad.out_ndim, ad.matrix, a.shape[:-2])
            for ad, (a, _, _) in zip(ads, forms, strict=True)
        }
        if len(layouts) != 1:
            raise ValueError(f"the adapters at {path!r} differ in layout or shape: {layouts}.")
        a = jnp.concatenate([w * s * a for w, (a, _, s) in zip(weights, forms, strict=True)], -1)
        b = jnp.concatenate([b for _, b, _ in forms], -2)
        n, m = ads[0].matrix
        r = a.shape[-1]
        kind = LoRA(rank=r, alpha=float(r), in_ndim=ads[0].in_ndim, out_ndim=ads[0].out_ndim)
        out[path] = Adapter(
            factors={"a": a, "b": b},
            kind=kind,
            in_ndim=ads[0].in_ndim,
            out_ndim=ads[0].out_ndim,
            matrix=(n, m),
        )
    return out


def _default_ranks(adapters: Sequence[AdapterSet]) -> dict[str, int]:
    """PEFT's default ``svd_rank`` (the largest adapter rank), taken per kernel."""
    ranks = {}
    for path in adapters[0]:
        found = [getattr(s[path].kind, "rank", None) if isinstance(s[path], Adapter) else None
                 for s in adapters]  # fmt: skip
        if any(r is None for r in found):
            raise ValueError(
                f"{path!r} holds an update without a rank (a dense update or another kind); "
                "pass svd_rank."
            )
        ranks[path] = max(found)
    return ranks


def add_weighted_adapter(
    adapters: Sequence[AdapterSet],
    weights: Sequence[float],
    *,
    combination_type: CombinationType = "svd",
    svd_rank: int | Mapping[str, int] | None = None,
    density: float | None = None,
    majority_sign_method: Literal["total", "frequency"] = "total",
    key: jax.Array | None = None,
) -> AdapterSet:
    """Merges adapter sets as PEFT's ``LoraModel.add_weighted_adapter``, on the products.

    Args:
      adapters: ``K`` adapter sets (``{path: Adapter}``, e.g. from
        :func:`~lowrank_jax.adapters.init` or :func:`~lowrank_jax.adapters.load_peft`) over the same kernel paths; dense
        updates are accepted by every type but ``cat`` when ``svd_rank`` is given.
      weights: ``K`` floats, any sign (applied to ``ΔW_k``, which includes each LoRA's scale).
      combination_type: one of :data:`COMBINATION_TYPES` (PEFT's names; see the module table).
      svd_rank: output rank of the ``svd`` types, an int or ``{path: int}`` (default: per
        kernel, the largest rank of the adapters there).
      density: kept fraction in ``(0, 1]`` for the ``ties``, ``dare`` and ``magnitude_prune``
        types (per kernel matrix, as PEFT).
      majority_sign_method: ``"total"`` or ``"frequency"`` (``ties`` and ``dare_ties`` types).
      key: PRNG key of the ``dare`` types' masks.

    Returns:
      ``{path: Adapter}`` of kind ``LoRA(rank, alpha=rank)`` (scale 1), for
      :func:`lowrank_jax.adapters.fold`, the adapted forward or
      :func:`~lowrank_jax.adapters.save_peft`.

    Raises:
      ValueError: an unknown combination type, a missing ``density`` or ``key``, ``K``
        weights that do not match, adapters over different paths or shapes, or a bad rank.
      TypeError: ``cat`` of adapters that are not LoRA.

    References:
      PEFT ``LoraModel.add_weighted_adapter`` (0.21) and its issues #3004, #3737, #3769.

    Example:
      >>> merged = add_weighted_adapter([lora_a, lora_b], [1.0, -0.5], combination_type="linear")
    """
    if combination_type not in COMBINATION_TYPES:
        raise ValueError(
            f"combination_type must be one of {COMBINATION_TYPES}; got {combination_type!r}."
        )
    if isinstance(adapters, Mapping) or not isinstance(adapters, Sequence) or not adapters:
        raise TypeError("adapters must be a non-empty list of adapter sets ({path: Adapter}).")
    if len(weights) != len(adapters):
        raise ValueError(f"pass one weight per adapter set: {len(adapters)}, got {len(weights)}.")
    base = combination_type.removesuffix("_svd")
    if base.startswith(_NEEDS_DENSITY) and density is None:
        raise ValueError(f"combination_type={combination_type!r} needs density in (0, 1].")
    if base.startswith("dare") and key is None:
        raise ValueError(f"combination_type={combination_type!r} needs a PRNG key for its masks.")
    if combination_type == "cat":
        task_vector_matrices(adapters)  # same paths and shapes, or a clear error
        return _cat(adapters, jnp.asarray(weights, jnp.float32))
    truncate = combination_type.endswith("svd")
    rank = (svd_rank if svd_rank is not None else _default_ranks(adapters)) if truncate else None
    tvs = list(adapters)
    if base in ("svd", "linear"):
        return tm.merge_task_arithmetic(tvs, weights=weights, rank=rank)
    if base == "ties":
        return tm.merge_ties(
            tvs,
            density=density,
            weights=weights,
            majority=majority_sign_method,
            trim="per_kernel",
            rank=rank,
        )
    if base == "dare_linear":
        return tm.merge_dare(tvs, key, density=density, weights=weights, rank=rank)
    if base == "dare_ties":
        return tm.merge_dare_ties(
            tvs, key, density=density, weights=weights, majority=majority_sign_method, rank=rank
        )
    return tm.merge_magnitude_prune(tvs, density=density, weights=weights, rank=rank)
