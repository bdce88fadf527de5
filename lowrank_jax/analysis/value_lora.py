r"""A trained LoRA on a transformer's value projections, head by head, against its eigengaps (P3).

P3's mean-field picture (:mod:`~lowrank_jax.analysis.attention_dynamics`) predicts that a value
perturbation :math:`\Delta V` changes where the tokens of a head cluster only once it is larger
than that head's eigengap :math:`\lambda_1 - \lambda_2`. This module carries the prediction to a
real LoRA on the value kernels of a BERT-style encoder (row convention ``y = x W``):

* the adapter's update of one layer's value kernel, :math:`\Delta W_v = (A B)\cdot s` (``(d, d)``,
  ``lowrank_jax.adapters.delta``), is cut into the columns :math:`\Delta W_v[:, s_h]` each head
  ``h`` owns (:func:`head_value_kernel_deltas`; they sum to :math:`\Delta W_v` exactly). With the
  output kernel :math:`W_o` the head's OV circuit moves by

  .. math::  \Delta V_h = (\Delta W_v[:, s_h]\, W_o[s_h, :])^\top \quad (d \times d,\ \text{rank} \le \min(r, k)),

  the same convention as :func:`~lowrank_jax.analysis.attention_dynamics.head_matrices`, so that
  :math:`V_h + \Delta V_h` is the OV circuit of the adapted head (:func:`head_value_deltas`);
* :func:`head_gap_ratios` compares :math:`\|\Delta V_h\|_2` with the head's eigengap
  :math:`\mathrm{gap}_h` of the symmetric part of :math:`V_h` (as
  :func:`~lowrank_jax.analysis.attention_dynamics.value_spectrum`), and says whether the top
  eigenvector actually turned (its overlap with the adapted head's);
* :func:`embeddings_from_layer` re-runs the top of a :class:`~lowrank_jax.models.BertEncoder`
  from cached hidden states with one layer's value kernel moved, so the embedding drift of each
  head's :math:`\Delta V_h` alone, or of :math:`s\,\Delta V_h` on a scale grid, costs a partial
  forward pass; :func:`embedding_drift` measures the drift of pooled sentence embeddings;
* :func:`scale_transition` reads a scale sweep: §3 predicts that the drift jumps where
  :math:`s\,\|\Delta V_h\|_2` crosses :math:`\mathrm{gap}_h`, i.e. at :math:`s^* =
  \mathrm{gap}_h / \|\Delta V_h\|_2`; a drift linear in ``s`` grows by the scale ratio instead.

By Weyl's inequality the eigenvalues of the symmetric part move by at most
:math:`\|\Delta V_h\|_2`, so :math:`\|\Delta V_h\|_2 / \mathrm{gap}_h < 1/2` cannot swap the top
two; by Davis–Kahan the top eigenvector turns by :math:`O(\|\Delta V_h\|_2 / \mathrm{gap}_h)`.

References:
  P3: Koubbi, Hernandez & Boussard (ICML 2026; arXiv 2402.15415); their v1 code looks at the
  eigenvalues of V and V + ΔV per block of a Llama-2 LoRA on ``v_proj``. Reconstruction
  (specs §3): the per-head OV-circuit slicing, the spectral-norm-over-gap ratio and the
  embedding-drift measure are ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from jax.typing import ArrayLike

from lowrank_jax.analysis.attention_dynamics import drift_jump_ratio, value_spectrum
from lowrank_jax.models.bert import BertConfig, BertTopClassifier

__all__ = [
    "EmbeddingDrift",
    "HeadGapStats",
    "ScaleTransition",
    "correlations",
    "embedding_drift",
    "embeddings_from_layer",
    "head_gap_ratios",
    "head_value_deltas",
    "head_value_kernel_deltas",
    "log_drift_fit",
    "scale_transition",
    "top_direction_flip",
]


def _check_square(name: str, w: jax.Array, d: int | None = None) -> int:
    if w.ndim != 2 or w.shape[0] != w.shape[1] or (d is not None and w.shape[0] != d):
        want = "(d, d)" if d is None else f"({d}, {d})"
        raise ValueError(f"{name} must be a square {want} kernel; got shape {w.shape}.")
    return w.shape[0]


def _head_width(d: int, num_heads: int) -> int:
    if not isinstance(num_heads, int) or num_heads < 1 or d % num_heads:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int that divides d={d}.")
    return d // num_heads


def head_value_kernel_deltas(delta_value: ArrayLike, *, num_heads: int) -> jax.Array:
    r"""A value-kernel update split by head: ``out[h]`` keeps only head ``h``'s columns.

    ``out[h][:, s_h] = ΔW_v[:, s_h]`` and zero elsewhere, with ``s_h`` the ``k = d / num_heads``
    output columns of head ``h``; :math:`\sum_h` ``out[h]`` :math:`= \Delta W_v` exactly. Adding
    ``out[h]`` to ``W_v`` applies the LoRA to head ``h`` only.

    Args:
      delta_value: ``(d, d)`` update of the value kernel (``adapters.delta`` of its adapter).
      num_heads: heads of the layer; must divide ``d``.

    Returns:
      ``(num_heads, d, d)``.

    Raises:
      ValueError: ``delta_value`` not square, or ``num_heads`` not dividing ``d``.
    """
    dw = jnp.asarray(delta_value)
    d = _check_square("delta_value", dw)
    width = _head_width(d, num_heads)
    owner = jnp.arange(d) // width  # (d,) head of each output column
    mask = (owner[None, :] == jnp.arange(num_heads)[:, None]).astype(dw.dtype)  # (H, d)
    return dw[None] * mask[:, None, :]


def head_value_deltas(
    delta_value: ArrayLike, out_kernel: ArrayLike, *, num_heads: int
) -> jax.Array:
    r"""Each head's OV-circuit update :math:`\Delta V_h = (\Delta W_v[:, s_h] W_o[s_h, :])^\top`.

    ``head_matrices(W_q, W_k, W_v + ΔW_v, W_o)[2] = V_h + ΔV_h`` (a test checks it), and
    :math:`\sum_h \Delta V_h = (\Delta W_v W_o)^\top`.

    Args:
      delta_value: ``(d, d)`` update of the value kernel.
      out_kernel: ``(d, d)`` attention output kernel ``W_o``.
      num_heads: heads of the layer.

    Returns:
      ``(num_heads, d, d)``.

    Raises:
      ValueError: kernels not ``(d, d)`` or ``num_heads`` not dividing ``d``.
    """
    dw, wo = jnp.asarray(delta_value), jnp.asarray(out_kernel)
    d = _check_square("delta_value", dw)
    _check_square("out_kernel", wo, d)
    width = _head_width(d, num_heads)
    dws = dw.reshape(d, num_heads, width).transpose(1, 0, 2)  # (H, d, k)
    wos = wo.reshape(num_heads, width, d)  # (H, k, d)
    return jnp.einsum("hik,hkj->hji", dws, wos)


class HeadGapStats(NamedTuple):
    """Per-head size of a value update against the head's eigengap (see :func:`head_gap_ratios`).

    Attributes (each ``(H,)``):
      gap: ``λ₁ - λ₂`` of the symmetric part of the head's OV circuit ``V_h``.
      delta_norm: spectral norm ``‖ΔV_h‖₂``.
      delta_fro: Frobenius norm ``‖ΔV_h‖_F``.
      ratio: ``‖ΔV_h‖₂ / gap``.
      top_shift: ``λ₁(V_h + ΔV_h) - λ₁(V_h)`` (symmetric parts).
      top_overlap: ``|⟨u₁(V_h), u₁(V_h + ΔV_h)⟩|``, 1 when the leading direction did not turn.
    """

    gap: jax.Array
    delta_norm: jax.Array
    delta_fro: jax.Array
    ratio: jax.Array
    top_shift: jax.Array
    top_overlap: jax.Array


def head_gap_ratios(
    value_kernel: ArrayLike,
    delta_value: ArrayLike,
    out_kernel: ArrayLike,
    *,
    num_heads: int,
) -> HeadGapStats:
    r"""``‖ΔV_h‖₂ / gap_h`` and the eigen-structure change of every head of one layer.

    ``V_h = (W_v[:, s_h] W_o[s_h, :])ᵀ`` and ``ΔV_h`` as in :func:`head_value_deltas`; gaps and
    top eigenvectors from :func:`~lowrank_jax.analysis.attention_dynamics.value_spectrum` (the
    symmetric part), exactly as for the real heads of the part-(b) experiment.

    Args:
      value_kernel: ``(d, d)`` frozen value kernel ``W_v``.
      delta_value: ``(d, d)`` its update ``ΔW_v``.
      out_kernel: ``(d, d)`` output kernel ``W_o``.
      num_heads: heads of the layer.

    Returns:
      :class:`HeadGapStats` of ``(num_heads,)`` arrays.

    Raises:
      ValueError: as :func:`head_value_deltas`.
    """
    wv = jnp.asarray(value_kernel)
    d = _check_square("value_kernel", wv)
    _check_square("delta_value", jnp.asarray(delta_value), d)
    base = head_value_deltas(wv, out_kernel, num_heads=num_heads)  # V_h: the same slicing
    dv = head_value_deltas(delta_value, out_kernel, num_heads=num_heads)

    def one(v, dv):
        sp, sp2 = value_spectrum(v), value_spectrum(v + dv)
        norm = jnp.linalg.norm(dv, ord=2)
        return (
            sp.gap,
            norm,
            jnp.linalg.norm(dv),
            norm / sp.gap,
            sp2.eigenvalues[0] - sp.eigenvalues[0],
            jnp.abs(jnp.dot(sp.top, sp2.top)),
        )

    return HeadGapStats(*jax.vmap(one)(base, dv))


def top_direction_flip(
    v: ArrayLike, dv: ArrayLike, scales: ArrayLike, *, overlap: float = 2**-0.5
) -> float:
    r"""The smallest scale ``s`` at which ``V + s ΔV`` has turned its top eigenvector away.

    The realised counterpart of the Weyl scale :math:`\mathrm{gap}/\|\Delta V\|_2`: the first
    ``s`` on the grid with :math:`|\langle u_1(V), u_1(V + s\Delta V)\rangle| <` ``overlap``
    (default :math:`1/\sqrt2`: turned by more than 45°), with :math:`u_1` the top eigenvector of
    the symmetric part (:func:`~lowrank_jax.analysis.attention_dynamics.value_spectrum`). A
    low-rank ``ΔV`` nearly orthogonal to the top eigenspace needs ``s`` far above the Weyl scale.

    Args:
      v, dv: ``(d, d)`` value matrix and its update.
      scales: ``(p,)`` increasing positive grid.
      overlap: threshold in ``(0, 1)``.

    Returns:
      That scale, or ``inf`` if the top eigenvector never turns that far on the grid.

    Raises:
      ValueError: shapes, grid or threshold invalid.
    """
    v, dv, s = jnp.asarray(v), jnp.asarray(dv), np.asarray(scales, np.float64)
    d = _check_square("v", v)
    _check_square("dv", dv, d)
    if s.ndim != 1 or not len(s) or np.any(s <= 0) or np.any(np.diff(s) <= 0):
        raise ValueError("scales must be a non-empty increasing grid of positive values.")
    if not 0 < overlap < 1:
        raise ValueError(f"overlap must lie in (0, 1); got {overlap}.")
    top = value_spectrum(v).top
    turned = jax.vmap(lambda a: jnp.abs(jnp.dot(top, value_spectrum(v + a * dv).top)))(
        jnp.asarray(s, v.dtype)
    )
    below = np.flatnonzero(np.asarray(turned) < overlap)
    return float(s[below[0]]) if len(below) else float("inf")


def embeddings_from_layer(
    config: BertConfig,
    encoder_params: Mapping[str, Any],
    hidden: ArrayLike,
    attention_mask: ArrayLike,
    *,
    first_layer: int,
    value_delta: ArrayLike | None = None,
) -> jax.Array:
    r"""Mean-pooled outputs of layers ``first_layer..L-1`` of a BERT encoder on cached inputs.

    ``hidden`` is what layer ``first_layer`` receives (``models.attention_inputs(...)[l][0]``);
    ``value_delta`` is added to that layer's value kernel. With ``value_delta = None`` (or zero)
    and ``hidden`` from the unperturbed encoder this equals ``mean_pool(BertEncoder(config).apply
    (...))``, so each head's drift costs a partial forward pass. Runs
    :class:`~lowrank_jax.models.bert.BertTopClassifier` with an identity head.

    Args:
      config: the encoder's architecture.
      encoder_params: ``variables["params"]`` of a ``BertEncoder`` (``encoder/layer_i/...``).
      hidden: ``(b, t, d)`` input of layer ``first_layer``.
      attention_mask: ``(b, t)``, 1 on real tokens.
      first_layer: layer whose value kernel moves, in ``[0, L)``.
      value_delta: ``(d, d)`` update of that layer's value kernel, or None.

    Returns:
      ``(b, d)`` mean-pooled last hidden states (not normalised).

    Raises:
      ValueError: ``first_layer`` out of range or ``value_delta`` of the wrong shape.
    """
    n, d = config.num_hidden_layers, config.hidden_size
    if not isinstance(first_layer, int) or not 0 <= first_layer < n:
        raise ValueError(f"first_layer={first_layer!r} must be an int in [0, {n}).")
    layers = dict(encoder_params["encoder"])
    top = {f"layer_{i}": layers[f"layer_{i}"] for i in range(first_layer, n)}
    if value_delta is not None:
        delta = jnp.asarray(value_delta)
        if delta.shape != (d, d):
            raise ValueError(f"value_delta must be ({d}, {d}); got {delta.shape}.")
        name = f"layer_{first_layer}"
        att = dict(top[name]["attention"])
        att["value"] = {**att["value"], "kernel": att["value"]["kernel"] + delta}
        top[name] = {**top[name], "attention": att}
    dtype = jnp.asarray(hidden).dtype
    top["head"] = {"kernel": jnp.eye(d, dtype=dtype), "bias": jnp.zeros((d,), dtype)}
    model = BertTopClassifier(config, first_layer, d)
    return model.apply({"params": top}, jnp.asarray(hidden), jnp.asarray(attention_mask))


class EmbeddingDrift(NamedTuple):
    """Per-example drift of pooled embeddings (see :func:`embedding_drift`).

    Attributes:
      relative: ``(b,)`` ``‖p_adapted - p_base‖ / ‖p_base‖``.
      cosine: ``(b,)`` ``1 - cos(p_adapted, p_base)`` (that of the normalised sentence embeddings).
    """

    relative: jax.Array
    cosine: jax.Array


def embedding_drift(base: ArrayLike, adapted: ArrayLike) -> EmbeddingDrift:
    r"""How far adapted pooled embeddings moved from the base ones, per example.

    Args:
      base: ``(b, d)`` pooled embeddings of the base model.
      adapted: ``(b, d)`` those of the adapted model, same examples.

    Returns:
      :class:`EmbeddingDrift`; both fields are exactly 0 when ``adapted == base``.

    Raises:
      ValueError: shapes differ or are not ``(b, d)``.
    """
    p, q = jnp.asarray(base), jnp.asarray(adapted)
    if p.shape != q.shape or p.ndim != 2:
        raise ValueError(f"base and adapted must be (b, d) of one shape; got {p.shape}, {q.shape}.")
    pn = jnp.linalg.norm(p, axis=-1)
    rel = jnp.linalg.norm(q - p, axis=-1) / jnp.maximum(pn, 1e-12)
    cos = jnp.sum(p * q, -1) / jnp.maximum(pn * jnp.linalg.norm(q, axis=-1), 1e-12)
    return EmbeddingDrift(rel, jnp.where(jnp.all(p == q, -1), 0.0, 1.0 - cos))


def correlations(x: ArrayLike, y: ArrayLike) -> dict[str, float]:
    """Spearman and Pearson correlation of ``y`` with ``x``, and Pearson of their logs.

    Args:
      x, y: ``(n,)`` with ``n >= 3``; the log correlation is NaN unless both are positive.

    Returns:
      ``{"spearman", "spearman_p", "pearson", "pearson_p", "pearson_log"}``.

    Raises:
      ValueError: shapes differ or ``n < 3``.
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 3:
        raise ValueError(f"x and y must be (n,) with n >= 3; got {x.shape}, {y.shape}.")
    s, p = scipy.stats.pearsonr(x, y)
    rho, rp = scipy.stats.spearmanr(x, y)
    log = (
        float(scipy.stats.pearsonr(np.log(x), np.log(y))[0])
        if np.all(x > 0) and np.all(y > 0)
        else float("nan")
    )
    return {
        "spearman": float(rho),
        "spearman_p": float(rp),
        "pearson": float(s),
        "pearson_p": float(p),
        "pearson_log": log,
    }


def log_drift_fit(
    drift: ArrayLike, delta_norm: ArrayLike, gap: ArrayLike, groups: ArrayLike
) -> dict[str, float]:
    r"""Least squares :math:`\log D = a \log\|\Delta V\| + b \log \mathrm{gap} + c_{g}`.

    One intercept :math:`c_g` per group (e.g. per layer, whose depth alone changes how far a
    perturbation travels). If the drift is a function of :math:`\|\Delta V\| / \mathrm{gap}`
    (specs §3) then :math:`b \approx -a`; if the gap does not matter, :math:`b \approx 0`.

    Args:
      drift, delta_norm, gap: ``(n,)`` positive.
      groups: ``(n,)`` group labels.

    Returns:
      ``{"a", "b", "r2", "r2_without_gap"}`` (the last: the fit without the ``log gap`` term).

    Raises:
      ValueError: shapes differ, a value is not positive, or there are too few points.
    """
    cols = [np.asarray(v, np.float64) for v in (drift, delta_norm, gap)]
    g = np.asarray(groups)
    if any(c.shape != g.shape or c.ndim != 1 for c in cols):
        raise ValueError("drift, delta_norm, gap and groups must be (n,) arrays of one shape.")
    if any(np.any(c <= 0) for c in cols):
        raise ValueError("drift, delta_norm and gap must be > 0 (they are fitted on a log scale).")
    labels = np.unique(g)
    if len(g) < len(labels) + 3:
        raise ValueError(f"{len(g)} points are too few for {len(labels)} groups and 2 slopes.")
    y, ln, lg = (np.log(c) for c in cols)
    dummies = (g[:, None] == labels[None, :]).astype(np.float64)

    def fit(x):
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        res = y - x @ coef
        return coef, 1.0 - float(res @ res) / float(((y - y.mean()) ** 2).sum())

    (a, b, *_), r2 = fit(np.column_stack([ln, lg, dummies]))
    _, r2_norm = fit(np.column_stack([ln, dummies]))
    return {"a": float(a), "b": float(b), "r2": r2, "r2_without_gap": r2_norm}


class ScaleTransition(NamedTuple):
    """How a drift grows along a scale sweep ``s·ΔV`` (see :func:`scale_transition`).

    Attributes:
      jump: ``D(s_hi) / D(s_lo)`` with ``s_lo`` the largest grid scale ``<= s*/2`` and ``s_hi``
        the smallest ``>= 2 s*`` (``drift_jump_ratio``).
      linear: ``s_hi / s_lo``, the jump of a drift linear in ``s`` (4 on a grid with ``s*/2`` and
        ``2 s*``); a transition at ``s*`` gives much more.
      slopes: ``(p - 1,)`` log-log slopes ``Δ log D / Δ log s`` between consecutive scales.
      steepest: the geometric midpoint (in units of ``s*``) of the steepest segment.
      transition_at_gap: ``jump >= 2 linear`` and the steepest slope, at least ``2×`` the median
        slope, lies within ``[s*/2, 2 s*]``.
    """

    jump: float
    linear: float
    slopes: np.ndarray
    steepest: float
    transition_at_gap: bool


def scale_transition(scales: ArrayLike, drift: ArrayLike, *, crossing: float) -> ScaleTransition:
    r"""Whether a drift-vs-scale curve jumps where :math:`s\,\|\Delta V\|_2` crosses the gap.

    Args:
      scales: ``(p,)`` increasing positive scales ``s`` of the update, ``p >= 3``.
      drift: ``(p,)`` positive drift at each scale (e.g. mean relative embedding drift).
      crossing: :math:`s^* = \mathrm{gap} / \|\Delta V\|_2 > 0`.

    Returns:
      :class:`ScaleTransition`.

    Raises:
      ValueError: shapes, ordering or signs wrong.
    """
    s, dr = np.asarray(scales, np.float64), np.asarray(drift, np.float64)
    if s.shape != dr.shape or s.ndim != 1 or len(s) < 3:
        raise ValueError(f"scales and drift must be (p,) with p >= 3; got {s.shape}, {dr.shape}.")
    if np.any(s <= 0) or np.any(np.diff(s) <= 0) or np.any(dr <= 0) or not crossing > 0:
        raise ValueError("scales must increase and be > 0; drift and crossing must be > 0.")
    slopes = np.diff(np.log(dr)) / np.diff(np.log(s))
    i = int(np.argmax(slopes))
    mid = float(np.sqrt(s[i] * s[i + 1]) / crossing)
    u = s / crossing
    lo, hi = np.flatnonzero(u <= 0.5 * (1 + 1e-6)), np.flatnonzero(u >= 2.0 * (1 - 1e-6))
    linear = float(u[hi[0]] / u[lo[-1]]) if len(lo) and len(hi) else float("nan")
    jump = drift_jump_ratio(dr, u, below=0.5, above=2.0, floor=1e-30)
    sharp = jump >= 2 * linear and slopes[i] >= 2 * np.median(slopes) and 0.5 <= mid <= 2.0
    return ScaleTransition(jump, linear, slopes, mid, bool(sharp))
