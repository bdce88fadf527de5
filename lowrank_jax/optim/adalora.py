r"""AdaLoRA: budgeted rank allocation by importance-masking of ``Λ`` in ``ΔW = P Λ Q``.

The adapters are spectral triples ``{"u": P (n, r), "s": Λ (r,), "v": Qᵀ (m, r)}``
(:func:`lowrank_jax.adapters.singular` with ``init="adalora"``). Each step:

1. sensitivity of every entry ``I = |θ ⊙ ∇θ|``, smoothed ``Ī ← β₁Ī + (1−β₁)I`` and its
   uncertainty ``Ū ← β₂Ū + (1−β₂)|I − Ī|``; score ``s(θ) = Ī · Ū``;
2. the score of triplet ``i`` is ``S_i = s(Λ_i) + mean_j s(P_{ji}) + mean_j s(Q_{ji})``;
3. the inner optimiser's update is applied; on masking steps the ``Λ_i`` whose scores are not
   among the ``b(t)`` largest over *all* adapters are set to zero, with the cubic budget
   schedule ``b(t) = b_T + (b_0 − b_T)(1 − (t − t_i)/(T − t_i − t_f))³`` between the warm-up
   ``t_i`` and the final phase ``T − t_f``, where the last mask is frozen and applied every step.

The orthogonality regulariser ``R = mean_adapters(‖PᵀP − I‖_F + ‖QᵀQ − I‖_F)`` is added to the loss
by the user (:func:`adalora_orthogonality`, PEFT's weight 0.1). Its state holds the inner
optimiser's state plus two EMAs of every factor entry and the masks: about twice SBVI's.

References:
  Zhang et al. 2023, "AdaLoRA: Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning"
  (ICLR), and PEFT's ``RankAllocator``; the baseline of P8 SBVI (specs §8, Appendix A).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.adapters import paths
from lowrank_jax.optim.sbvi import is_spectral_triple

__all__ = [
    "AdaLoRAState",
    "adalora_budget",
    "adalora_orthogonality",
    "adalora_ranks",
    "scale_by_adalora",
]


class AdaLoRAState(NamedTuple):
    """State of :func:`scale_by_adalora`: the inner state, sensitivity EMAs and ``Λ`` masks."""

    count: jax.Array
    inner: Any
    ipt: Any
    unc: Any
    mask: Any


def adalora_budget(
    step: jax.Array, *, init_budget: int, target_budget: int, total_steps: int, init_warmup: int,
    final_warmup: int,
) -> jax.Array:  # fmt: skip
    """AdaLoRA's cubic budget ``b(t)`` (number of unmasked triplets over all adapters)."""
    span = max(total_steps - final_warmup - init_warmup, 1)
    frac = jnp.clip(1.0 - (step - init_warmup) / span, 0.0, 1.0)
    b = target_budget + (init_budget - target_budget) * frac**3
    return jnp.where(step <= init_warmup, init_budget, jnp.floor(b)).astype(jnp.int32)


def adalora_orthogonality(params: Any) -> jax.Array:
    """``mean over triples of ‖PᵀP − I‖_F + ‖QᵀQ − I‖_F`` (add ``weight · R`` to the loss)."""
    terms = []
    for t in jax.tree.leaves(params, is_leaf=is_spectral_triple):
        if not is_spectral_triple(t):
            continue
        for x in (t["u"], t["v"]):
            gram = jnp.einsum("...ni,...nj->...ij", x, x)
            eye = jnp.eye(gram.shape[-1], dtype=gram.dtype)
            terms.append(jnp.sum(jnp.sqrt(jnp.sum((gram - eye) ** 2, axis=(-2, -1)) + 1e-12)))
    if not terms:
        raise ValueError("adalora_orthogonality found no spectral ({'u', 's', 'v'}) factors.")
    return sum(terms) / (len(terms) // 2)


def scale_by_adalora(
    *,
    inner: optax.GradientTransformation,
    target_rank: int,
    total_steps: int,
    init_warmup: int = 0,
    final_warmup: int = 0,
    mask_interval: int = 10,
    beta1: float = 0.85,
    beta2: float = 0.85,
) -> optax.GradientTransformation:
    """AdaLoRA's rank allocation around an ``inner`` optimiser (e.g. ``optax.adam(lr)``).

    Args:
      inner: produces the update of every leaf (learning rate included).
      target_rank: average rank per adapter at the end; the final budget is
        ``target_rank × number of adapters`` (the initial budget is the total ``Σ r``).
      total_steps: ``T``.
      init_warmup, final_warmup: ``t_i`` and ``t_f`` of the budget schedule.
      mask_interval: ``ΔT``, steps between re-masking during the decay phase.
      beta1, beta2: EMA constants of the sensitivity and its uncertainty.

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params)`` needs ``params``.
      Leaves outside spectral triples get the inner update only.

    Raises:
      ValueError: out-of-range arguments or missing ``params``.
    """
    if target_rank < 1 or total_steps < 1 or mask_interval < 1:
        raise ValueError("scale_by_adalora: target_rank, total_steps, mask_interval must be >= 1.")
    if init_warmup < 0 or final_warmup < 0 or init_warmup + final_warmup >= total_steps:
        raise ValueError(
            f"scale_by_adalora: need 0 <= init_warmup + final_warmup < total_steps, got "
            f"{init_warmup} + {final_warmup} vs {total_steps}."
        )

    def triples(tree):
        return [
            x for x in jax.tree.leaves(tree, is_leaf=is_spectral_triple) if is_spectral_triple(x)
        ]

    def init_fn(params):
        ts = triples(params)
        if not ts:
            raise ValueError("scale_by_adalora found no spectral ({'u', 's', 'v'}) adapters.")
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
        per = lambda f: jax.tree.map(
            lambda t: f(t) if is_spectral_triple(t) else None, params, is_leaf=is_spectral_triple
        )
        return AdaLoRAState(
            count=jnp.zeros([], jnp.int32),
            inner=inner.init(params),
            ipt=per(zeros),
            unc=per(zeros),
            mask=per(lambda t: jnp.ones(t["s"].shape, bool)),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_adalora needs params: tx.update(grads, state, params).")
        count = state.count + 1
        inner_upd, inner_state = inner.update(updates, state.inner, params)
        g_tr, p_tr, u_tr = (
            [x for x in jax.tree.leaves(t, is_leaf=is_spectral_triple) if is_spectral_triple(x)]
            for t in (updates, params, inner_upd)
        )
        ipt_l = jax.tree.leaves(state.ipt, is_leaf=is_spectral_triple)
        unc_l = jax.tree.leaves(state.unc, is_leaf=is_spectral_triple)
        mask_l = jax.tree.leaves(state.mask)
        new_ipt, new_unc, scores = [], [], []
        for g, p, ipt, unc in zip(g_tr, p_tr, ipt_l, unc_l, strict=True):
            i_now = jax.tree.map(lambda a, b: jnp.abs(a * b), p, g)
            ipt = jax.tree.map(lambda e, i: beta1 * e + (1 - beta1) * i, ipt, i_now)
            unc = jax.tree.map(
                lambda e, i, m: beta2 * e + (1 - beta2) * jnp.abs(i - m), unc, i_now, ipt
            )
            sc = jax.tree.map(jnp.multiply, ipt, unc)
            scores.append(sc["s"] + jnp.mean(sc["u"], axis=-2) + jnp.mean(sc["v"], axis=-2))
            new_ipt.append(ipt)
            new_unc.append(unc)
        flat = jnp.concatenate([jnp.ravel(s) for s in scores])
        init_budget = flat.shape[0]
        n_adapters = sum(int(jnp.size(s) // s.shape[-1]) for s in scores)
        target = min(target_rank * n_adapters, init_budget)
        budget = adalora_budget(
            count, init_budget=init_budget, target_budget=target, total_steps=total_steps,
            init_warmup=init_warmup, final_warmup=final_warmup,
        )  # fmt: skip
        final = count > total_steps - final_warmup
        remask = (count > init_warmup) & ~final & ((count % mask_interval) == 0)
        # Keep the `budget` largest scores: threshold at the budget-th largest.
        kth = jnp.sort(flat)[::-1][jnp.clip(budget - 1, 0, init_budget - 1)]
        new_masks, new_upd_s = [], []
        for sc, m, p, u in zip(scores, mask_l, p_tr, u_tr, strict=True):
            fresh = sc >= kth
            m_new = jnp.where(remask, fresh, m)
            apply = remask | final
            s_next = p["s"] + u["s"]
            s_next = jnp.where(apply & ~m_new, 0.0, s_next)
            new_masks.append(m_new)
            new_upd_s.append(s_next - p["s"])
        it = iter(new_upd_s)

        def put_s(t):
            return {**t, "s": next(it)} if is_spectral_triple(t) else t

        out = jax.tree.map(put_s, inner_upd, is_leaf=is_spectral_triple)
        treedef_t = jax.tree.structure(state.ipt, is_leaf=is_spectral_triple)
        new_state = AdaLoRAState(
            count=count,
            inner=inner_state,
            ipt=treedef_t.unflatten(new_ipt),
            unc=treedef_t.unflatten(new_unc),
            mask=jax.tree.structure(state.mask).unflatten(new_masks),
        )
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def adalora_ranks(state: AdaLoRAState) -> dict[str, int]:
    """Unmasked triplets per adapter: ``{path: rank}`` (stacked layers summed)."""
    out = {}
    for keypath, mask in jax.tree_util.tree_flatten_with_path(state.mask)[0]:
        name = paths.path_to_str(keypath)
        out[name[: -len("/factors")] if name.endswith("/factors") else name] = int(jnp.sum(mask))
    return out
