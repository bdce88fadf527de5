r"""SABER (P1): subspace-aligned balanced recomposition of per-task LoRA updates.

**Reconstruction** of specs.md §1 from the abstract (the paper's equations are not public). Per
adapted kernel ``W₀: (n, m)`` (inputs ``x @ W``) and task ``t`` with trained update
``ΔW_t: (n, m)``:

1. *Shared subspace* ``U_s: (n, k_s)``: an orthonormal basis of the layer inputs of the tasks so
   far (GPM energy criterion, :func:`lowrank_jax.optim.extend_subspace_memory`). While task ``t``
   trains, half of its LoRA rank is "shared" and aligned to it by
   ``λ_align ‖(I − U_sU_sᵀ) A_t^{sh}‖²_F`` (:func:`alignment_penalty`); the other half is
   initialised off ``U_s``.
2. *Orthogonal decomposition* (:func:`decompose_update`): ``S_t = U_sU_sᵀ ΔW_t`` (shared part)
   and ``D_t = (I − P_{[U_s, Q]}) ΔW_t`` (task-specific part), with ``Q`` the basis of the
   column spaces of earlier specific parts, so that specific parts of different tasks act on
   mutually orthogonal input directions and never on the shared ones.
3. *Energy-aware balanced recomposition* (:func:`recompose`):
   ``W = W₀ + Σ_t β_t S_t + Σ_t λ_t D_t`` with ``E_t = ‖D_t‖²_F``,
   ``λ_t = clip((Ē/E_t)^γ, λ_min, 1)``, ``Ē = mean_t E_t`` (and ``β_t`` likewise from the shared
   energies). A task whose update carries much more energy than the others is damped, so it
   cannot overwrite them; balanced tasks keep their full update.

Additions beyond the spec (with reasons), each with a knob that turns it off:

* *Direction-wise energy balancing of the shared part* (:func:`balance_by_input_energy`, the
  spec's optional "stability check on stored input statistics", made soft): in the eigenbasis
  ``V`` of the old tasks' input covariance ``C_old`` (statistics only, no exemplars) each
  direction of ``S_t`` keeps the gain ``ρ_i = a_i / (a_i + κ c_i)``, ``a_i = v_iᵀ C_t v_i`` and
  ``c_i = v_iᵀ C_old v_i`` the new and old input energies along it. Without it, the shared part
  (which acts on old inputs by construction) overwrites old tasks and SABER forgets more than
  sequential LoRA (measured); ``κ = 0`` is the spec's literal form.
* *Head recalibration*: after recomposition the current task's head is refitted for a few steps
  on the recomposed features (LoDA's "closed-form recalibration", done by gradient steps), since
  the recomposed update differs from the one the head was trained with.

Choice beyond the spec (with reason): the spec's shared combination is "the energy-normalised
average of the ``S_t``"; because each task here trains *on top of* the recomposed model, its
``S_t`` is a residual correction and averaging would divide it by ``T``. ``shared_mode="balanced"``
(default) applies the same energy balancing as for the specific parts; ``shared_mode="mean"``
is the spec's literal average (``mean_t‖S_t‖ · mean_t S_t/‖S_t‖``). The spec's optional
stability check on old-task input statistics is not implemented.

References:
  P1 SABER (Luo, Zhang, Xie, He; ICML 2026, abstract only). Priors named by specs.md: LoDA
  (arXiv 2603.00191, general/specific LoRA subspaces) and EBLoRA (arXiv 2602.00722, energy
  balancing); GPM (Saha et al. 2021) for the subspace memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.adapters.paths import get_path, set_path
from lowrank_jax.continual._src import (
    check_threshold,
    common_args,
    in_batches,
    method_base,
    per_layer,
    replace_a,
)
from lowrank_jax.continual.heads import refit_head
from lowrank_jax.continual.protocol import (
    ContinualMethod,
)
from lowrank_jax.optim.orthogonal_projection import extend_memories
from lowrank_jax.optim.subspace_memory import (
    SubspaceMemory,
    extend_subspace_memory,
    init_subspace_memory,
    project_off,
    project_onto,
)

__all__ = [
    "SaberState",
    "alignment_penalty",
    "balance_by_input_energy",
    "balance_weights",
    "decompose_update",
    "recompose",
    "saber",
]


def alignment_penalty(a: jax.typing.ArrayLike, shared: SubspaceMemory) -> jax.Array:
    r"""``‖(I − U_sU_sᵀ) A‖²_F``: how far the shared factor's input directions leave ``U_s``.

    Args:
      a: input-side LoRA factor ``(n, r)``.
      shared: the shared subspace ``U_s: (n, k)``.

    Returns:
      A scalar; 0 when the columns of ``A`` lie in ``span(U_s)``. An empty memory gives 0 (no
      alignment target yet), not ``‖A‖²``.
    """
    off = project_off(shared, a)
    return jnp.where(shared.size > 0, jnp.sum(jnp.square(off)), 0.0)


def balance_by_input_energy(
    delta: jax.typing.ArrayLike,
    old_cov: jax.typing.ArrayLike,
    new_cov: jax.typing.ArrayLike,
    *,
    strength: float = 1.0,
) -> jax.Array:
    r"""``V diag(ρ) Vᵀ ΔW`` with ``ρ_i = a_i / (a_i + κ c_i)`` in the eigenbasis of ``C_old``.

    ``C_old = V diag(c) Vᵀ`` is the (summed) input covariance of the old tasks and
    ``a_i = v_iᵀ C_new v_i`` the new task's input energy along ``v_i``: the update keeps the
    directions that matter to the new task more than to the old ones and is damped where old
    inputs dominate (``ρ_i = 1`` where ``c_i = 0``).

    Args:
      delta: ``ΔW: (n, m)``.
      old_cov: ``C_old: (n, n)`` symmetric PSD (zeros before the first task: no change).
      new_cov: ``C_new: (n, n)`` symmetric PSD, the current task's input covariance.
      strength: ``κ ≥ 0``; 0 returns ``ΔW`` unchanged.

    Returns:
      ``(n, m)``; ``‖x_old · result‖ ≤ ‖x_old · ΔW‖`` in the ``C_old``-weighted sense.

    Raises:
      ValueError: ``strength < 0`` or shapes that do not fit.
    """
    if not strength >= 0:
        raise ValueError(f"strength must be >= 0, got {strength!r}.")
    delta = jnp.asarray(delta, jnp.float32)
    old_cov = jnp.asarray(old_cov, jnp.float32)
    new_cov = jnp.asarray(new_cov, jnp.float32)
    n = delta.shape[0]
    if old_cov.shape != (n, n) or new_cov.shape != (n, n):
        raise ValueError(
            f"covariances {old_cov.shape}, {new_cov.shape} must be (n, n) = ({n}, {n}) for an "
            f"update of shape {delta.shape}."
        )
    c, v = jnp.linalg.eigh(old_cov)
    c = jnp.maximum(c, 0.0)
    a = jnp.maximum(jnp.einsum("ni,nk,ki->i", v, new_cov, v), 0.0)
    denom = a + strength * c
    rho = jnp.where(denom > 0, a / jnp.maximum(denom, 1e-30), 1.0)
    return v @ (rho[:, None] * (v.T @ delta))


def _joint_projector_off(bases: list[jax.Array], delta: jax.Array) -> jax.Array:
    c = jnp.concatenate(bases, axis=-1)  # (n, k1 + k2), zero columns allowed
    gram = c.T @ c
    coeff = jnp.linalg.pinv(gram, rtol=1e-6, hermitian=True) @ (c.T @ delta)
    return delta - c @ coeff


def decompose_update(
    delta: jax.typing.ArrayLike, shared: SubspaceMemory, specific: SubspaceMemory
) -> tuple[jax.Array, jax.Array]:
    r"""``(S, D) = (U_sU_sᵀ ΔW, (I − P_{[U_s, Q]}) ΔW)``: shared and task-specific parts.

    Args:
      delta: the task's update ``ΔW: (n, m)``.
      shared: shared input subspace ``U_s: (n, k_s)``.
      specific: basis ``Q: (n, k_q)`` of the column spaces of earlier specific parts.

    Returns:
      ``(S, D)``, each ``(n, m)``; ``U_sᵀ D = 0``, ``Qᵀ D = 0``, ``S + D = ΔW`` when ``Q`` lies in
      ``span(U_s)^⊥`` (otherwise the part in ``span(Q)`` is discarded: it belongs to earlier tasks).
    """
    delta = jnp.asarray(delta)
    s = project_onto(shared, delta)
    d = _joint_projector_off([shared.basis.astype(delta.dtype), specific.basis], delta)
    return s, d


def balance_weights(
    energies: jax.typing.ArrayLike, *, gamma: float = 0.5, min_weight: float = 0.25
) -> jax.Array:
    r"""``λ_t = clip((Ē / E_t)^γ, λ_min, 1)`` with ``Ē = mean_t E_t``.

    Args:
      energies: ``(T,)`` energies ``E_t ≥ 0`` (``‖D_t‖²_F``); zero-energy tasks get weight 1.
      gamma: ``γ ≥ 0`` (0: no balancing, every ``λ_t = 1``).
      min_weight: ``λ_min`` in ``(0, 1]``.

    Returns:
      ``(T,)`` weights in ``[λ_min, 1]``; tasks at or below the mean energy keep weight 1.

    Raises:
      ValueError: ``gamma < 0`` or ``min_weight`` outside ``(0, 1]``.
    """
    if not gamma >= 0:
        raise ValueError(f"gamma must be >= 0, got {gamma!r}.")
    if not 0.0 < min_weight <= 1.0:
        raise ValueError(f"min_weight must lie in (0, 1], got {min_weight!r}.")
    e = jnp.asarray(energies, jnp.float32)
    mean = jnp.mean(e)
    ratio = mean / jnp.maximum(e, jnp.finfo(jnp.float32).tiny)
    w = jnp.clip(ratio**gamma, min_weight, 1.0)
    return jnp.where(e > 0, w, 1.0)


def recompose(
    shared_parts: jax.typing.ArrayLike,
    specific_parts: jax.typing.ArrayLike,
    *,
    gamma: float = 0.5,
    min_weight: float = 0.25,
    shared_mode: Literal["balanced", "mean"] = "balanced",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``ΔW = Σ_t β_t S_t + Σ_t λ_t D_t`` (energy-aware balanced recomposition).

    Args:
      shared_parts: ``(T, n, m)`` shared parts ``S_t``.
      specific_parts: ``(T, n, m)`` specific parts ``D_t``.
      gamma: balancing exponent ``γ`` (see :func:`balance_weights`).
      min_weight: ``λ_min``.
      shared_mode: ``"balanced"`` (``β_t`` from the shared energies, like ``λ_t``) or ``"mean"``
        (the spec's energy-normalised average, ``mean_t‖S_t‖ · mean_t S_t/‖S_t‖``).

    Returns:
      ``(ΔW: (n, m), λ: (T,), β: (T,))``; for ``"mean"``, ``β`` holds the effective per-task
      coefficients ``mean‖S‖ / (T‖S_t‖)``.

    Raises:
      ValueError: shapes differ or ``shared_mode`` is unknown.
    """
    s = jnp.asarray(shared_parts)
    d = jnp.asarray(specific_parts)
    if s.shape != d.shape or s.ndim != 3:
        raise ValueError(
            f"shared_parts {s.shape} and specific_parts {d.shape} must both be (T, n, m)."
        )
    lam = balance_weights(jnp.sum(jnp.square(d), axis=(1, 2)), gamma=gamma, min_weight=min_weight)
    shared_energy = jnp.sum(jnp.square(s), axis=(1, 2))
    if shared_mode == "balanced":
        beta = balance_weights(shared_energy, gamma=gamma, min_weight=min_weight)
    elif shared_mode == "mean":
        norms = jnp.sqrt(shared_energy)
        beta = jnp.where(norms > 0, jnp.mean(norms) / (s.shape[0] * jnp.maximum(norms, 1e-30)), 0)
    else:
        raise ValueError(f"shared_mode must be 'balanced' or 'mean', got {shared_mode!r}.")
    total = jnp.einsum("t,tnm->nm", beta.astype(s.dtype), s) + jnp.einsum(
        "t,tnm->nm", lam.astype(d.dtype), d
    )
    return total, lam, beta


# ----------------------------------------------------------------------------------------------
# SABER as a ContinualMethod.


class SaberState(NamedTuple):
    """SABER's record per kernel path (``state.memory`` holds the shared subspace ``U_s``).

    A stacked kernel ``(*L, n, m)`` (``nn.scan``) keeps one record per layer, as ``prod(L)``
    separate kernels would: the shapes below get ``*L`` after any task axis.

    Attributes:
      specific: ``Q``, the basis of the column spaces of the specific parts so far.
      old_cov: ``C_old: (n, n)``, the summed input covariance of the tasks so far.
      shared_parts: ``(T, n, m)`` the balanced shared parts ``S_t``.
      specific_parts: ``(T, n, m)`` the specific parts ``D_t``.
      weights: ``{"lambda": (T,), "beta": (T,)}`` the last recomposition's weights (a stack:
        ``(*L, T)``).
    """

    specific: dict[str, SubspaceMemory]
    old_cov: dict[str, jax.Array]
    shared_parts: dict[str, jax.Array]
    specific_parts: dict[str, jax.Array]
    weights: dict[str, dict[str, jax.Array]]


def saber(
    apply_fn: Callable[..., Any],
    *,
    targets: Sequence[str],
    rank: int = 4,
    alpha: float = 8.0,
    learning_rate: float = 3e-3,
    grad_clip: float = 1.0,
    head_path: str = "params/head",
    shared_threshold: float = 0.95,
    specific_threshold: float = 0.99,
    lambda_align: float = 1.0,
    gamma: float = 0.5,
    min_weight: float = 0.25,
    shared_mode: Literal["balanced", "mean"] = "balanced",
    energy_strength: float = 4.0,
    recalibrate_steps: int = 100,
    recalibrate_batch: int = 64,
    recalibrate_seed: int = 0,
    memory_examples: int = 512,
) -> ContinualMethod:
    r"""SABER (P1, reconstruction) as a :class:`~lowrank_jax.continual.ContinualMethod`.

    Per task (module docstring for the maths): a LoRA branch of rank ``r // 2`` whose ``A``
    starts inside ``U_s`` and is held near it by ``λ_align ‖(I − U_sU_sᵀ) A‖²_F``
    (:attr:`~lowrank_jax.continual.ContinualMethod.loss`), beside a rank ``r − r // 2`` branch
    that starts off ``U_s``. After it, ``ΔW_t`` is split by :func:`decompose_update`, the shared
    part balanced by :func:`balance_by_input_energy` (strength ``κ = energy_strength``), and the
    kernels set to ``W₀ +`` :func:`recompose` of all parts; the head is refitted on the task for
    ``recalibrate_steps`` steps (:func:`~lowrank_jax.continual.heads.refit_head`; numpy seed
    ``[recalibrate_seed, t, 17]``); ``Q`` and then ``U_s`` are extended by GPM (thresholds
    ``specific_threshold``, ``shared_threshold``) from the parts and from the layer inputs of
    the first ``memory_examples`` training inputs.

    Args:
      apply_fn: the model's ``apply(variables, x) -> logits``.
      targets, rank, alpha, learning_rate, grad_clip, head_path: as
        :func:`~lowrank_jax.continual.sequential_lora` (``rank ≥ 2``).
      shared_threshold, specific_threshold: GPM energies in ``(0, 1]``.
      lambda_align: ``λ_align ≥ 0``.
      gamma, min_weight, shared_mode: see :func:`recompose`.
      energy_strength: ``κ ≥ 0`` (0: the spec's literal form).
      recalibrate_steps: head refit steps after recomposition (0: none).
      recalibrate_batch: rows per refit step; recalibrate_seed: its sampling seed.
      memory_examples: training inputs whose layer inputs feed the subspaces.

    Returns:
      A :class:`~lowrank_jax.continual.ContinualMethod` whose ``state.extra`` is a
      :class:`SaberState`.

    Raises:
      ValueError: a hyper-parameter out of range.

    References:
      P1 SABER (reconstruction, specs.md §1); LoDA, EBLoRA, GPM (see the module docstring).
    """
    if rank < 2:
        raise ValueError(f"SABER needs rank >= 2 (half shared, half specific), got {rank!r}.")
    check_threshold("shared_threshold", shared_threshold)
    check_threshold("specific_threshold", specific_threshold)
    if not lambda_align >= 0 or not energy_strength >= 0 or recalibrate_steps < 0:
        raise ValueError(
            "lambda_align, energy_strength and recalibrate_steps must be >= 0, got "
            f"{lambda_align!r}, {energy_strength!r}, {recalibrate_steps!r}."
        )
    balance_weights(jnp.zeros(1), gamma=gamma, min_weight=min_weight)  # validates both
    if shared_mode not in ("balanced", "mean"):
        raise ValueError(f"shared_mode must be 'balanced' or 'mean', got {shared_mode!r}.")
    base = method_base(apply_fn, head_path=head_path, **common_args(locals()))

    def init(variables):
        def extra(w0):
            return SaberState(
                specific={
                    k: init_subspace_memory(w.shape[-2], stack=w.shape[:-2]) for k, w in w0.items()
                },
                old_cov={k: jnp.zeros((*w.shape[:-1], w.shape[-2])) for k, w in w0.items()},
                shared_parts={k: jnp.zeros((0, *w.shape)) for k, w in w0.items()},
                specific_parts={k: jnp.zeros((0, *w.shape)) for k, w in w0.items()},
                weights={},
            )

        return base.init(variables, memory=True, extra=extra)

    def begin_task(state, key, task):
        del task
        k_sh, k_sp = jax.random.split(key)
        mem = base.memories(state)
        sh = base.lora(k_sh, state, rank // 2)
        sp = base.lora(k_sp, state, rank - rank // 2)
        sh = replace_a(
            sh,
            {
                k: jnp.where(  # per layer of a stack: sizes (*L,)
                    mem[k].size[..., None, None] > 0,
                    project_onto(mem[k], ad.factors["a"]),
                    ad.factors["a"],
                )
                for k, ad in sh.items()
            },
        )
        sp = replace_a(sp, {k: project_off(mem[k], ad.factors["a"]) for k, ad in sp.items()})
        trainable = {"shared": sh, "specific": sp, "head": state.head}
        frozen = {"params": base.full(state.params, state.head), "shared_mem": state.memory}
        return trainable, frozen, base.tx()

    def apply(trainable, frozen, x):
        params = base.full(frozen["params"], trainable["head"])
        sets = {"shared": trainable["shared"], "specific": trainable["specific"]}
        return base.adapted(params, sets, x)

    def loss(trainable, frozen, batch, key):
        del batch, key

        def penalty(a, shared):  # summed over the layers of a stack
            return jnp.sum(per_layer(alignment_penalty, a)(a, shared))

        return lambda_align * sum(
            penalty(ad.factors["a"], get_path(frozen["shared_mem"], k))
            for k, ad in trainable["shared"].items()
        )

    def end_task(state, trainable, frozen, task):
        del frozen
        trained = jax.device_get(trainable)
        shared_deltas = base.deltas(state, trained["shared"])
        specific_deltas = base.deltas(state, trained["specific"])
        raw = {k: shared_deltas[k] + specific_deltas[k] for k in state.kernels}
        before = base.layer_inputs(state, task.x[:memory_examples])  # the inputs ΔW_t saw
        ex, mem = state.extra, base.memories(state)
        spec, cov, s_parts, d_parts = (dict(ex.specific), dict(ex.old_cov),
                                       dict(ex.shared_parts), dict(ex.specific_parts))  # fmt: skip
        weights, params = {}, state.params
        balance = functools.partial(balance_by_input_energy, strength=energy_strength)
        combine = functools.partial(
            recompose, gamma=gamma, min_weight=min_weight, shared_mode=shared_mode
        )
        for k, w0 in state.kernels.items():  # a stack (*L, n, m): every step per layer
            s, d = per_layer(decompose_update, w0)(raw[k], mem[k], spec[k])
            x = before[k]  # (*L, b, n)
            new_cov = jnp.swapaxes(x, -1, -2) @ x / x.shape[-2]
            s = per_layer(balance, w0)(s, cov[k], new_cov)
            cov[k] = cov[k] + new_cov
            s_parts[k] = jnp.concatenate([s_parts[k], s[None]])
            d_parts[k] = jnp.concatenate([d_parts[k], d[None]])
            total, lam, beta = per_layer(combine, w0, in_axes=1)(s_parts[k], d_parts[k])
            weights[k] = {"lambda": lam, "beta": beta}
            params = set_path(params, k, w0 + total)
            spec[k] = extend_subspace_memory(
                spec[k], jnp.swapaxes(d, -1, -2), threshold=specific_threshold
            )
        state = state._replace(
            params=params,
            head=trained["head"],
            update=raw,
            extra=SaberState(spec, cov, s_parts, d_parts, weights),
        )
        if recalibrate_steps:  # the recomposed backbone is frozen: its features are read once
            features = in_batches(lambda xb: base.plain_features(state, xb), task.x)
            head = refit_head(
                state.head,
                features,
                task.y,
                task.classes,
                num_classes=task.num_classes,
                steps=recalibrate_steps,
                learning_rate=learning_rate,
                batch_size=recalibrate_batch,
                seed=[recalibrate_seed, task.index, 17],
            )
            state = state._replace(head=head)
        inputs = base.layer_inputs(state, task.x[:memory_examples])
        memory = extend_memories(state.memory, inputs, threshold=shared_threshold)
        return state._replace(memory=memory)

    def diagnostics(state):
        return {
            "saber_weights": {
                k: {n: np.asarray(v).tolist() for n, v in w.items()}
                for k, w in state.extra.weights.items()
            }
        }

    return ContinualMethod(
        init=init,
        begin_task=begin_task,
        apply=apply,
        loss=loss,
        end_task=end_task,
        predict=base.plain_predict,
        features=base.plain_features,
        diagnostics=diagnostics,
    )
