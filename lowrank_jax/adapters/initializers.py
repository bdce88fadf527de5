"""Data-aware LoRA initialisers: LoRA-DA and the baselines PiSSA, LoRA-GA, LoRA-One and EVA.

Each initialiser takes ``(key, params, rules, batch)`` like :func:`lowrank_jax.adapters.init` plus
the model, and returns an adapter set of LoRA adapters (the rules' specs give rank and scale ``s``).
The model is given as ``apply_fn(params, *args, **kw)`` and ``loss_fn(forward, batch) -> scalar``,
where ``forward(*args, **kw)`` runs the model with the parameters bound, e.g.
``loss_fn = lambda fwd, b: cross_entropy(fwd(b["x"]), b["y"])``; ``batch`` is a pytree of arrays with
a leading example axis, and the loss is the mean over the examples it is given.

Statistics come from :func:`lowrank_jax.adapters.kfac.kfac_statistics`, which runs ``jax.vmap(jax.grad(...))`` over single
examples with a *statistics probe* on every targeted kernel: the probe adds zero to the layer's
output and its custom VJP returns, per example, ``Σ_t a_t g_tᵀ`` (the kernel gradient),
``Σ_t a_t a_tᵀ`` (K-FAC's input factor), ``Σ_t g_t ⊙ g_t`` (the diagonal output Fisher) and the
token count, where ``a_t`` is the layer input and ``g_t`` the loss gradient at its output for token
``t``. It works for any model and kernel layout that :func:`lowrank_jax.adapters.adapt` supports
(including ``nn.scan``-stacked kernels); tokens are all the positions the layer sees (padding
included).

Which initial model each one gives (``s`` the LoRA scale, all in kernel convention ``W: (n, m)``):

=========  ========================================================  ===============================
method     folded update ``s·A₀B₀``                                   then
=========  ========================================================  ===============================
LoRA-DA    ``(s/γ) a₀a₀ᵀΔ``, ``Δ`` the normalised natural gradient    keep ``W₀`` (as the paper)
LoRA-One   ``−(s/γ) [G]_r / σ₁(G)``                                   keep ``W₀`` (as the paper)
LoRA-GA    ``(s√m/γ) L_{:r} R_{r:2r}ᵀ`` from ``G = L Σ Rᵀ``            ``params = unfold(params, ad)``
PiSSA      ``[W₀]_r`` (top-``r`` SVD; ``lora(init="pissa")``)          ``params = unfold(params, ad)``
EVA        ``0`` (``A₀`` = top activation directions, ``B₀ = 0``)     nothing
=========  ========================================================  ===============================

References:
  P6 LoRA-DA, arXiv 2510.24561 (ICML 2026), algorithm from the authors' code ``zqy0126/LoRA-DA``
  as summarised in specs §6 (defaults ``S = 256``, ``α = 1``, ``β = 0.03``, ``γ = 1024``,
  ``δ = 1e-6``); LoRA-One (Zhang et al. 2025); LoRA-GA (Wang et al. 2024); PiSSA (Meng et al.
  2024); EVA (Paischer et al. 2024), here with the activation SVD computed as the eigenvectors of the
  uncentred second moment ``E[aaᵀ]`` (the same subspace) and PEFT's ``rho`` redistribution.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lowrank_jax.adapters import paths
from lowrank_jax.adapters.core import Adapter, AdapterSet, resolve_layout, split_shape
from lowrank_jax.adapters.kfac import (
    LossFn,
    batch_size,
    check_lora_rules,
    kfac_statistics,
)
from lowrank_jax.adapters.kinds import LoRA
from lowrank_jax.spectral import svd

__all__ = [
    "eva",
    "eva_factors",
    "lora_da",
    "lora_da_factors",
    "lora_ga",
    "lora_ga_factors",
    "lora_one",
    "lora_one_factors",
]


# --- per-matrix cores -----------------------------------------------------------------------------


@functools.partial(
    jax.jit, static_argnames=("rank", "num_train", "alpha", "beta", "gamma", "damping")
)
def lora_da_factors(
    grad: jax.Array,
    z: jax.Array,
    f: jax.Array,
    *,
    rank: int,
    num_train: int,
    alpha: float = 1.0,
    beta: float = 0.03,
    gamma: float = 1024.0,
    damping: float = 1e-6,
) -> tuple[jax.Array, jax.Array]:
    """LoRA-DA's ``(A₀, B₀)`` for one ``(n, m)`` kernel from its gradient and K-FAC factors.

    1. Natural-gradient direction ``Δ = −(Z + δI)⁻¹ G diag(1/(F + δ))`` (Cholesky solve), normalised
       by ``s = σ_max(Δ)``.
    2. Guidance ``Ω = −α ΔΔᵀ + β c (Z + δI)⁻¹`` with ``c = Σ_j 1/(F_j + δ) / N / s²``: the bias
       (natural-gradient energy) against the variance of the sampling noise.
    3. ``a₀`` = the ``r`` eigenvectors of ``Ω`` with the smallest eigenvalues (``eigh``),
       ``A₀ = a₀/√γ`` and ``B₀ = a₀ᵀΔ/√γ``, so ``A₀B₀ = a₀a₀ᵀΔ/γ``.

    Args:
      grad: ``(n, m)`` mean gradient ``G``.
      z: ``(n, n)`` input factor ``Z``.
      f: ``(m,)`` diagonal output Fisher ``F``.
      rank: ``r``.
      num_train: ``N``, the size of the whole training set.
      alpha, beta: weights of the bias and variance terms (``β = 0`` keeps the bias only).
      gamma: the ``γ`` that scales the initial update down.
      damping: ``δ`` added to ``Z`` and ``F``.

    Returns:
      ``(A₀, B₀)`` of shapes ``(n, r)`` and ``(r, m)``, float32.

    References:
      P6 LoRA-DA (arXiv 2510.24561), the authors' ``lora_da.py`` as summarised in specs §6.
    """
    g = jnp.asarray(grad, jnp.float32)
    n, m = g.shape
    zd = jnp.asarray(z, jnp.float32) + damping * jnp.eye(n)
    inv_f = 1.0 / (jnp.asarray(f, jnp.float32) + damping)
    chol = jax.scipy.linalg.cho_factor(zd, lower=True)
    delta = -jax.scipy.linalg.cho_solve(chol, g) * inv_f[None, :]
    s = jnp.linalg.norm(delta, ord=2)
    s = jnp.where(s > 0, s, 1.0)
    delta = delta / s
    c = jnp.sum(inv_f) / num_train / s**2
    z_inv = jax.scipy.linalg.cho_solve(chol, jnp.eye(n))
    omega = -alpha * (delta @ delta.T) + beta * c * z_inv
    omega = 0.5 * (omega + omega.T)
    _, vecs = jnp.linalg.eigh(omega)  # ascending eigenvalues
    a0 = vecs[:, :rank]
    root = math.sqrt(gamma)
    return a0 / root, (a0.T @ delta) / root


@functools.partial(jax.jit, static_argnames=("rank", "gamma"))
def lora_one_factors(
    grad: jax.Array, *, rank: int, gamma: float = 1024.0
) -> tuple[jax.Array, jax.Array]:
    """LoRA-One: ``−G = U S Vᵀ``, ``A₀ = U_r √S_r / √(S₁γ)``, ``B₀ = √S_r V_rᵀ / √(S₁γ)``.

    So ``A₀B₀ = −[G]_r / (σ₁(G) γ)``: one preconditioned gradient step in the top-``r`` subspace.
    """
    u, sv, vt = svd.truncated_svd(-jnp.asarray(grad, jnp.float32), rank=rank)
    root = jnp.sqrt(sv / jnp.where(sv[0] > 0, sv[0], 1.0) / gamma)
    return u * root, root[:, None] * vt


@functools.partial(jax.jit, static_argnames=("rank", "gamma"))
def lora_ga_factors(
    grad: jax.Array, *, rank: int, gamma: float = 1024.0
) -> tuple[jax.Array, jax.Array]:
    """LoRA-GA: ``G = L Σ Rᵀ``, ``A₀ = L_{:, :r} m^{1/4}/√γ``, ``B₀ = R_{:, r:2r}ᵀ m^{1/4}/√γ``.

    ``m`` is the output width (PyTorch's ``out_features``). Needs ``2r ≤ min(n, m)``.
    """
    g = jnp.asarray(grad, jnp.float32)
    n, m = g.shape
    if 2 * rank > min(n, m):
        raise ValueError(
            f"LoRA-GA needs 2·rank <= min(n, m) = {min(n, m)} for a ({n}, {m}) kernel; got rank "
            f"{rank}. Use a smaller rank for this layer."
        )
    u, _, vt = svd.truncated_svd(g, rank=2 * rank)
    c = m**0.25 / math.sqrt(gamma)
    return u[:, :rank] * c, vt[rank : 2 * rank] * c


@functools.partial(jax.jit, static_argnames=("rank", "out_dim"))
def eva_factors(z: jax.Array, *, rank: int, out_dim: int) -> tuple[jax.Array, jax.Array]:
    """EVA: ``A₀`` = the top-``r`` eigenvectors of ``Z = E[aaᵀ]`` (activation SVD), ``B₀ = 0``."""
    _, vecs = jnp.linalg.eigh(jnp.asarray(z, jnp.float32))
    return vecs[:, ::-1][:, :rank], jnp.zeros((rank, out_dim), jnp.float32)


# --- pytree-level initialisers --------------------------------------------------------------------


def _per_matrix(
    fn: Callable[..., tuple[jax.Array, jax.Array]], *arrays: jax.Array, stack_ndim: int
):
    """Applies a per-matrix core over the stacked-layer axes of its inputs."""
    if stack_ndim == 0:
        return fn(*arrays)
    stack = arrays[0].shape[:stack_ndim]
    flat = [jnp.reshape(a, (-1, *a.shape[stack_ndim:])) for a in arrays]
    a, b = jax.vmap(fn)(*flat)
    return jnp.reshape(a, (*stack, *a.shape[1:])), jnp.reshape(b, (*stack, *b.shape[1:]))


def _assemble(
    params: Any,
    rules: paths.Rules,
    make: Callable[[str, LoRA, tuple[int, ...], int, int], tuple[jax.Array, jax.Array]],
    rank_of: Callable[[str, LoRA], int] | None = None,
) -> AdapterSet:
    out = {}
    for path, (kernel, spec) in paths.match_rules(params, check_lora_rules(rules)).items():
        shape = tuple(jnp.shape(kernel))
        in_ndim, out_ndim = resolve_layout(spec, shape, path)
        stack, n, m = split_shape(shape, in_ndim, out_ndim)
        kind = spec if rank_of is None else dataclasses.replace(spec, rank=rank_of(path, spec))
        a, b = make(path, kind, stack, n, m)
        dtype = jnp.dtype(kind.dtype or kernel.dtype)
        out[path] = Adapter(
            factors={"a": a.astype(dtype), "b": b.astype(dtype)},
            kind=kind,
            in_ndim=in_ndim,
            out_ndim=out_ndim,
            matrix=(n, m),
        )
    return out


def lora_da(
    key: jax.Array,
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_train: int | None = None,
    num_grad_examples: int = 256,
    num_fisher_examples: int = 256,
    alpha: float = 1.0,
    beta: float = 0.03,
    gamma: float = 1024.0,
    damping: float = 1e-6,
    chunk_size: int = 16,
) -> AdapterSet:
    """LoRA-DA initialisation: ``s·A₀B₀ = (s/γ) a₀a₀ᵀΔ`` per kernel, ``W₀`` unchanged.

    ``G`` comes from the first ``S_g`` examples, ``Z`` and ``F`` from the first ``S_f`` (both capped
    at the batch size); see ``initializers.lora_da_factors`` for the maths. As in the authors' code the base
    weights are *not* modified, so the initial model is ``W₀ + s A₀B₀``, a small step along the
    natural gradient restricted to the chosen subspace; do not unfold.

    Args:
      key: unused (the initialisation is deterministic); kept for the ``init`` interface.
      params: the model's parameters.
      rules: ``(regex, lora(...))`` rules; each spec's rank and scale are used.
      batch: training examples (pytree, leading example axis).
      apply_fn: ``apply_fn(params, *args, **kw)``.
      loss_fn: ``loss_fn(forward, batch) -> mean loss``.
      num_train: ``N``, the whole training set's size (default: the batch's).
      num_grad_examples, num_fisher_examples: ``S_g`` and ``S_f`` (default 256 each).
      alpha, beta, gamma, damping: as in ``initializers.lora_da_factors`` (defaults of the paper's code).
      chunk_size: examples per ``vmap`` chunk.

    Returns:
      ``{path: Adapter}`` of LoRA adapters.

    Raises:
      TypeError: a rule's spec is not a LoRA spec.

    Example:
      >>> ad = lora_da(key, variables, [(r".*dense_\\d/kernel", lora(8, alpha=16, rslora=True))],
      ...              {"x": x, "y": y}, apply_fn=model.apply,
      ...              loss_fn=lambda fwd, b: xent(fwd(b["x"]), b["y"]))
    """
    del key
    total = batch_size(batch)
    n_train = total if num_train is None else int(num_train)
    sg, sf = min(num_grad_examples, total), min(num_fisher_examples, total)
    kw = dict(apply_fn=apply_fn, loss_fn=loss_fn, chunk_size=chunk_size)
    stats_f = kfac_statistics(params, rules, batch, num_examples=sf, **kw)
    stats_g = stats_f if sg == sf else kfac_statistics(params, rules, batch, num_examples=sg, **kw)

    def make(path, kind, stack, n, m):
        core = lambda g, z, f: lora_da_factors(
            g, z, f, rank=kind.rank, num_train=n_train, alpha=alpha, beta=beta,
            gamma=gamma, damping=damping,
        )  # fmt: skip
        return _per_matrix(
            core, stats_g[path].grad, stats_f[path].z, stats_f[path].f, stack_ndim=len(stack)
        )

    return _assemble(params, rules, make)


def _gradient_init(
    factors_fn: Callable[..., tuple[jax.Array, jax.Array]],
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_grad_examples: int,
    gamma: float,
    chunk_size: int,
) -> AdapterSet:
    """Adapters from the mean gradient alone: ``factors_fn(G, rank=r, gamma=γ)`` per kernel."""
    stats = kfac_statistics(
        params, rules, batch, apply_fn=apply_fn, loss_fn=loss_fn,
        num_examples=min(num_grad_examples, batch_size(batch)), chunk_size=chunk_size,
    )  # fmt: skip

    def make(path, kind, stack, n, m):
        core = lambda g: factors_fn(g, rank=kind.rank, gamma=gamma)
        return _per_matrix(core, stats[path].grad, stack_ndim=len(stack))

    return _assemble(params, rules, make)


def lora_one(
    key: jax.Array,
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_grad_examples: int = 256,
    gamma: float = 1024.0,
    chunk_size: int = 16,
) -> AdapterSet:
    """LoRA-One initialisation: ``s·A₀B₀ = −(s/γ)[G]_r/σ₁(G)``, ``W₀`` unchanged (do not unfold).

    See ``initializers.lora_one_factors``; ``G`` is the mean gradient over the first ``S_g`` examples.
    """
    del key
    return _gradient_init(
        lora_one_factors, params, rules, batch, apply_fn=apply_fn, loss_fn=loss_fn,
        num_grad_examples=num_grad_examples, gamma=gamma, chunk_size=chunk_size,
    )  # fmt: skip


def lora_ga(
    key: jax.Array,
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_grad_examples: int = 256,
    gamma: float = 1024.0,
    chunk_size: int = 16,
) -> AdapterSet:
    """LoRA-GA initialisation: ``s·A₀B₀ = s·(√m/γ) L_{:r} R_{r:2r}ᵀ``; then ``unfold``.

    LoRA-GA subtracts the initial update from the base weight (``W₀ ← W₀ − s A₀B₀``) so training
    starts at the base model: follow with ``params = adapters.unfold(params, ad)``. See
    ``initializers.lora_ga_factors``.
    """
    del key
    return _gradient_init(
        lora_ga_factors, params, rules, batch, apply_fn=apply_fn, loss_fn=loss_fn,
        num_grad_examples=num_grad_examples, gamma=gamma, chunk_size=chunk_size,
    )  # fmt: skip


def eva(
    key: jax.Array,
    params: Any,
    rules: paths.Rules,
    batch: Any,
    *,
    apply_fn: Callable[..., Any],
    loss_fn: LossFn,
    num_examples: int = 256,
    rho: float = 2.0,
    chunk_size: int = 16,
) -> AdapterSet:
    """EVA initialisation: ``A₀`` = top activation directions, ``B₀ = 0``, ranks redistributed.

    For each kernel the eigen-decomposition of ``Z = E[aaᵀ]`` (the activation SVD) gives the
    components and their explained-variance ratios ``λ_i / Σ_j λ_j``. With ``rho > 1`` the total
    budget ``Σ_l r_l`` of the rules is redistributed: the components with the largest ratios over
    all kernels are kept, at most ``⌊rho·r_l⌋`` and at least one per kernel (``rho = 1`` keeps each
    rule's rank). The update starts at zero.

    Args:
      key, params, rules, batch, apply_fn, loss_fn: as for :func:`lora_da` (the loss only drives
        the forward pass; ``Z`` does not depend on it).
      num_examples: examples used.
      rho: the redistribution factor (EVA's default 2).
      chunk_size: examples per ``vmap`` chunk.
    """
    del key
    if rho < 1:
        raise ValueError(f"eva(rho=...) must be >= 1, got {rho}.")
    stats = kfac_statistics(
        params, rules, batch, apply_fn=apply_fn, loss_fn=loss_fn,
        num_examples=min(num_examples, batch_size(batch)), chunk_size=chunk_size,
    )  # fmt: skip
    targets = paths.match_rules(params, check_lora_rules(rules))
    ranks = {p: spec.rank for p, (_, spec) in targets.items()}
    if rho > 1:
        budget = sum(ranks.values())
        cands = []
        for p, st in stats.items():
            lam = jnp.linalg.eigvalsh(jnp.reshape(st.z, (-1, *st.z.shape[-2:])))[..., ::-1]
            ratio = jnp.mean(lam / jnp.maximum(jnp.sum(lam, -1, keepdims=True), 1e-30), axis=0)
            cap = min(int(rho * ranks[p]), ratio.shape[0])
            cands += [(float(ratio[i]), p, i) for i in range(cap)]
        cands.sort(key=lambda c: -c[0])
        new = dict.fromkeys(ranks, 1)  # the first component of each kernel is always kept
        spent = len(new)
        for _, p, i in cands:
            if spent >= budget:
                break
            if i > 0:
                new[p] += 1
                spent += 1
        ranks = new

    def make(path, kind, stack, n, m):
        core = lambda z: eva_factors(z, rank=kind.rank, out_dim=m)
        return _per_matrix(core, stats[path].z, stack_ndim=len(stack))

    return _assemble(params, rules, make, rank_of=lambda p, spec: ranks[p])
