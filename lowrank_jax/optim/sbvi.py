r"""SBVI: a singular-value SDE with adaptive entropic friction and Stiefel retractions.

**Reconstruction** of P8 (Spectral Bridge Variational Inference) from its abstract, following the
concrete version in ``papers/specs.md`` §8; the authors' exact SDE, friction and schedules are not
public. Each spectral adapter ``ΔW = U diag(σ) Vᵀ`` (:func:`lowrank_jax.adapters.spectral`) with
``U ∈ St(n, r)``, ``V ∈ St(m, r)``, ``σ ≥ 0`` is updated as follows (``η`` the learning rate):

* **Singular values** (the Bures–Wasserstein flow of ``q(σ_i) = N(μ_i, s_i²)`` for the free energy
  ``E_q[L + ½ λ γ_i σ_i²] − T·H(q)``, discretised as a preconditioned Langevin step):

  .. math::
     σ_i \leftarrow \max\!\big(0,\; σ_i − η p_i (∂_{σ_i} L + λ γ_i σ_i) + \sqrt{2 η p_i T_k}\, ξ_i\big),
     \quad ξ_i \sim N(0, 1),

  with the RMSProp preconditioner ``p_i = 1/(√v̂_i + ε)`` of ``∂_{σ_i} L`` (pSGLD; it rescales
  force and friction alike, so the bifurcation condition below does not change).
* **Empirical-Bayes friction** (ARD prior ``σ_i ~ N(0, 1/γ_i)``): an EMA of ``σ_i²`` is kept, and
  every ``eb_every`` steps ``γ_i ← 1/(EMA[σ_i²] + τ)``. A mode survives iff its task force beats the
  friction, ``|E ∂_{σ_i} L| ≳ λ γ_i σ_i``; with ``L ≈ ½c(σ − σ*)²`` the fixed point exists iff
  ``σ*² ≥ 4λ/c`` (``τ → 0``): weak (noise) modes collapse, strong ones are amplified — the
  *spectral bifurcation*.
* **Friction warm-up** (a choice of this reconstruction): ``λ`` ramps up linearly over
  ``friction_warmup`` steps, so that modes can grow and ``U``, ``V`` rotate towards the task
  before the friction competes (from a random start the task force on every mode is weak).
* **Temperature annealing** ``T_k = T₀ · max(0, 1 − k / anneal_steps)``, so the flow ends as a MAP
  estimate.
* **Pruning**: from ``prune_start`` on, every ``eb_every`` steps a mode with
  ``σ_i < κ · max_j σ_j`` is masked for good (its ``σ`` is held at 0 and receives no noise).
* **Factors**: the Riemannian gradient ``ξ = G − U sym(UᵀG)`` (and likewise for ``V``) is
  Adam-preconditioned, projected to the tangent space again, and applied by the QR retraction
  ``U ← qf(U − η ξ̃)`` (``qf`` with ``diag(R) > 0``): ``O((n + m) r²)`` per step, linear in the width.

The transform returns the full update (``new − old``), so ``optax.apply_updates`` lands exactly on
the retracted point; it owns its learning rate. It acts on the *spectral triples* of the tree (any
mapping with keys exactly ``{"u", "s", "v"}``, as in an adapter set of
:func:`lowrank_jax.adapters.spectral` adapters); other parameters go through ``optax.multi_transform``.
Its state is ``O((n + m) r)`` per adapter (Adam moments of ``U``, ``V``) plus ``O(r)`` for the
modes — less than AdaLoRA's (Adam moments plus two sensitivity EMAs of every factor entry).

References:
  P8 SBVI, "Spectral Bridge Variational Inference: Dynamic LoRA via Bures-Wasserstein Gradient
  Flows" (ICML 2026, abstract only): reconstruction per specs §8. Li et al. 2016 (pSGLD);
  Tipping 2001 (ARD / Empirical Bayes); Absil et al. 2008 (QR retraction on the Stiefel manifold).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lowrank_jax.adapters import paths

__all__ = [
    "SBVIState",
    "is_spectral_triple",
    "qr_retraction",
    "sbvi_ranks",
    "scale_by_sbvi",
    "stiefel_project",
]

_KEYS = frozenset({"u", "s", "v"})


def is_spectral_triple(x: Any) -> bool:
    """Whether ``x`` is a spectral adapter's factors: a mapping with keys exactly ``u, s, v``."""
    return isinstance(x, Mapping) and set(x.keys()) == _KEYS


def stiefel_project(u: jax.Array, g: jax.Array) -> jax.Array:
    """Tangent-space projection at ``U ∈ St(n, r)``: ``G − U sym(UᵀG)``."""
    ug = u.T @ g
    return g - u @ (0.5 * (ug + ug.T))


def qr_retraction(u: jax.Array, step: jax.Array) -> jax.Array:
    """``qf(U + step)``: the Q factor of the thin QR with ``diag(R) > 0`` (``O(n r²)``)."""
    q, r = jnp.linalg.qr(u + step)
    sign = jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(q.dtype)
    return q * sign


class SBVIState(NamedTuple):
    """State of :func:`scale_by_sbvi`.

    ``moments`` holds, per spectral triple, ``{"mu_u", "nu_u", "mu_v", "nu_v", "nu_s"}`` (Adam
    moments of the factors, RMS of ``∂L/∂σ``); ``ema``, ``gamma`` and ``mask`` are ``(r,)`` per
    triple (EMA of ``σ²``, friction ``γ``, active modes).
    """

    count: jax.Array
    key: jax.Array
    moments: Any
    ema: Any
    gamma: Any
    mask: Any


def _triples(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_spectral_triple) if is_spectral_triple(x)]


def _check(tree: Any) -> None:
    for x in jax.tree.leaves(tree, is_leaf=is_spectral_triple):
        if not is_spectral_triple(x):
            raise ValueError(
                "scale_by_sbvi updates spectral adapters ({'u', 's', 'v'} factors) only; route "
                "other parameters (heads, LoRA factors) through optax.multi_transform."
            )


def _over_stack(fn, g, p, *rest):
    """Applies a per-matrix update over the stacked-layer axes (``nn.scan``) of a triple."""
    stack = p["s"].shape[:-1]
    if not stack:
        return fn(g, p, *rest)
    *arrays, key = rest
    flat = lambda t: jax.tree.map(lambda a: jnp.reshape(a, (-1, *a.shape[len(stack) :])), t)
    keys = jax.random.split(key, int(jnp.size(p["s"]) // p["s"].shape[-1]))
    out = jax.vmap(fn)(flat(g), flat(p), *map(flat, arrays), keys)
    return jax.tree.map(lambda a: jnp.reshape(a, (*stack, *a.shape[1:])), out)


def scale_by_sbvi(
    *,
    learning_rate: float,
    factor_learning_rate: float | None = None,
    friction: float = 1e-3,
    friction_warmup: int = 0,
    temperature: float = 1e-6,
    anneal_steps: int = 1000,
    eb_every: int = 10,
    eb_decay: float = 0.9,
    tau: float = 1e-4,
    gamma_init: float = 1.0,
    prune_ratio: float = 0.1,
    prune_start: int = 100,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    seed: int = 0,
) -> optax.GradientTransformation:
    """The SBVI optimiser for spectral adapters (see the module docstring for the maths).

    Args:
      learning_rate: ``η`` of the singular-value SDE.
      factor_learning_rate: step of the retracted Riemannian Adam on ``U``, ``V`` (default ``η``).
      friction: ``λ``, the weight of the ARD prior against the task loss.
      friction_warmup: steps over which ``λ`` ramps up linearly from 0, so that modes can grow
        and ``U``, ``V`` align with the task before the bifurcation sets in (0: no ramp).
      temperature: ``T₀``, the initial temperature of the Langevin noise.
      anneal_steps: steps over which ``T`` decays linearly to 0.
      eb_every: ``K``, steps between Empirical-Bayes friction updates (and pruning checks).
      eb_decay: decay of the EMA of ``σ²``.
      tau: ``τ`` in ``γ = 1/(EMA[σ²] + τ)`` (caps the friction at ``1/τ``).
      gamma_init: ``γ`` before the first Empirical-Bayes update.
      prune_ratio: ``κ``; a mode with ``σ_i < κ max_j σ_j`` is pruned for good.
      prune_start: first step at which pruning is checked.
      b1, b2, eps: Adam constants (``b2``/``eps`` also for the ``σ`` preconditioner).
      seed: seed of the Langevin noise (the key lives in the state).

    Returns:
      An ``optax.GradientTransformation`` whose ``update(grads, state, params)`` needs ``params``.

    Raises:
      ValueError: a hyper-parameter is out of range, ``params`` is missing, or the tree has leaves
        outside spectral triples.

    Example:
      >>> ad = adapters.init(key, variables, [(r".*kernel", adapters.spectral(16))])
      >>> tx = scale_by_sbvi(learning_rate=1e-2)
      >>> state = tx.init(ad)
      >>> updates, state = tx.update(grads, state, ad)   # then optax.apply_updates(ad, updates)
      >>> sbvi_ranks(state)                               # {path: discovered rank}
    """
    checks = {
        "learning_rate": learning_rate > 0,
        "friction": friction >= 0,
        "friction_warmup": friction_warmup >= 0,
        "temperature": temperature >= 0,
        "anneal_steps": anneal_steps >= 1,
        "eb_every": eb_every >= 1,
        "eb_decay": 0 <= eb_decay < 1,
        "tau": tau > 0,
        "gamma_init": gamma_init > 0,
        "prune_ratio": 0 <= prune_ratio < 1,
        "prune_start": prune_start >= 0,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"scale_by_sbvi: out-of-range hyper-parameters {bad}; see the docstring.")
    lr_uv = learning_rate if factor_learning_rate is None else factor_learning_rate

    def init_fn(params):
        _check(params)
        per = lambda f: jax.tree.map(f, params, is_leaf=is_spectral_triple)
        moments = per(
            lambda t: {
                "mu_u": jnp.zeros_like(t["u"]),
                "nu_u": jnp.zeros_like(t["u"]),
                "mu_v": jnp.zeros_like(t["v"]),
                "nu_v": jnp.zeros_like(t["v"]),
                "nu_s": jnp.zeros_like(t["s"]),
            }
        )
        return SBVIState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key(seed),
            moments=moments,
            ema=per(lambda t: jnp.zeros_like(t["s"])),
            gamma=per(lambda t: jnp.full_like(t["s"], gamma_init)),
            mask=per(lambda t: jnp.ones(t["s"].shape, bool)),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_sbvi needs params: tx.update(grads, state, params).")
        _check(updates)
        count = state.count + 1
        key, sub = jax.random.split(state.key)
        t = count.astype(jnp.float32)
        temp = temperature * jnp.maximum(0.0, 1.0 - (t - 1.0) / anneal_steps)
        lam = friction * jnp.minimum(1.0, t / max(friction_warmup, 1))
        eb_step = (count % eb_every) == 0
        prune_step = eb_step & (count >= prune_start)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        n_triples = len(_triples(params))
        keys = list(jax.random.split(sub, max(n_triples, 1)))

        def one(g, p, mom, ema, gamma, mask, key):
            u, s, v = p["u"], p["s"], p["v"]
            # Singular values: preconditioned Langevin step with ARD friction.
            gs = jnp.where(mask, g["s"], 0.0)
            nu_s = b2 * mom["nu_s"] + (1 - b2) * gs**2
            pre = 1.0 / (jnp.sqrt(nu_s / bc2) + eps)
            drift = gs + lam * gamma * s
            noise = jnp.sqrt(2 * learning_rate * pre * temp) * jax.random.normal(
                key, s.shape, s.dtype
            )
            s_new = jnp.maximum(s - learning_rate * pre * drift + noise, 0.0)
            ema_new = eb_decay * ema + (1 - eb_decay) * s_new**2
            gamma_new = jnp.where(eb_step, 1.0 / (ema_new + tau), gamma)
            peak = jnp.max(jnp.where(mask, s_new, 0.0))
            mask_new = jnp.where(prune_step, mask & (s_new >= prune_ratio * peak), mask)
            s_new = jnp.where(mask_new, s_new, 0.0)

            # Factors: Riemannian Adam + QR retraction.
            def factor(x, gx, mu, nu):
                xi = stiefel_project(x, gx)
                mu = b1 * mu + (1 - b1) * xi
                nu = b2 * nu + (1 - b2) * xi**2
                step = stiefel_project(x, (mu / bc1) / (jnp.sqrt(nu / bc2) + eps))
                return qr_retraction(x, -lr_uv * step), mu, nu

            u_new, mu_u, nu_u = factor(u, g["u"], mom["mu_u"], mom["nu_u"])
            v_new, mu_v, nu_v = factor(v, g["v"], mom["mu_v"], mom["nu_v"])
            upd = {"u": u_new - u, "s": s_new - s, "v": v_new - v}
            mom = {"mu_u": mu_u, "nu_u": nu_u, "mu_v": mu_v, "nu_v": nu_v, "nu_s": nu_s}
            return upd, mom, ema_new, gamma_new, mask_new

        leaves_g, treedef = jax.tree.flatten(updates, is_leaf=is_spectral_triple)
        flat = lambda tree: treedef.flatten_up_to(tree)
        results = [
            _over_stack(one, *args)
            for args in zip(
                leaves_g,
                flat(params),
                flat(state.moments),
                flat(state.ema),
                flat(state.gamma),
                flat(state.mask),
                keys[: len(leaves_g)],
                strict=True,
            )
        ]
        unflat = lambda i: treedef.unflatten([r[i] for r in results])
        new_state = SBVIState(count, key, unflat(1), unflat(2), unflat(3), unflat(4))
        return unflat(0), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def sbvi_ranks(state: SBVIState) -> dict[str, int]:
    """The discovered rank of every spectral adapter: ``{path: number of unpruned modes}``.

    Paths are the adapter set's (``params/.../kernel``); stacked layers report the total over
    their layers (use ``state.mask`` for the per-layer masks).
    """
    out = {}
    for keypath, mask in jax.tree_util.tree_flatten_with_path(state.mask)[0]:
        name = paths.path_to_str(keypath)
        name = name[: -len("/factors")] if name.endswith("/factors") else name
        out[name] = int(jnp.sum(mask))
    return out
