"""CASA: cluster-aware spectral arbitration, carrying a LoRA from a source model to a target.

A LoRA ``ΔW`` trained on a source kernel ``W_s`` is to be used on a target ``W_t`` obtained from
the source by full fine-tuning or distillation, without data. CASA works in the source's singular
basis ``W_s = U_s diag(s) V_sᵀ`` (full SVD, ``U_s: (n, n)``, ``V_s: (m, m)``), where

* ``C_lora = U_sᵀ ΔW V_s`` is the LoRA and ``C_fft = U_sᵀ (W_t - W_s) V_s`` the target's drift;
* ``k`` is the number of leading directions holding a fraction ``energy`` (0.9) of ``Σ s²`` (square
  kernels; all ``min(n, m)`` otherwise);
* **clusters**: on the top-``k`` block, ``R_ij = |C_lora,ij| / (|s_i - s_j| + 1e-6)`` (``R_ii = 0``)
  is the first-order rotation the LoRA induces between directions ``i`` and ``j`` against their
  spectral gap; the connected components of the graph ``R_ij > rotation_threshold`` are the
  clusters of near-degenerate directions the LoRA rotates together;
* **density**: a cluster is *dominant* in rows (columns) when the mean row (column) norm of the
  top-``k`` block of ``C_fft`` over its members is at least the ``q_threshold`` quantile over
  clusters; ``mask_high`` = rows of row-dominant ∪ columns of column-dominant clusters;
* **score** ``= |C_lora ⊙ C_fft|``, times, inside the top-``k`` block, the cosine between
  ``C_lora`` and ``C_fft`` on the (cluster, cluster) block the entry lies in;
* **arbitration**: ``C_new = C_lora - C_fft`` (undo the drift: the LoRA's routing on the source)
  except on ``mask_high`` (keep the target's manifold: ``C_new = C_lora``), and where additionally
  ``sign C_lora = sign C_fft``, the entry lies in the ``min(n, m)`` square block of singular pairs
  and the score exceeds its ``arbitrate_q`` quantile over those entries, ``C_new =
  maxabs(C_lora, C_fft) - C_fft`` (elect the larger of two agreeing updates instead of adding
  them: no constructive overload);
* **reconstruction**: the rank-``r`` SVD ``C_new ≈ U_c S_c V_cᵀ`` gives the new LoRA
  ``a = U_s U_c S_c^{1/2}`` (``n × r``), ``b = S_c^{1/2} V_cᵀ V_sᵀ`` (``r × m``) for the target:
  ``W_t + a b ≈ W_s + U_s (C_fft + C_new) V_sᵀ``.

Our kernels are ``x @ W`` with ``W: (n_in, m_out)``, the transpose of PyTorch's ``(out, in)``
weights; every step is symmetric under transposition (rows and columns swap roles together), so
this is the same map. Reconstruction of ``transfer.py`` of github.com/Noahwangyuchen/CASA
(``cluster_aware_spectral_arbitration``, read for specs §18) with these deliberate differences:

* the exact truncated SVD instead of ``torch.svd_lowrank(q=r, niter=6)`` (randomised), and the
  drift ``C_fft`` in float32 (the repository stores it in bfloat16);
* the quantile of the arbitration scores over all candidates (the repository subsamples 10M);
* ``weight`` scales the product ``ΔW`` (the repository's ``lora_scale`` multiplies both factors,
  i.e. ``weight = lora_scale²``), and ``ΔW = s · A B`` includes the LoRA's ``alpha / r``;
* connected components by min-label propagation in JAX (jittable) instead of scipy;
* **non-square kernels**: the entrywise arbitration (the suppression step and the quantile of its
  scores) runs only on the ``p × p`` block of singular pairs, ``p = min(n, m)``. Beyond it the full
  SVD's extra ``|n - m|`` left (or right) singular vectors are *any* orthonormal basis of the
  complement of ``W_s``'s column (row) space: LAPACK's choice, which a rotation ``Q`` of the
  complement changes without changing ``W_s``; entrywise signs and magnitudes there, and so the
  repository's suppression there, depend on that choice. On the complement we apply only the
  row/column rule (``C_lora`` in dominant columns (rows), ``C_lora - C_fft`` elsewhere), which
  commutes with ``Q``, so the transferred LoRA depends on ``W_s`` only through its singular
  pairs: it is unchanged under any complement basis and under sign flips ``(u_i, v_i) ->
  (-u_i, -v_i)`` (tested), i.e. deterministic up to degenerate singular values. Square kernels
  are unaffected.

Clustering follows the repository in using the *source's* singular values; under the spectral
rigidity this module measures (:func:`spectral_diagnostics`) they match the target's closely.

References:
  P18, "Exploring Data-Free LoRA Transferability for Video Diffusion Models" (arXiv 2605.01929),
  Cheng, Bai, Shao et al.; its code github.com/Noahwangyuchen/CASA (``transfer.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters import paths as paths_lib
from lowrank_jax.adapters.core import Adapter
from lowrank_jax.merging import trees
from lowrank_jax.merging.task_vectors import task_vector_matrices, to_lora
from lowrank_jax.spectral import svd

__all__ = [
    "Arbitration",
    "SpectralBasis",
    "casa",
    "casa_arbitration",
    "casa_diagnostics",
    "casa_matrix",
    "source_basis",
    "spectral_diagnostics",
]


class SpectralBasis(NamedTuple):
    """A LoRA and a target's drift in the source's singular basis (see the module docstring).

    Attributes:
      u: ``(n, n)`` left singular vectors of ``W_s``.
      s: ``(min(n, m),)`` singular values of ``W_s``, descending.
      v: ``(m, m)`` right singular vectors of ``W_s``.
      c_lora: ``(n, m)`` ``weight · U_sᵀ ΔW V_s``.
      c_fft: ``(n, m)`` ``U_sᵀ (W_t - W_s) V_s``.
    """

    u: jax.Array
    s: jax.Array
    v: jax.Array
    c_lora: jax.Array
    c_fft: jax.Array


class Arbitration(NamedTuple):
    """What :func:`casa_arbitration` decided for one kernel.

    Attributes:
      c_new: ``(n, m)`` arbitrated LoRA in the source basis.
      labels: ``(min(n, m),)`` int32 cluster of each singular direction (the smallest index in
        its cluster), ``-1`` outside the top ``k``.
      k: number of top directions clustered (int32 scalar).
      mask_high: ``(n, m)`` entries in dominant rows or columns (the target's manifold is kept).
      suppress: ``(n, m)`` entries arbitrated to ``maxabs(C_lora, C_fft) - C_fft`` (only in the
        leading ``min(n, m)`` rows and columns: the singular pairs).
    """

    c_new: jax.Array
    labels: jax.Array
    k: jax.Array
    mask_high: jax.Array
    suppress: jax.Array


def _check_hparams(rotation_threshold, q_threshold, arbitrate_q, energy) -> None:
    if not rotation_threshold > 0:
        raise ValueError(f"rotation_threshold must be positive; got {rotation_threshold!r}.")
    for name, q in (("q_threshold", q_threshold), ("arbitrate_q", arbitrate_q)):
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"{name} must be a quantile in [0, 1]; got {q!r}.")
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must lie in (0, 1]; got {energy!r}.")


def _components(adj: jax.Array) -> jax.Array:
    """Connected components of a symmetric boolean graph: each node's smallest reachable index."""
    p = adj.shape[0]

    def body(state):
        labels, _ = state
        nearest = jnp.min(jnp.where(adj, labels[None, :], p), axis=1)
        new = jnp.minimum(labels, nearest)
        return new, jnp.any(new != labels)

    labels, _ = jax.lax.while_loop(lambda st: st[1], body, (jnp.arange(p), jnp.array(True)))
    return labels


def _top_k(s: jax.Array, n: int, m: int, energy: float) -> jax.Array:
    p = s.shape[0]
    if n != m:
        return jnp.asarray(p, jnp.int32)
    cum = jnp.cumsum(s**2) / jnp.maximum(jnp.sum(s**2), 1e-30)
    return jnp.minimum(jnp.sum(cum < energy) + 1, p).astype(jnp.int32)


def _clusters(c_lora_p, s, top, rotation_threshold):
    p = s.shape[0]
    gap = jnp.abs(s[:, None] - s[None, :])
    rot = jnp.abs(c_lora_p) / (gap + 1e-6)
    rot = jnp.where(jnp.eye(p, dtype=bool), 0.0, rot)
    adj = (rot > rotation_threshold) & top[:, None] & top[None, :]
    labels = _components(adj | adj.T)
    member = (labels[None, :] == jnp.arange(p)[:, None]) & top[None, :]  # (cluster, direction)
    return labels, member.astype(c_lora_p.dtype)


def casa_arbitration(
    c_lora: jax.Array,
    c_fft: jax.Array,
    s: jax.Array,
    *,
    rotation_threshold: float = 0.5,
    q_threshold: float = 0.5,
    arbitrate_q: float = 0.85,
    energy: float = 0.9,
) -> Arbitration:
    """CASA's clustering, density stratification, hybrid score and arbitration (steps 0-4).

    Args:
      c_lora: ``(n, m)`` LoRA in the source basis, ``U_sᵀ ΔW V_s``.
      c_fft: ``(n, m)`` target drift in the source basis, ``U_sᵀ (W_t - W_s) V_s``.
      s: ``(min(n, m),)`` the source's singular values, descending.
      rotation_threshold: edge threshold on ``R_ij`` (smaller: fewer, larger clusters).
      q_threshold: cluster-density quantile above which a cluster is dominant.
      arbitrate_q: score quantile above which agreeing entries are arbitrated.
      energy: spectral-energy fraction that fixes ``k`` for square kernels.

    Returns:
      An :class:`Arbitration`; ``c_new`` is the arbitrated LoRA in the source basis. Jittable.

    Raises:
      ValueError: mismatched shapes or hyper-parameters out of range.
    """
    _check_hparams(rotation_threshold, q_threshold, arbitrate_q, energy)
    if c_lora.ndim != 2 or c_lora.shape != c_fft.shape or s.shape != (min(c_lora.shape),):
        raise ValueError(
            f"c_lora {c_lora.shape} and c_fft {c_fft.shape} must be the same (n, m) and s "
            f"{s.shape} hold min(n, m) singular values."
        )
    n, m = c_lora.shape
    p = min(n, m)
    k = _top_k(s, n, m, energy)
    top = jnp.arange(p) < k
    block = top[:, None] & top[None, :]
    cl = jnp.where(block, c_lora[:p, :p], 0.0)
    cf = jnp.where(block, c_fft[:p, :p], 0.0)
    labels, member = _clusters(cl, s, top, rotation_threshold)
    sizes = member.sum(1)
    valid = sizes > 0

    def dominant(norms):
        density = (member @ norms) / (sizes + 1e-6)
        th = jnp.nanquantile(jnp.where(valid, density, jnp.nan), q_threshold)
        return ((density >= th) & valid)[labels] & top

    rows = jnp.zeros((n,), bool).at[:p].set(dominant(jnp.linalg.norm(cf, axis=1)))
    cols = jnp.zeros((m,), bool).at[:p].set(dominant(jnp.linalg.norm(cf, axis=0)))
    mask_high = rows[:, None] | cols[None, :]

    dot = member @ (cl * cf) @ member.T
    norm_l = jnp.sqrt(member @ (cl**2) @ member.T)
    norm_f = jnp.sqrt(member @ (cf**2) @ member.T)
    cosine = dot / (norm_l * norm_f + 1e-8)
    context = jnp.where(block, cosine[labels[:, None], labels[None, :]], 1.0)
    context = jnp.ones((n, m), c_lora.dtype).at[:p, :p].set(context)
    score = jnp.abs(c_lora * c_fft) * context

    same = jnp.sign(c_lora) == jnp.sign(c_fft)
    c_new = jnp.where(mask_high, c_lora, c_lora - c_fft)
    # entrywise arbitration only among singular pairs (the p x p block): beyond it, the rows
    # (n > m) or columns (m > n) of the full SVD are an arbitrary basis of a complement
    pairs = (jnp.arange(n) < p)[:, None] & (jnp.arange(m) < p)[None, :]
    candidates = mask_high & same & pairs
    threshold = jnp.nanquantile(jnp.where(candidates, score, jnp.nan), arbitrate_q)
    suppress = candidates & (score > threshold)
    larger = jnp.where(jnp.abs(c_lora) > jnp.abs(c_fft), c_lora, c_fft)
    c_new = jnp.where(suppress, larger - c_fft, c_new)
    return Arbitration(
        c_new=c_new,
        labels=jnp.where(top, labels, -1).astype(jnp.int32),
        k=k,
        mask_high=mask_high,
        suppress=suppress,
    )


def source_basis(
    delta: jax.Array, w_source: jax.Array, w_target: jax.Array, *, weight: float = 1.0
) -> SpectralBasis:
    """The full SVD of ``W_s`` and the LoRA and drift expressed in it (a :class:`SpectralBasis`).

    For ``n ≠ m`` the singular vectors beyond the first ``min(n, m)`` are an arbitrary basis of
    the complement (LAPACK's); :func:`casa_arbitration` and :func:`casa_matrix`'s ``a @ b`` do not
    depend on it (see the module docstring).

    Args:
      delta: ``(n, m)`` the LoRA's update ``ΔW = s · A B``.
      w_source, w_target: ``(n, m)`` source and target kernels.
      weight: multiplies ``ΔW``.
    """
    if not (delta.shape == w_source.shape == w_target.shape) or delta.ndim != 2:
        raise ValueError(
            f"delta {delta.shape}, w_source {w_source.shape} and w_target {w_target.shape} must "
            "be matrices of one shape."
        )
    dtype = jnp.promote_types(w_source.dtype, jnp.float32)  # float64 stays float64 (tests)
    w_s = w_source.astype(dtype)
    u, s, vt = jnp.linalg.svd(w_s, full_matrices=True)
    c_lora = weight * (u.T @ delta.astype(dtype) @ vt.T)
    c_fft = u.T @ (w_target.astype(dtype) - w_s) @ vt.T
    return SpectralBasis(u, s, vt.T, c_lora, c_fft)


def casa_matrix(
    delta: jax.Array,
    w_source: jax.Array,
    w_target: jax.Array,
    *,
    rank: int,
    weight: float = 1.0,
    rotation_threshold: float = 0.5,
    q_threshold: float = 0.5,
    arbitrate_q: float = 0.85,
    energy: float = 0.9,
) -> tuple[jax.Array, jax.Array]:
    """CASA transfer of one kernel's LoRA update to the target: ``(a (n, r), b (r, m))``.

    ``W_t + a @ b`` is the target with the transferred LoRA. With ``W_t = W_s`` (no drift) and
    ``rank`` at least the rank of ``ΔW`` this returns factors of ``weight · ΔW`` exactly.

    Args:
      delta: ``(n, m)`` the LoRA's update ``ΔW = s · A B`` on the source.
      w_source, w_target: ``(n, m)`` the kernel in the source and in the target model.
      rank: rank ``r`` of the output (the repository's ``target_rank``, default there 32).
      weight: scales ``ΔW`` (the repository's ``lora_scale²``).
      rotation_threshold, q_threshold, arbitrate_q, energy: see :func:`casa_arbitration`.

    Returns:
      ``(a, b)`` with ``a @ b = U_s trunc_r(C_new) V_sᵀ``.
    """
    _check_hparams(rotation_threshold, q_threshold, arbitrate_q, energy)
    basis, arb = _basis_and_arbitration(
        delta,
        w_source,
        w_target,
        jnp.asarray(weight, jnp.promote_types(w_source.dtype, jnp.float32)),
        rotation_threshold=float(rotation_threshold),
        q_threshold=float(q_threshold),
        arbitrate_q=float(arbitrate_q),
        energy=float(energy),
    )
    a_c, b_c = svd.balanced_factors(arb.c_new, rank=rank)
    return basis.u @ a_c, b_c @ basis.v.T


@functools.partial(
    jax.jit, static_argnames=("rotation_threshold", "q_threshold", "arbitrate_q", "energy")
)
def _basis_and_arbitration(delta, w_source, w_target, weight, **hparams):
    basis = source_basis(delta, w_source, w_target, weight=weight)
    return basis, casa_arbitration(basis.c_lora, basis.c_fft, basis.s, **hparams)


def spectral_diagnostics(
    delta: jax.Array,
    w_source: jax.Array,
    w_target: jax.Array,
    *,
    rotation_threshold: float = 0.5,
    q_threshold: float = 0.5,
    arbitrate_q: float = 0.85,
    energy: float = 0.9,
    near_fraction: float = 0.1,
) -> dict[str, jax.Array]:
    """Spectral-rigidity diagnostics of specs §18 (4)(i) for one kernel (scalars).

    Returns:
      ``weight_drift`` ``‖W_t - W_s‖/‖W_s‖``; ``spectrum_drift`` ``‖s_t - s_s‖/‖s_s‖`` (rigid
      spectrum: much smaller than the weight drift, so the drift is a rotation);
      ``rigidity_ratio`` their quotient; ``k``; ``clusters`` and ``multi_clusters`` (size ≥ 2) in
      the top ``k``; ``largest_cluster``; ``fft_near_degenerate_mass``: the share of the
      off-diagonal energy of ``C_fft``'s top-``k`` block on the ``near_fraction`` of pairs with
      the smallest gaps ``|s_i - s_j|`` (``near_fraction`` when the drift ignores the gaps);
      ``fft_in_cluster_mass`` and ``in_cluster_pairs`` (the same share on pairs inside one
      cluster, and the share of such pairs); ``sign_agreement_in_clusters`` and
      ``sign_agreement_elsewhere`` (fraction of nonzero entries where ``sign C_lora = sign
      C_fft``, inside clusters and elsewhere in the top block); ``high_fraction`` and
      ``suppressed_fraction`` of the arbitration.
    """
    _check_hparams(rotation_threshold, q_threshold, arbitrate_q, energy)
    return _diagnostics(
        delta,
        w_source,
        w_target,
        rotation_threshold=float(rotation_threshold),
        q_threshold=float(q_threshold),
        arbitrate_q=float(arbitrate_q),
        energy=float(energy),
        near_fraction=float(near_fraction),
    )


@functools.partial(
    jax.jit,
    static_argnames=("rotation_threshold", "q_threshold", "arbitrate_q", "energy", "near_fraction"),
)
def _diagnostics(delta, w_source, w_target, *, near_fraction, **hparams):
    one = jnp.asarray(1.0, jnp.promote_types(w_source.dtype, jnp.float32))
    basis, arb = _basis_and_arbitration(delta, w_source, w_target, one, **hparams)
    w_s, w_t = w_source.astype(basis.u.dtype), w_target.astype(basis.u.dtype)
    s_t = jnp.linalg.svd(w_t, compute_uv=False)
    weight_drift = jnp.linalg.norm(w_t - w_s) / jnp.linalg.norm(w_s)
    spectrum_drift = jnp.linalg.norm(s_t - basis.s) / jnp.linalg.norm(basis.s)
    p = basis.s.shape[0]
    top = arb.labels >= 0
    off = top[:, None] & top[None, :] & ~jnp.eye(p, dtype=bool)
    cf2 = basis.c_fft[:p, :p] ** 2
    gap = jnp.abs(basis.s[:, None] - basis.s[None, :])
    near = off & (gap <= jnp.nanquantile(jnp.where(off, gap, jnp.nan), near_fraction))
    total = jnp.maximum(jnp.sum(jnp.where(off, cf2, 0.0)), 1e-30)
    same_cluster = (arb.labels[:, None] == arb.labels[None, :]) & top[:, None] & top[None, :]
    in_off = same_cluster & off
    sizes = jnp.sum(arb.labels[None, :] == jnp.arange(p)[:, None], axis=1)
    cl, cf = basis.c_lora[:p, :p], basis.c_fft[:p, :p]
    nonzero = (cl != 0) & (cf != 0)
    agree = jnp.sign(cl) == jnp.sign(cf)

    def share(mask):
        return jnp.sum(mask & agree & nonzero) / jnp.maximum(jnp.sum(mask & nonzero), 1)

    block = top[:, None] & top[None, :]
    return {
        "weight_drift": weight_drift,
        "spectrum_drift": spectrum_drift,
        "rigidity_ratio": spectrum_drift / jnp.maximum(weight_drift, 1e-30),
        "k": arb.k.astype(jnp.float32),
        "clusters": jnp.sum(sizes > 0).astype(jnp.float32),
        "multi_clusters": jnp.sum(sizes > 1).astype(jnp.float32),
        "largest_cluster": jnp.max(sizes).astype(jnp.float32),
        "fft_near_degenerate_mass": jnp.sum(jnp.where(near, cf2, 0.0)) / total,
        "fft_in_cluster_mass": jnp.sum(jnp.where(in_off, cf2, 0.0)) / total,
        "in_cluster_pairs": jnp.sum(in_off) / jnp.maximum(jnp.sum(off), 1),
        "sign_agreement_in_clusters": share(same_cluster),
        "sign_agreement_elsewhere": share(block & ~same_cluster),
        "high_fraction": jnp.mean(arb.mask_high),
        "suppressed_fraction": jnp.mean(arb.suppress),
    }


# ----------------------------------------------------------------------------------------------
# Over parameter pytrees.


def _kernels(source_params: Any, target_params: Any, adapters: Mapping[str, Adapter]):
    """``{path: ((L, n, m) ΔW, (L, n, m) W_s, (L, n, m) W_t, layout)}`` for every adapted path."""
    if not isinstance(adapters, Mapping) or not all(
        isinstance(a, Adapter) for a in adapters.values()
    ):
        raise TypeError("adapters must be one adapter set {path: Adapter} (adapters.init's).")
    src = paths_lib.named_leaves(source_params)
    tgt = paths_lib.named_leaves(target_params)
    trees.check_same_tree(
        src, tgt, what="target params", reference_what="source params", compare="paths"
    )
    for path in sorted(adapters):
        if path not in src:
            raise ValueError(
                f"the adapters differ from the parameter trees at path {path!r}: no such "
                "kernel in the source/target params. Were they made for this model?"
            )
        if jnp.shape(src[path]) != jnp.shape(tgt[path]):
            raise ValueError(
                f"the parameter trees differ at path {path!r}: shapes {jnp.shape(src[path])} "
                f"(source) and {jnp.shape(tgt[path])} (target)."
            )
    out = {}
    for path, (views, layout) in task_vector_matrices([dict(adapters)], base=source_params).items():
        delta = views[0]
        _, n, m = delta.shape
        w_s = jnp.reshape(jnp.asarray(src[path], jnp.float32), (-1, n, m))
        w_t = jnp.reshape(jnp.asarray(tgt[path], jnp.float32), (-1, n, m))
        out[path] = (delta, w_s, w_t, layout)
    return out


def casa(
    source_params: Any,
    target_params: Any,
    adapters: Mapping[str, Adapter],
    *,
    rank: int,
    weight: float = 1.0,
    rotation_threshold: float = 0.5,
    q_threshold: float = 0.5,
    arbitrate_q: float = 0.85,
    energy: float = 0.9,
) -> dict[str, Adapter]:
    """Transfers an adapter set trained on ``source_params`` to ``target_params`` with CASA.

    Args:
      source_params, target_params: parameter pytrees of one architecture (same paths, shapes).
      adapters: the adapter set trained on the source (any kind; its update is materialised).
      rank: output rank per kernel, at most ``min(n, m)`` of every adapted kernel.
      weight, rotation_threshold, q_threshold, arbitrate_q, energy: see :func:`casa_matrix`.

    Returns:
      ``{path: Adapter}`` of kind ``LoRA(rank, alpha=rank)`` for the target; use it with
      ``adapters.fold(target_params, out)`` or the adapted forward.

    Raises:
      ValueError: the two parameter trees differ, or an adapted path is missing from them (the
        message names the first differing path); a bad rank or hyper-parameter.
      TypeError: ``adapters`` is not an adapter set.

    Example:
      >>> moved = casa(source_vars, target_vars, lora_set, rank=16)
      >>> logits = model.apply(adapters.fold(target_vars, moved), x)
    """
    _check_hparams(rotation_threshold, q_threshold, arbitrate_q, energy)
    out = {}
    for path, (delta, w_s, w_t, layout) in _kernels(source_params, target_params, adapters).items():
        _, n, m = delta.shape
        if not isinstance(rank, int) or not 1 <= rank <= min(n, m):
            raise ValueError(f"rank={rank!r} must be an int in [1, {min(n, m)}] at {path!r}.")

        factors = [
            casa_matrix(
                d,
                s,
                t,
                rank=rank,
                weight=weight,
                rotation_threshold=rotation_threshold,
                q_threshold=q_threshold,
                arbitrate_q=arbitrate_q,
                energy=energy,
            )
            for d, s, t in zip(delta, w_s, w_t, strict=True)
        ]
        stacked = tuple(jnp.stack(f) for f in zip(*factors, strict=True))
        out[path] = to_lora(stacked, layout, n, m)
    return out


def casa_diagnostics(
    source_params: Any, target_params: Any, adapters: Mapping[str, Adapter], **kwargs: Any
) -> dict[str, dict[str, float]]:
    """:func:`spectral_diagnostics` of every adapted kernel (means over stacked layers).

    ``kwargs`` are those of :func:`spectral_diagnostics`. Raises as :func:`casa`.
    """
    out = {}
    for path, (delta, w_s, w_t, _) in _kernels(source_params, target_params, adapters).items():
        stats = [
            spectral_diagnostics(d, s, t, **kwargs) for d, s, t in zip(delta, w_s, w_t, strict=True)
        ]
        out[path] = {k: float(np.mean([float(x[k]) for x in stats])) for k in stats[0]}
    return out
