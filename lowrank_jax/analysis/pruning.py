r"""P19 JBR: label-free Jacobian-based structured pruning, and the baseline criteria.

Units are the hidden neurons of Dense layers and the output channels of conv layers of a
sequential Flax net (``lowrank_jax.models.MLP``: ``params/dense_i``, then ``head``;
``lowrank_jax.models.CNN``: ``params/conv_j``, ``params/dense_i``, ``head``). Pruning unit ``c``
of layer ``l`` removes its *group*: the outgoing weights ``W_l[..., c]`` (a Dense kernel column
or a conv filter ``(k, k, c_in)``), the bias ``b_l[c]`` and the weights of the next layer that
read unit ``c`` (a Dense kernel row; a conv kernel's input slice ``W_{l+1}[:, :, c, :]``; after
a flatten of an NHWC map, the Dense kernel rows ``i`` with ``i mod C = c``). With ReLU (and max-
pooling) a zeroed unit outputs 0, so masking is exact structured pruning.

Every criterion works on two views of a group, the same for both layer kinds:
``W_out = W_l.reshape(R, C)`` (``R`` = fan-in of one unit, ``C`` units) and
``W_in = W_{l+1}.reshape(S, C, O)`` (``S`` = spatial positions that read one unit: ``k·k`` for a
conv, ``h·w`` after a flatten, 1 for a Dense; ``O`` = the next layer's outputs). Scores (higher =
keep):

* ``random``; ``l1``: ``Σ|W_out[:, c]| + Σ|W_in[:, c, :]|`` (torch-pruning's
  ``MagnitudeImportance(p=1)``, no bias); ``taylor``: ``Σ|W ⊙ ∇L|`` over the same entries
  (torch-pruning's ``TaylorImportance``), gradient of the mean cross-entropy with true labels;
* ``jacobian`` (true labels) and ``jbr`` (pseudo-labels ``y* = argmax f_{w*}(x)`` of the
  *unpruned* model on confident inputs, max softmax > 0.9): for every batch ``B``,
  ``g = ∇_w CE(f_w(x_B), y_B)`` on the *current* model and
  ``s_c += (⟨g_{W_out[:, c]}, W_out[:, c]⟩ + g_{b_c} b_c)² + ⟨g_{W_in[:, c, :]}, W_in[:, c, :]⟩²``;
* ``exact_tpv``: ``E_x ‖J(x) u_c‖²`` with ``u_c`` the group's weights (pruning is
  ``δu = −u_c``), from per-example Jacobians (``vmap(jacrev)``, chunked) — the quantity JBR's
  batch-gradient inner products stand in for.

:func:`prune_step` ranks all alive units globally (scores divided by their layer's mean over
alive units, as torch-pruning's default ``normalizer="mean"``) and masks the lowest ones;
:func:`prune_iteratively` reaches ``target_ratio`` in ``steps`` equal steps without fine-tuning.

References:
  D. Arpit, arXiv 2512.11089 and github.com/devansharpit/TPV (``applications/benchmark_pruning.py``,
  ``pruning_utils/Selfmake_Importance.py``); Molchanov et al. (2019) for Taylor. BN/LN groups are
  not covered (the models have none).
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
    "init_masks",
    "mlp_groups",
    "prune_iteratively",
    "prune_step",
    "score_exact_tpv",
    "score_jacobian",
    "score_l1",
    "score_random",
    "score_taylor",
    "sequential_groups",
]


class PruneGroup(NamedTuple):
    """Hidden layer ``layer`` whose units feed layer ``next`` (names under ``params["params"]``)."""

    layer: str
    next: str


def sequential_groups(
    params: Any, *, prefixes: Sequence[str] = ("conv_", "dense_"), head: str = "head"
) -> tuple[PruneGroup, ...]:
    """The prunable groups of a sequential net: layers ``<prefix><i>`` in order, then ``head``.

    Layers are ordered by the position of their prefix in ``prefixes``, then by ``i``; each
    feeds the next (the last one feeds ``head``). ``lowrank_jax.models.CNN`` gives
    ``conv_0 -> conv_1 -> ... -> dense_0 -> ... -> head``.

    Raises:
      ValueError: if no layer matches, ``head`` is missing, or a layer has no ``kernel``/``bias``.
    """
    p = params.get("params", {}) if hasattr(params, "get") else {}
    names = []
    for pre in prefixes:
        mine = {int(k[len(pre) :]): k for k in p if k.startswith(pre) and k[len(pre) :].isdigit()}
        names += [mine[i] for i in sorted(mine)]
    if not names or head not in p:
        raise ValueError(
            f"sequential_groups expects variables {{'params': {{<{'|'.join(prefixes)}><i>, ..., "
            f"{head!r}}}}} with at least one hidden layer; got keys {list(p)}"
        )
    for k in names:
        if not {"kernel", "bias"} <= set(p[k]):
            raise ValueError(f"layer {k!r} needs a kernel and a bias; has {list(p[k])}")
    return tuple(PruneGroup(a, b) for a, b in zip(names, [*names[1:], head], strict=True))


def mlp_groups(params: Any) -> tuple[PruneGroup, ...]:
    """The prunable groups of a Flax ``MLP``: ``dense_i -> dense_{i+1}`` (the last -> ``head``).

    Raises:
      ValueError: if ``params`` is not an MLP's variables (``{"params": {"dense_0": ...}}``).
    """
    try:
        return sequential_groups(params, prefixes=("dense_",))
    except ValueError as e:
        raise ValueError(
            "mlp_groups expects the variables of lowrank_jax.models.MLP with at least one hidden "
            f"layer ({{'params': {{'dense_0', ..., 'head'}}}}): {e}"
        ) from None


def _out_view(kernel: jax.Array) -> jax.Array:
    """``(..., C) -> (R, C)``: the fan-in of each unit (Dense column, flattened conv filter)."""
    return kernel.reshape(-1, kernel.shape[-1])


def _in_view(kernel: jax.Array, units: int, name: str = "next layer") -> jax.Array:
    """``(..., C·?, O) -> (S, C, O)``: the weights of the next layer that read each unit.

    A Dense ``(S·C, O)`` read from a flattened NHWC map (channel fastest), a conv ``(k, k, C, O)``
    or a Dense ``(C, O)`` all reshape to ``(S, C, O)``.
    """
    out = kernel.shape[-1]
    ok = kernel.shape[-2] == units if kernel.ndim > 2 else kernel.shape[0] % units == 0
    if not ok:
        raise ValueError(
            f"{name} kernel {kernel.shape} cannot read {units} units: a conv needs c_in = "
            f"{units}, a Dense a fan-in that is a multiple of {units} (flattened NHWC)"
        )
    return kernel.reshape(-1, units, out)


def _views(params: Any, g: PruneGroup) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(W_out (R, C), b (C,), W_in (S, C, O))`` of group ``g`` in ``params`` (or its gradient)."""
    lay, nxt = params["params"][g.layer], params["params"][g.next]
    units = lay["kernel"].shape[-1]
    return _out_view(lay["kernel"]), lay["bias"], _in_view(nxt["kernel"], units, g.next)


def init_masks(params: Any, groups: Sequence[PruneGroup]) -> dict[str, jax.Array]:
    """All-ones float masks ``{layer: (C,)}``."""
    return {g.layer: jnp.ones(params["params"][g.layer]["bias"].shape) for g in groups}


def apply_masks(params: Any, masks: dict[str, jax.Array], groups: Sequence[PruneGroup]) -> Any:
    """Zeroes every masked unit's group (outgoing weights, bias entry, the next layer's reads)."""
    p = jax.tree.map(lambda a: a, params)  # a copy of the containers
    inner = dict(p["params"])
    for g in groups:
        m = masks[g.layer]
        layer = dict(inner[g.layer])
        layer["kernel"] = layer["kernel"] * m
        layer["bias"] = layer["bias"] * m
        inner[g.layer] = layer
        nxt = dict(inner[g.next])
        k = nxt["kernel"]
        nxt["kernel"] = (_in_view(k, m.shape[0], g.next) * m[None, :, None]).reshape(k.shape)
        inner[g.next] = nxt
    return {**p, "params": inner}


def _group_sum(params, grads, groups, fn) -> dict[str, jax.Array]:
    """``{layer: fn(views of params, views of grads)}`` with :func:`_views` per group."""
    return {g.layer: fn(_views(params, g), _views(grads, g)) for g in groups}


def score_random(key: jax.Array, masks: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Uniform random scores."""
    keys = jax.random.split(key, len(masks))
    return {
        k: jax.random.uniform(kk, m.shape) for (k, m), kk in zip(masks.items(), keys, strict=True)
    }


def score_l1(params: Any, groups: Sequence[PruneGroup]) -> dict[str, jax.Array]:
    """``Σ|W_out[:, c]| + Σ|W_in[:, c, :]|`` (magnitude, torch-pruning ``p=1``, no bias)."""
    return _group_sum(
        params,
        params,
        groups,
        lambda w, _: jnp.sum(jnp.abs(w[0]), 0) + jnp.sum(jnp.abs(w[2]), (0, 2)),
    )


def score_taylor(
    apply_fn: Callable, params: Any, x: jax.Array, y: jax.Array, groups: Sequence[PruneGroup]
) -> dict[str, jax.Array]:
    """``Σ|W ⊙ ∇L|`` over each group's kernel entries; ``L`` = mean CE on ``(x, y)``."""
    grads = jax.grad(
        lambda p: optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()
    )(params)
    return _group_sum(
        params,
        grads,
        groups,
        lambda w, d: jnp.sum(jnp.abs(w[0] * d[0]), 0) + jnp.sum(jnp.abs(w[2] * d[2]), (0, 2)),
    )


def score_jacobian(
    apply_fn: Callable,
    params: Any,
    xb: jax.Array,
    yb: jax.Array,
    groups: Sequence[PruneGroup],
) -> dict[str, jax.Array]:
    """JBR / Jacobian scores summed over batches ``xb (B, b, ...)``, ``yb (B, b)``.

    ``s_c = Σ_B (⟨g_{W_out[:, c]}, W_out[:, c]⟩ + g_{b_c} b_c)² + ⟨g_{W_in[:, c, :]}, W_in[:, c, :]⟩²``
    with ``g = ∇_w CE(f_w(x_B), y_B)``. With ``yb`` the unpruned model's confident pseudo-labels
    (:func:`confident_pseudo_labels`) this is JBR; with true labels the "Jacobian" baseline.
    """

    def one(x, y):
        grads = jax.grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()
        )(params)
        return _group_sum(
            params,
            grads,
            groups,
            lambda w, d: (
                (jnp.sum(w[0] * d[0], 0) + w[1] * d[1]) ** 2 + jnp.sum(w[2] * d[2], (0, 2)) ** 2
            ),
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
    """``E_x ‖J(x) u_c‖²`` per unit, ``u_c`` = the group's weights (``W_out[:, c]``, ``b_c``,
    ``W_in[:, c, :]``).

    ``apply_fn(params, x)`` maps a batch ``(b, ...)`` to ``(b, K)``; per-example Jacobians
    ``(chunk, K, P)`` are formed by ``vmap(jacrev)`` (``lax.map`` over chunks of ``chunk``
    inputs, so memory is ``O(chunk · K · P)``) and contracted with ``u_c`` at once.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be positive")
    jac = jax.vmap(jax.jacrev(lambda p, xi: apply_fn(p, xi[None])[0]), in_axes=(None, 0))

    def one(xi):
        j = jac(params, xi[None])  # leaves (1, K, *leaf)
        out = {}
        for g in groups:
            wo, b, wi = _views(params, g)
            jo, jb, ji = (
                a.reshape(*a.shape[:2], *v.shape)
                for a, v in zip(_views_j(j, g), (wo, b, wi), strict=True)
            )
            ju = jnp.einsum("bkrc,rc->bkc", jo, wo) + jb * b + jnp.einsum("bksco,sco->bkc", ji, wi)
            out[g.layer] = jnp.sum(ju**2, axis=(0, 1))
        return out

    per = jax.lax.map(one, x, batch_size=min(chunk, x.shape[0]))
    return jax.tree.map(lambda s: jnp.mean(s, 0), per)


def _views_j(jac: Any, g: PruneGroup) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The raw Jacobian leaves ``(b, K, *leaf)`` of group ``g`` (reshaped by the caller)."""
    lay, nxt = jac["params"][g.layer], jac["params"][g.next]
    return lay["kernel"], lay["bias"], nxt["kernel"]


def prune_step(
    scores: dict[str, jax.Array], masks: dict[str, jax.Array], *, num_pruned: int
) -> dict[str, jax.Array]:
    """Masks the lowest-scoring alive units until ``num_pruned`` units are masked in total.

    Scores are divided by their layer's mean over alive units, then ranked globally; each layer
    keeps at least one unit. ``num_pruned`` counts all masked units (earlier steps included).
    """
    total = sum(int(m.size) for m in masks.values())
    if not 0 <= num_pruned <= total - len(masks):
        raise ValueError(
            f"num_pruned={num_pruned} must lie in [0, {total - len(masks)}]: every layer keeps at "
            "least one unit; prune fewer units (a lower target ratio) or prune more layers."
        )
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
