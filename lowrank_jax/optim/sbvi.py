r"""SBVI: a Bures–Wasserstein flow of Gaussian singular values, with Empirical-Bayes friction.

**Reconstruction** of P8 (Spectral Bridge Variational Inference) from its abstract, following the
concrete version in ``papers/specs.md`` §8; the authors' exact SDE, friction and schedules are not
public. Each spectral adapter ``ΔW = U diag(σ) Vᵀ`` (:func:`lowrank_jax.adapters.singular`) with
``U ∈ St(n, r)``, ``V ∈ St(m, r)`` is trained as follows (``η`` the learning rate, ``k`` the step).

**Singular values: a variational family evolved by its Wasserstein gradient flow**
(``family="gaussian"``, the default). Each mode carries ``q(σ_i) = N(μ_i, Σ_i)`` (``Σ_i = s_i²``),
kept in the optimiser state. The variational free energy is

.. math::
   F(q) = E_q\big[L(σ) + ½ λ γ_i σ_i²\big] − T_k\, H(q),\qquad H(N(μ, Σ)) = ½ \log(2πeΣ).

On 1-D Gaussians the Wasserstein-2 distance is ``W₂² = (μ−μ')² + (s−s')²`` (Bures–Wasserstein), so
the Wasserstein gradient flow of ``F`` restricted to the family is the Euclidean flow in ``(μ, s)``:

.. math::
   \dot μ_i = −E_q[∂_i L] − λγ_i μ_i,\qquad
   \dot s_i = −s_i\,(E_q[∂_i² L] + λγ_i) + T/s_i
   \;\Longleftrightarrow\; \dot Σ_i = 2T − 2Σ_i E_q[∂_i² L] − 2λγ_i Σ_i

(the covariance ODE ``Σ̇ = 2T − ΣA − AΣ`` of the Bures–Wasserstein flow, ``A = E_q ∇²(L + ½λγσ²)``;
the ``T/s`` term is the entropy's). Its fixed point on a quadratic ``L = ½a(σ − σ*)²`` is the
Gibbs posterior ``∝ exp(−(L + ½λγσ²)/T)``: ``μ = aσ*/(a + λγ)``, ``Σ = T/(a + λγ)``.
Expectations use the reparameterised sample ``σ̃ = μ + s ξ``, ``ξ ~ N(0, 1)``, that the transform
writes into the parameters, so the gradient the caller computes next is ``g = ∂L(σ̃)`` — an unbiased
one-sample estimate of ``E_q[∂L]`` — and, by Stein's lemma ``E_q[∂L(σ̃) ξ] = s E_q[∂²L]``, no Hessian
is needed: ``Σ E_q[∂²L] ≈ s (g − b) ξ`` with a control variate ``b`` (an EMA of past ``g``,
independent of ``ξ``). Discretised (``p_i`` the preconditioner below)::

    μ ← max(0, μ − η p (g + λγμ))
    Σ ← max(0, Σ + η p (2T − 2 s (g − b) ξ − 2λγΣ))        (the Σ form: no 1/s blow-up at s → 0)
    σ̃ ← μ + √Σ ξ',  ξ' ~ N(0, 1)                           (the next sample, in the parameters)

(``μ ≥ 0``; a sample may be negative, which flips the sign of its mode.) With ``precond_max``
large, ``η p (E∂²L + λγ)`` can exceed ½ and the explicit Σ-step is clipped at 0: the flow then
keeps a cruder width; its fixed point is unchanged. At ``T = 0`` and ``Σ₀ = 0`` the variance
stays exactly 0 and the flow is (preconditioned) gradient descent on ``μ`` — a MAP point
estimate; ``T > 0`` gives every mode a posterior width ``√Σ`` and samples from it. The posterior mean is read with :func:`sbvi_mean` (the parameters hold a sample).

**The particle limit** (``family="langevin"``): one particle per mode follows the Langevin SDE
``dσ = −p(∂L + λγσ) dt + √(2pT) dW``, whose Fokker–Planck equation is the same Wasserstein gradient
flow of ``F`` over *all* densities (Jordan, Kinderlehrer & Otto 1998); discretised
(Euler–Maruyama) ``σ ← max(0, σ − ηp(g + λγσ) + √(2ηpT) ξ)``, one-step noise variance ``2ηpT``.

**A bounded preconditioner.** ``p_i = min(p_max, 1/(√v̂_i + ε))`` with ``v̂`` the bias-corrected EMA
of ``g²`` (RMSProp / pSGLD). Because ``0 < p_i ≤ p_max`` (``precond_max``): the Langevin noise per
step has standard deviation at most ``√(2η p_max T)`` — a mode whose gradient vanishes no longer gets
``√(2ηT/ε)`` — and the Gaussian flow's Σ-step at most ``2η p_max T``. A positive diagonal ``p`` is a
change of metric: it leaves the fixed points (the posterior above) unchanged.

**Empirical-Bayes friction** (ARD prior ``σ_i ~ N(0, 1/γ_i)``): an EMA of ``E_q[σ_i²] = μ_i² + Σ_i``
is kept and every ``eb_every`` steps ``γ_i ← 1/(EMA + τ)``. A mode survives iff its task force beats
the friction, ``|E ∂_i L| ≳ λγ_iμ_i``; with ``L ≈ ½c(σ − σ*)²`` the fixed point exists iff
``σ*² ≥ 4λ/c`` (``τ, T → 0``): weak (noise) modes collapse, strong ones are amplified — the
*spectral bifurcation*. **Friction warm-up** (a choice of this reconstruction): ``λ`` ramps up
linearly over ``friction_warmup`` steps. **Temperature annealing** ``T_k = T₀ max(0, 1 − k/K)``
(``anneal_steps=None``: constant ``T₀``). **Pruning**: from ``prune_start`` on, every ``eb_every``
steps a mode with ``μ_i < κ max_j μ_j`` (or, if ``prune_snr > 0``, ``μ_i < prune_snr · s_i``: the
posterior puts visible mass at 0) is masked for good (``μ = Σ = 0``, no noise).

**Factors**: the Riemannian gradient ``ξ = G − U sym(UᵀG)`` (and likewise for ``V``) is
Adam-preconditioned, projected to the tangent space again, and applied by the QR retraction
``U ← qf(U − η ξ̃)`` (``qf`` with ``diag(R) > 0``): ``O((n + m) r²)`` per step. ``U, V`` are point
estimates trained on ``E_q[L]`` (their gradients are taken at the sampled ``σ̃``).

The transform returns the full update (``new − old``), so ``optax.apply_updates`` lands exactly on
the retracted point (and the new sample); it owns its learning rate. It acts on the *spectral
triples* of the tree (mappings with keys exactly ``{"u", "s", "v"}``); other parameters go through
``optax.multi_transform``. State: Adam moments of ``U``, ``V`` (``O((n + m) r)``) plus ``O(r)`` per
adapter — less than AdaLoRA's (Adam moments plus two sensitivity EMAs of every factor entry).

References:
  P8 SBVI, "Spectral Bridge Variational Inference: Dynamic LoRA via Bures-Wasserstein Gradient
  Flows" (ICML 2026, abstract only): reconstruction per specs §8. Jordan, Kinderlehrer & Otto 1998
  (the Fokker–Planck equation as a Wasserstein gradient flow); Lambert et al. 2022, "Variational
  inference via Wasserstein gradient flows" (the Bures–Wasserstein flow of Gaussians); Li et al.
  2016 (pSGLD); Tipping 2001 (ARD / Empirical Bayes); Absil et al. 2008 (QR retraction).
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
    "bures_wasserstein_step",
    "is_spectral_triple",
    "qr_retraction",
    "sbvi_mean",
    "sbvi_posterior",
    "sbvi_preconditioner",
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

    ``moments`` holds, per spectral triple, ``{"mu_u", "nu_u", "mu_v", "nu_v", "mu_s", "nu_s"}``
    (Adam moments of the factors; EMA and mean square of ``∂L/∂σ``). Per triple and ``(r,)`` each:
    ``ema`` (EMA of ``E_q[σ²]``), ``gamma`` (friction ``γ``), ``mask`` (active modes), ``loc`` (``μ``,
    the posterior mean; the particle for ``family="langevin"``), ``var`` (``Σ = s²``; 0 for
    Langevin) and ``noise`` (the ``ξ`` of the sample now in the parameters).
    """

    count: jax.Array
    key: jax.Array
    moments: Any
    ema: Any
    gamma: Any
    mask: Any
    loc: Any = None
    var: Any = None
    noise: Any = None


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


def sbvi_preconditioner(
    nu: jax.Array, count: jax.Array, *, b2: float = 0.999, eps: float = 1e-8, precond_max: float
) -> jax.Array:
    """``p = min(p_max, 1/(√(ν/(1 − b2ᵏ)) + ε))``: bounded RMSProp scaling, ``0 < p ≤ p_max``.

    ``nu`` is the EMA of ``g²`` after ``count`` updates. The bound caps the Langevin noise per step
    at ``√(2η p_max T)`` however small the gradient.
    """
    bc2 = 1 - b2 ** jnp.asarray(count, jnp.float32)
    return jnp.minimum(precond_max, 1.0 / (jnp.sqrt(nu / bc2) + eps))


def bures_wasserstein_step(
    loc: jax.Array,
    var: jax.Array,
    grad: jax.Array,
    noise: jax.Array,
    *,
    step: jax.Array,
    temperature: jax.Array,
    friction: jax.Array,
    baseline: jax.Array | float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    r"""One explicit step of the 1-D Bures–Wasserstein flow of ``F(q) = E_q[L + ½fσ²] − T H(q)``.

    ``q = N(loc, var)`` per entry; ``grad = ∂L(loc + √var · noise)`` is the gradient at the
    reparameterised sample. With ``step = η p`` (``p`` the preconditioner) and ``f = friction``::

        loc ← max(0, loc − step (grad + f loc))
        var ← max(0, var + step (2T − 2 √var (grad − baseline) noise − 2 f var))

    ``√var · (grad − baseline) · noise`` is Stein's unbiased estimate of ``var · E_q[∂²L]`` (for any
    ``baseline`` independent of ``noise``). All arguments broadcast elementwise; returns
    ``(loc, var)``. Fixed point on ``L = ½a(σ − σ*)²``: ``(aσ*/(a + f), T/(a + f))``.
    """
    hess_var = jnp.sqrt(var) * (grad - baseline) * noise
    loc = jnp.maximum(loc - step * (grad + friction * loc), 0.0)
    var = jnp.maximum(var + step * (2 * temperature - 2 * hess_var - 2 * friction * var), 0.0)
    return loc, var


def scale_by_sbvi(
    *,
    learning_rate: float,
    factor_learning_rate: float | None = None,
    family: str = "gaussian",
    friction: float = 1e-3,
    friction_warmup: int = 0,
    temperature: float = 1e-6,
    anneal_steps: int | None = 1000,
    eb_every: int = 10,
    eb_decay: float = 0.9,
    tau: float = 1e-4,
    gamma_init: float = 1.0,
    prune_ratio: float = 0.1,
    prune_start: int = 100,
    prune_snr: float = 0.0,
    precond_max: float = 1e3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    seed: int = 0,
) -> optax.GradientTransformation:
    """The SBVI optimiser for spectral adapters (see the module docstring for the maths).

    Args:
      learning_rate: ``η`` of the singular-value flow.
      factor_learning_rate: step of the retracted Riemannian Adam on ``U``, ``V`` (default ``η``).
      family: ``"gaussian"`` (``q(σ_i) = N(μ_i, Σ_i)`` evolved by the Bures–Wasserstein flow; the
        parameters hold a reparameterised sample) or ``"langevin"`` (one particle per mode, the
        Euler–Maruyama Langevin SDE — the particle form of the same flow).
      friction: ``λ``, the weight of the ARD prior against the task loss.
      friction_warmup: steps over which ``λ`` ramps up linearly from 0 (0: no ramp).
      temperature: ``T₀``; ``T = 0`` makes both families a deterministic MAP flow.
      anneal_steps: steps over which ``T`` decays linearly to 0; ``None``: constant ``T₀``.
      eb_every: ``K``, steps between Empirical-Bayes friction updates (and pruning checks).
      eb_decay: decay of the EMA of ``E_q[σ²]``.
      tau: ``τ`` in ``γ = 1/(EMA[E_q σ²] + τ)`` (caps the friction at ``1/τ``).
      gamma_init: ``γ`` before the first Empirical-Bayes update.
      prune_ratio: ``κ``; a mode with ``μ_i < κ max_j μ_j`` is pruned for good.
      prune_start: first step at which pruning is checked.
      prune_snr: also prune a mode with ``μ_i < prune_snr · s_i`` (0: off; Gaussian family only).
      precond_max: ``p_max``, the bound of the preconditioner ``p = min(p_max, 1/(RMS(g) + ε))``.
      b1, b2, eps: Adam constants (``b2``/``eps`` also for the ``σ`` preconditioner; ``b1`` also
        for the control variate of the Stein estimate).
      seed: seed of the sampling noise (the key lives in the state).

    Returns:
      An ``optax.GradientTransformation`` whose ``update(grads, state, params)`` needs ``params``.

    Raises:
      ValueError: a hyper-parameter is out of range, ``params`` is missing, or the tree has leaves
        outside spectral triples.

    Example:
      >>> ad = adapters.init(key, variables, [(r".*kernel", adapters.spectral(16))])
      >>> tx = scale_by_sbvi(learning_rate=1e-2, temperature=1e-5)
      >>> state = tx.init(ad)
      >>> updates, state = tx.update(grads, state, ad)   # then optax.apply_updates(ad, updates)
      >>> sbvi_ranks(state), sbvi_mean(ad, state)         # {path: rank}; ad with σ = μ
    """
    checks = {
        "learning_rate": learning_rate > 0,
        "family": family in ("gaussian", "langevin"),
        "friction": friction >= 0,
        "friction_warmup": friction_warmup >= 0,
        "temperature": temperature >= 0,
        "anneal_steps": anneal_steps is None or anneal_steps >= 1,
        "eb_every": eb_every >= 1,
        "eb_decay": 0 <= eb_decay < 1,
        "tau": tau > 0,
        "gamma_init": gamma_init > 0,
        "prune_ratio": 0 <= prune_ratio < 1,
        "prune_start": prune_start >= 0,
        "prune_snr": prune_snr >= 0,
        "precond_max": precond_max > 0,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"scale_by_sbvi: out-of-range hyper-parameters {bad}; see the docstring.")
    lr_uv = learning_rate if factor_learning_rate is None else factor_learning_rate
    gaussian = family == "gaussian"

    def init_fn(params):
        _check(params)
        per = lambda f: jax.tree.map(f, params, is_leaf=is_spectral_triple)
        moments = per(
            lambda t: {
                "mu_u": jnp.zeros_like(t["u"]),
                "nu_u": jnp.zeros_like(t["u"]),
                "mu_v": jnp.zeros_like(t["v"]),
                "nu_v": jnp.zeros_like(t["v"]),
                "mu_s": jnp.zeros_like(t["s"]),
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
            loc=per(lambda t: jnp.maximum(t["s"], 0.0)),
            var=per(lambda t: jnp.zeros_like(t["s"])),
            noise=per(lambda t: jnp.zeros_like(t["s"])),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_sbvi needs params: tx.update(grads, state, params).")
        _check(updates)
        count = state.count + 1
        key, sub = jax.random.split(state.key)
        t = count.astype(jnp.float32)
        if anneal_steps is None:
            temp = jnp.asarray(temperature, jnp.float32)
        else:
            temp = temperature * jnp.maximum(0.0, 1.0 - (t - 1.0) / anneal_steps)
        lam = friction * jnp.minimum(1.0, t / max(friction_warmup, 1))
        eb_step = (count % eb_every) == 0
        prune_step = eb_step & (count >= prune_start)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        n_triples = len(_triples(params))
        keys = list(jax.random.split(sub, max(n_triples, 1)))

        def one(g, p, mom, ema, gamma, mask, loc, var, noise, key):
            u, s, v = p["u"], p["s"], p["v"]
            gs = jnp.where(mask, g["s"], 0.0)
            nu_s = b2 * mom["nu_s"] + (1 - b2) * gs**2
            mu_s = b1 * mom["mu_s"] + (1 - b1) * gs
            step = learning_rate * sbvi_preconditioner(
                nu_s, count, b2=b2, eps=eps, precond_max=precond_max
            )
            fric = lam * gamma
            xi = jax.random.normal(key, s.shape, s.dtype)
            if gaussian:  # Bures–Wasserstein flow of N(μ, Σ); then the next sample μ + √Σ ξ'
                # The control variate is the EMA of *past* gradients: independent of this ξ.
                baseline = mom["mu_s"] / jnp.maximum(1 - b1 ** (t - 1), 1e-12)
                loc_new, var_new = bures_wasserstein_step(
                    loc, var, gs, noise, step=step, temperature=temp, friction=fric,
                    baseline=jnp.where(t > 1, baseline, 0.0),
                )  # fmt: skip
            else:  # the particle: Euler–Maruyama Langevin, noise variance 2 η p T
                drift = gs + fric * s
                loc_new = jnp.maximum(s - step * drift + jnp.sqrt(2 * step * temp) * xi, 0.0)
                var_new = jnp.zeros_like(var)
            ema_new = eb_decay * ema + (1 - eb_decay) * (loc_new**2 + var_new)
            gamma_new = jnp.where(eb_step, 1.0 / (ema_new + tau), gamma)
            peak = jnp.max(jnp.where(mask, loc_new, 0.0))
            keep = loc_new >= prune_ratio * peak
            if prune_snr > 0:
                keep = keep & (loc_new >= prune_snr * jnp.sqrt(var_new))
            mask_new = jnp.where(prune_step, mask & keep, mask)
            loc_new = jnp.where(mask_new, loc_new, 0.0)
            var_new = jnp.where(mask_new, var_new, 0.0)
            noise_new = jnp.where(mask_new, xi, 0.0) if gaussian else jnp.zeros_like(xi)
            s_new = loc_new + jnp.sqrt(var_new) * noise_new

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
            mom = {
                "mu_u": mu_u, "nu_u": nu_u, "mu_v": mu_v, "nu_v": nu_v, "mu_s": mu_s,
                "nu_s": nu_s,
            }  # fmt: skip
            return upd, mom, ema_new, gamma_new, mask_new, loc_new, var_new, noise_new

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
                flat(state.loc),
                flat(state.var),
                flat(state.noise),
                keys[: len(leaves_g)],
                strict=True,
            )
        ]
        unflat = lambda i: treedef.unflatten([r[i] for r in results])
        new_state = SBVIState(count, key, *(unflat(i) for i in range(1, 8)))
        return unflat(0), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _by_path(tree: Any) -> dict[str, Any]:
    out = {}
    for keypath, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = paths.path_to_str(keypath)
        out[name[: -len("/factors")] if name.endswith("/factors") else name] = x
    return out


def sbvi_ranks(state: SBVIState) -> dict[str, int]:
    """The discovered rank of every spectral adapter: ``{path: number of unpruned modes}``.

    Paths are the adapter set's (``params/.../kernel``); stacked layers report the total over
    their layers (use ``state.mask`` for the per-layer masks).
    """
    return {name: int(jnp.sum(m)) for name, m in _by_path(state.mask).items()}


def sbvi_posterior(state: SBVIState) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{path: (μ, s)}``: each adapter's posterior mean and standard deviation per mode.

    For ``family="langevin"`` ``μ`` is the particle and ``s = 0``; pruned modes have ``μ = s = 0``.
    """
    loc, var = _by_path(state.loc), _by_path(state.var)
    return {name: (loc[name], jnp.sqrt(var[name])) for name in loc}


def sbvi_mean(params: Any, state: SBVIState) -> Any:
    """``params`` with every spectral triple's ``σ`` replaced by the posterior mean ``μ``.

    The parameters that :func:`scale_by_sbvi` leaves hold a sample ``μ + s ξ`` (the point at which
    the next gradient is taken); evaluate and export the mean.
    """
    _check(params)
    return jax.tree.map(
        lambda p, loc: {**p, "s": loc.astype(p["s"].dtype)},
        params,
        state.loc,
        is_leaf=is_spectral_triple,
    )
