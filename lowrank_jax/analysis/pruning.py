r"""P19 JBR: label-free Jacobian-based structured pruning, and the baseline criteria.

Units are hidden neurons of a Dense stack (Flax ``MLP``: ``params/dense_i/{kernel,bias}``, then
``head``). Pruning unit ``c`` of layer ``l`` removes its *group*: the kernel column
``W_l[:, c]``, the bias ``b_l[c]`` and the next layer's kernel row ``W_{l+1}[c, :]`` (with ReLU a
zeroed unit outputs 0, so masking is exact structured pruning). Scores (higher = keep):

* ``random``; ``l1``: ``Σ|W_l[:, c]| + Σ|W_{l+1}[c, :]|`` (torch-pruning's
  ``MagnitudeImportance(p=1)``, no bias); ``taylor``: ``Σ|W ⊙ ∇L|`` over the same entries
  (torch-pruning's ``TaylorImportance``), gradient of the mean cross-entropy with true labels;
* ``jacobian`` (true labels) and ``jbr`` (pseudo-labels ``y* = argmax f_{w*}(x)`` of the
  *unpruned* model on confident inputs, max softmax > 0.9): for every batch ``B``,
  ``g = ∇_w CE(f_w(x_B), y_B)`` on the *current* model and
  ``s_c += (⟨g_{W_l[:, c]}, W_l[:, c]⟩ + g_{b_c} b_c)² + ⟨g_{W_{l+1}[c, :]}, W_{l+1}[c, :]⟩²``;
* ``exact_tpv``: ``E_x ‖J(x) u_c‖²`` with ``u_c`` the group's weights (pruning is
  ``δu = −u_c``), from per-example Jacobians (``vmap(jacrev)``, chunked) — the quantity JBR's
  batch-gradient inner products stand in for.

:func:`prune_step` ranks all alive units globally (scores divided by their layer's mean over
alive units, as torch-pruning's default ``normalizer="mean"``) and masks the lowest ones;
:func:`prune_iteratively` reaches ``target_ratio`` in ``steps`` equal steps without fine-tuning.

References:
  D. Arpit, arXiv 2512.11089 and github.com/devansharpit/TPV (``applications/benchmark_pruning.py``,
  ``pruning_utils/Selfmake_Importance.py``); Molchanov et al. (2019) for Taylor. BN/LN groups are
  not covered (the MLP has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "PruneGroup",
    "apply_masks",
    "confident_pseudo_labels",
    "cross_entropy",
    "init_masks",
    "mlp_groups",
    "prune_iteratively",
    "prune_step",
    "score_exact_tpv",
    "score_jacobian",
    "score_l1",
    "score_random",
    "score_taylor",
]


class PruneGroup(NamedTuple):
    """Hidden layer ``layer`` whose units feed layer ``next`` (names under ``params["params"]``)."""

    layer: str
    next: str


def mlp_groups(params: Any) -> tuple[PruneGroup, ...]:
    """The prunable groups of a Flax ``MLP``: ``dense_i -> dense_{i+1}`` (the last -> ``head``).

    Raises:
      ValueError: if ``params`` is not an MLP's variables (``{"params": {"dense_0": ...}}``).
    """
    p = params.get("params", {}) if hasattr(params, "get") else {}
    names = sorted((k for k in p if k.startswith("dense_")), key=lambda k: int(k.split("_")[1]))
    if not names or "head" not in p:
        raise ValueError(
            "mlp_groups expects the variables of lowrank_jax.models.MLP with at least one hidden "
            f"layer ({{'params': {{'dense_0', ..., 'head'}}}}); got keys {list(p)}"
        )
    return tuple(PruneGroup(a, b) for a, b in zip(names, [*names[1:], "head"], strict=True))


def init_masks(params: Any, groups: Sequence[PruneGroup]) -> dict[str, jax.Array]:
    """All-ones float masks ``{layer: (m,)}``."""
    return {g.layer: jnp.ones(params["params"][g.layer]["bias"].shape) for g in groups}


def apply_masks(params: Any, masks: dict[str, jax.Array], groups: Sequence[PruneGroup]) -> Any:
    """Zeroes every masked unit's group (kernel column, bias entry, next kernel row)."""
    p = jax.tree.map(lambda a: a, params)  # a copy of the containers
    inner = dict(p["params"])
    for g in groups:
        m = masks[g.layer]
        layer = dict(inner[g.layer])
        layer["kernel"] = layer["kernel"] * m[None, :]
        layer["bias"] = layer["bias"] * m
        inner[g.layer] = layer
        nxt = dict(inner[g.next])
        nxt["kernel"] = nxt["kernel"] * masks[g.layer][:, None]
        inner[g.next] = nxt
    return {**p, "params": inner}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _group_sum(params, grads, groups, fn_out, fn_in) -> dict[str, jax.Array]:
    out = {}
    for g in groups:
        lay, nxt = params["params"][g.layer], params["params"][g.next]
        gl, gn = grads["params"][g.layer], grads["params"][g.next]
        out[g.layer] = fn_out(lay, gl) + fn_in(nxt, gn)
    return out


def score_random(key: jax.Array, masks: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Uniform random scores."""
    keys = jax.random.split(key, len(masks))
    return {
        k: jax.random.uniform(kk, m.shape) for (k, m), kk in zip(masks.items(), keys, strict=True)
    }


def score_l1(params: Any, groups: Sequence[PruneGroup]) -> dict[str, jax.Array]:
    """``Σ|W_l[:, c]| + Σ|W_{l+1}[c, :]|`` (magnitude, torch-pruning ``p=1``, no bias)."""
    return _group_sum(
        params,
        params,
        groups,
        lambda lay, _: jnp.sum(jnp.abs(lay["kernel"]), 0),
        lambda nxt, _: jnp.sum(jnp.abs(nxt["kernel"]), 1),
    )


def score_taylor(
    apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array, groups: Sequence[PruneGroup]
) -> dict[str, jax.Array]:
    """``Σ|W ⊙ ∇L|`` over each group's kernel entries; ``L`` = mean CE on ``(x, y)``."""
    grads = jax.grad(lambda p: cross_entropy(apply_fn(p, x), y))(params)
    return _group_sum(
        params,
        grads,
        groups,
        lambda lay, gl: jnp.sum(jnp.abs(lay["kernel"] * gl["kernel"]), 0),
        lambda nxt, gn: jnp.sum(jnp.abs(nxt["kernel"] * gn["kernel"]), 1),
    )


def score_jacobian(
    apply_fn: Callable,
    params: Any,
    xb: jax.Array,
    yb: jax.Array,
    groups: Sequence[PruneGroup],
) -> dict[str, jax.Array]:
    """JBR / Jacobian scores summed over batches ``xb (B, b, ...)``, ``yb (B, b)``.

    ``s_c = Σ_B (⟨g_{W_l[:, c]}, W_l[:, c]⟩ + g_{b_c} b_c)² + ⟨g_{W_{l+1}[c, :]}, W_{l+1}[c, :]⟩²``
    with ``g = ∇_w CE(f_w(x_B), y_B)``. With ``yb`` the unpruned model's confident pseudo-labels
    (:func:`confident_pseudo_labels`) this is JBR; with true labels the "Jacobian" baseline.
    """

    def one(x, y):
        grads = jax.grad(lambda p: cross_entropy(apply_fn(p, x), y))(params)
        return _group_sum(
            params,
            grads,
            groups,
            lambda lay, gl: (
                (jnp.sum(lay["kernel"] * gl["kernel"], 0) + lay["bias"] * gl["bias"]) ** 2
            ),
            lambda nxt, gn: jnp.sum(nxt["kernel"] * gn["kernel"], 1) ** 2,
        )

    per_batch = jax.lax.map(lambda b: one(*b), (xb, yb))
    return jax.tree.map(lambda s: jnp.sum(s, 0), per_batch)


def confident_pseudo_labels(
    apply_fn: Callable,
    params: Any,
    x: jax.Array,
    *,
    key: jax.Array,
    num_batches: int,
    batch_size: int,
    threshold: float = 0.9,
) -> tuple[jax.Array, jax.Array]:
    """JBR's scoring set: ``(xb, yb)`` of shape ``(B, b, ...)``, ``(B, b)``.

    Pseudo-labels ``argmax f_{w*}(x)`` of the unpruned model; only inputs with max softmax
    ``> threshold`` are kept; ``B · b`` of them are drawn (without replacement when enough).

    Raises:
      ValueError: if no input is confident enough.
    """
    logits = apply_fn(params, x)
    conf = np.asarray(jnp.max(jax.nn.softmax(logits), -1))
    keep = np.flatnonzero(conf > threshold)
    if keep.size == 0:
        raise ValueError(f"no input has max softmax > {threshold}: lower threshold")
    need = num_batches * batch_size
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
    idx = rng.choice(keep, need, replace=keep.size < need)
    labels = np.asarray(jnp.argmax(logits, -1))
    xb = jnp.asarray(x)[idx].reshape(num_batches, batch_size, *x.shape[1:])
    return xb, jnp.asarray(labels[idx].reshape(num_batches, batch_size))


def score_exact_tpv(
    apply_fn: Callable,
    params: Any,
    x: jax.Array,
    groups: Sequence[PruneGroup],
    *,
    chunk: int = 32,
) -> dict[str, jax.Array]:
    """``E_x ‖J(x) u_c‖²`` per unit, ``u_c`` = the group's weights (kernel column, bias, next row).

    ``apply_fn(params, x)`` maps a batch ``(b, ...)`` to ``(b, K)``; per-example Jacobians
    ``(chunk, K, P)`` are formed by ``vmap(jacrev)`` and contracted with ``u_c`` at once.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be positive")
    jac = jax.vmap(jax.jacrev(lambda p, xi: apply_fn(p, xi[None])[0]), in_axes=(None, 0))

    def one(xi):
        j = jac(params, xi[None])["params"]  # leaves (1, K, *leaf)
        out = {}
        for g in groups:
            lay, nxt = params["params"][g.layer], params["params"][g.next]
            ju = (
                jnp.einsum("bkic,ic->bkc", j[g.layer]["kernel"], lay["kernel"])
                + j[g.layer]["bias"] * lay["bias"]
                + jnp.einsum("bkcj,cj->bkc", j[g.next]["kernel"], nxt["kernel"])
            )
            out[g.layer] = jnp.sum(ju**2, axis=(0, 1))
        return out

    per = jax.lax.map(one, x, batch_size=min(chunk, x.shape[0]))
    return jax.tree.map(lambda s: jnp.mean(s, 0), per)


def prune_step(
    scores: dict[str, jax.Array], masks: dict[str, jax.Array], *, num_pruned: int
) -> dict[str, jax.Array]:
    """Masks the lowest-scoring alive units until ``num_pruned`` units are masked in total.

    Scores are divided by their layer's mean over alive units, then ranked globally; each layer
    keeps at least one unit. ``num_pruned`` counts all masked units (earlier steps included).
    """
    total = sum(int(m.size) for m in masks.values())
    if not 0 <= num_pruned <= total - len(masks):
        raise ValueError(f"num_pruned={num_pruned} must lie in [0, {total - len(masks)}]")
    names = list(masks)
    alive = {k: np.asarray(masks[k]) > 0 for k in names}
    norm = []
    for k in names:
        s = np.asarray(scores[k], np.float64)
        mean = s[alive[k]].mean() if alive[k].any() else 1.0
        s = s / (mean if mean > 0 else 1.0)
        norm.append(np.where(alive[k], s, -np.inf))
    flat = np.concatenate(norm)
    layer_of = np.concatenate([np.full(masks[k].size, i) for i, k in enumerate(names)])
    new = np.concatenate([alive[k] for k in names]).copy()
    left = {i: int(alive[k].sum()) for i, k in enumerate(names)}
    todo = num_pruned - int((~new).sum())
    for j in np.argsort(flat, kind="stable"):
        if todo <= 0:
            break
        if not new[j] or left[layer_of[j]] <= 1:
            continue
        new[j] = False
        left[layer_of[j]] -= 1
        todo -= 1
    out, start = {}, 0
    for k in names:
        out[k] = jnp.asarray(new[start : start + masks[k].size], jnp.float32)
        start += masks[k].size
    return out


def prune_iteratively(
    params: Any,
    groups: Sequence[PruneGroup],
    score_fn: Callable[[Any, dict[str, jax.Array], int], dict[str, jax.Array]],
    *,
    target_ratio: float,
    steps: int = 18,
) -> list[dict[str, jax.Array]]:
    """Reaches ``target_ratio`` of masked units in ``steps`` equal steps, without fine-tuning.

    At step ``s`` (1..steps) the scores ``score_fn(masked_params, masks, s)`` are computed on the
    *current* masked model and :func:`prune_step` masks up to ``round(target_ratio · s/steps · U)``
    units (``U`` units in all).

    Returns:
      The masks after each step (``steps`` entries).
    """
    if not 0 < target_ratio < 1 or steps < 1:
        raise ValueError(f"need 0 < target_ratio < 1 and steps >= 1; got {target_ratio}, {steps}")
    masks = init_masks(params, groups)
    total = sum(int(m.size) for m in masks.values())
    history = []
    for s in range(1, steps + 1):
        current = apply_masks(params, masks, groups)
        scores = score_fn(current, masks, s)
        masks = prune_step(scores, masks, num_pruned=round(target_ratio * s / steps * total))
        history.append(masks)
    return history
