r"""P19 TPV: test-time prediction variance, predicted from training data.

For a trained model ``f_{w*}`` and a weight perturbation ``δu ~ (0, C)``,

    TPV(w*; X) := E_{x∈X, δu} ‖f_{w*+δu}(x) − f_{w*}(x)‖² ≈ Tr(H_eff C),
    H_eff = E_x[J(x)ᵀ J(x)],  J(x) = ∂f(x)/∂w  (K × P).

P19's claim (Theorem 3.1): ``|TPV(w*; X_train) − TPV(w*; X_test)| ≤ c₁ Tr(C)`` in the
over-parameterised limit, so the training set predicts the test-time sensitivity.

Estimators (``papers/specs.md`` §19 (2), from the authors' code):

* :func:`trace_heff`: ``Tr H_eff = E_x ‖J(x)‖_F²`` exactly, from per-example Jacobians
  (``vmap(jacrev)``, chunked with ``lax.map``);
* :func:`hutchinson_trace_heff`: the doubly stochastic estimator: draw ``x`` and a Rademacher
  ``v ∈ {±1}^K``, ``g = ∇_w ⟨v, f(x)⟩``, average ``‖g‖²``; each (x, v) pair gets its own
  gradient (``vmap`` over pairs — summing ``⟨v, f⟩`` over a batch first would add cross terms);
* quantisation: ``δ = (w_max − w_min)/(2^b − 1)`` over the global weight range,
  ``σ_q² = δ²/12``, ``TPV = σ_q² Tr H_eff`` (:func:`tpv_quantization`), and its Monte-Carlo
  version with i.i.d. ``U(−δ/2, δ/2)`` noise (:func:`tpv_quantization_mc`);
* label noise (:func:`tpv_label_noise`): ``R`` refits from ``w*`` to noisy logit targets
  ``f*(x) + N(0, σ²)`` (MSE plus a proximity penalty ``λ‖w − w*‖²``, gradient descent),
  ``TPV = mean_{r, x} ‖z_r(x) − z*(x)‖²``.

Models are given as ``apply_fn(params, x) -> (K,)`` on *one* example (batching is ``vmap``).

References:
  D. Arpit, "TPV: test prediction variance ...", arXiv 2512.11089, and github.com/devansharpit/TPV
  (``tpv/*``); the label-noise refit's optimiser and step counts are our choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "hutchinson_trace_heff",
    "per_example_jacobians",
    "quantization_variance",
    "tpv_label_noise",
    "tpv_quantization",
    "tpv_quantization_mc",
    "trace_heff",
]

ApplyFn = Callable[[Any, jax.Array], jax.Array]


def _check_x(x: jax.Array, chunk: int) -> None:
    if jnp.ndim(x) < 1 or x.shape[0] < 1:
        raise ValueError(
            f"x must have a leading example axis with at least one example; got {x.shape}"
        )
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be a positive number of examples")


def per_example_jacobians(apply_fn: ApplyFn, params: Any, x: jax.Array, *, chunk: int = 64) -> Any:
    """Per-example Jacobians ``∂f(x_i)/∂w``: a pytree like ``params`` with leaves ``(b, K, *leaf)``.

    ``vmap(jacrev)`` over chunks of ``chunk`` examples (``lax.map``), so memory is
    ``chunk · K · P`` floats at a time.
    """
    _check_x(x, chunk)
    jac = jax.jacrev(apply_fn)
    return jax.lax.map(lambda xi: jac(params, xi), x, batch_size=min(chunk, x.shape[0]))


def trace_heff(apply_fn: ApplyFn, params: Any, x: jax.Array, *, chunk: int = 64) -> jax.Array:
    """``Tr H_eff = E_x ‖J(x)‖_F²`` exactly (per-example Jacobians, chunked).

    Args:
      apply_fn: ``(params, x_i) -> (K,)``; params: the trained weights ``w*``.
      x: ``(b, ...)`` inputs; chunk: examples per ``vmap(jacrev)`` call.

    Returns:
      The scalar trace.

    Raises:
      ValueError: for an empty ``x`` or a non-positive ``chunk``.
    """
    _check_x(x, chunk)
    jac = jax.jacrev(apply_fn)

    def sq(xi):
        return sum(jnp.sum(j**2) for j in jax.tree.leaves(jac(params, xi)))

    return jnp.mean(jax.lax.map(sq, x, batch_size=min(chunk, x.shape[0])))


def hutchinson_trace_heff(
    apply_fn: ApplyFn, params: Any, x: jax.Array, *, key: jax.Array, num_samples: int = 256
) -> jax.Array:
    """Doubly stochastic Hutchinson estimate of ``Tr H_eff``: mean of ``‖∇_w⟨v, f(x)⟩‖²``.

    Each of ``num_samples`` pairs draws an example ``x`` uniformly from ``x`` and a Rademacher
    ``v``; ``E_v ‖J(x)ᵀ v‖² = ‖J(x)‖_F²``, so the mean is unbiased for ``Tr H_eff``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be positive")
    _check_x(x, 1)
    ki, kv = jax.random.split(key)
    idx = jax.random.randint(ki, (num_samples,), 0, x.shape[0])
    k_out = jax.eval_shape(apply_fn, params, x[0]).shape
    v = jax.random.rademacher(kv, (num_samples, *k_out), jnp.float32)

    def one(i, vi):
        g = jax.grad(lambda p: jnp.vdot(vi, apply_fn(p, x[i])))(params)
        return sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))

    return jnp.mean(jax.vmap(one)(idx, v))


def quantization_variance(params: Any, *, bits: int) -> jax.Array:
    """``σ_q² = δ²/12`` with ``δ = (w_max − w_min)/(2^b − 1)`` over all leaves of ``params``."""
    if bits < 1:
        raise ValueError(f"bits={bits} must be a positive integer")
    leaves = [jnp.ravel(leaf) for leaf in jax.tree.leaves(params)]
    if not leaves:
        raise ValueError("params has no leaves")
    flat = jnp.concatenate(leaves)
    delta = (jnp.max(flat) - jnp.min(flat)) / (2**bits - 1)
    return delta**2 / 12


def tpv_quantization(
    apply_fn: ApplyFn, params: Any, x: jax.Array, *, bits: int = 8, chunk: int = 64
) -> jax.Array:
    """Quantisation TPV ``σ_q² Tr H_eff`` (uniform ``b``-bit rounding over the global range)."""
    return quantization_variance(params, bits=bits) * trace_heff(apply_fn, params, x, chunk=chunk)


def tpv_quantization_mc(
    apply_fn: ApplyFn,
    params: Any,
    x: jax.Array,
    *,
    key: jax.Array,
    bits: int = 8,
    num_runs: int = 50,
) -> jax.Array:
    """Empirical quantisation TPV: ``mean_{r, x} ‖f_{w*+δu_r}(x) − f_{w*}(x)‖²``, ``δu ~ U(±δ/2)``."""
    if num_runs < 1:
        raise ValueError(f"num_runs={num_runs} must be positive")
    half = jnp.sqrt(3.0 * quantization_variance(params, bits=bits))  # δ/2
    leaves, treedef = jax.tree.flatten(params)
    f = jax.vmap(apply_fn, in_axes=(None, 0))
    base = f(params, x)

    def one(k):
        ks = jax.random.split(k, len(leaves))
        noisy = [
            w + jax.random.uniform(kk, w.shape, w.dtype, -half, half)
            for w, kk in zip(leaves, ks, strict=True)
        ]
        out = f(jax.tree.unflatten(treedef, noisy), x)
        return jnp.mean(jnp.sum((out - base) ** 2, axis=-1))

    return jnp.mean(jax.lax.map(one, jax.random.split(key, num_runs)))


def tpv_label_noise(
    apply_fn: ApplyFn,
    params: Any,
    x_fit: jax.Array,
    x_eval: jax.Array | None = None,
    *,
    key: jax.Array,
    sigma: float,
    num_runs: int = 5,
    steps: int = 200,
    learning_rate: float = 0.05,
    prox: float = 1e-3,
) -> jax.Array:
    """Label-noise TPV: refit ``w*`` to noisy logits on ``x_fit``, measure the change on ``x_eval``.

    Run ``r`` draws ``ε_r ~ N(0, σ²)`` of shape ``(b, K)``, minimises
    ``mean_i ‖f_w(x_i) − f*(x_i) − ε_{r,i}‖² + prox ‖w − w*‖²`` from ``w*`` by ``steps`` steps of
    gradient descent, and returns ``mean_{r, x ∈ x_eval} ‖f_{w_r}(x) − f*(x)‖²`` (``x_eval``
    defaults to ``x_fit``: the training-set TPV). The runs are ``vmap``-ed.

    For a linear model ``f_w(x) = W x`` with enough steps, ``w_r − w* = (XᵀX/b + prox I)⁻¹ Xᵀε/b``.
    """
    if sigma < 0 or num_runs < 1 or steps < 1 or prox < 0:
        raise ValueError(
            f"need sigma >= 0, num_runs >= 1, steps >= 1, prox >= 0; got {sigma}, {num_runs}, "
            f"{steps}, {prox}"
        )
    _check_x(x_fit, 1)
    x_eval = x_fit if x_eval is None else x_eval
    f = jax.vmap(apply_fn, in_axes=(None, 0))
    z_fit, z_eval = f(params, x_fit), f(params, x_eval)
    tx = optax.sgd(learning_rate)

    def loss(p, target):
        fit = jnp.mean(jnp.sum((f(p, x_fit) - target) ** 2, -1))
        dist = sum(
            jnp.sum((a - b) ** 2)
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params), strict=True)
        )
        return fit + prox * dist

    def refit(k):
        target = z_fit + sigma * jax.random.normal(k, z_fit.shape)

        def step(carry, _):
            p, s = carry
            u, s = tx.update(jax.grad(loss)(p, target), s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
        return jnp.mean(jnp.sum((f(p, x_eval) - z_eval) ** 2, -1))

    return jnp.mean(jax.vmap(refit)(jax.random.split(key, num_runs)))
