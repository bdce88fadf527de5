"""Output layers on top of query embeddings: linear softmax, sigmoid 1-vs-all, mixture of softmaxes.

Given ``h in R^{b x d}`` and the entity table ``E in R^{E x d}``:

- ``"softmax"`` (linear, 1-N): logits ``z = h E^T``; ``P(o | s, r) = softmax(z)_o``. The log-prob
  matrix over all queries has rank at most ``d + 1`` (rank of ``Z`` plus the per-row normaliser).
- ``"sigmoid"`` (linear, 1-vs-all): the same logits, trained with a binary cross-entropy per entity.
- ``"mos"`` (KGE-MoS, mixture of softmaxes, Yang et al. 2018):
  ``P(o | s, r) = sum_k pi_k(h) softmax(E f_k(h))_o`` with ``f_k(h) = tanh(W_k h + b_k)`` and
  ``pi(h) = softmax(W_pi h)``. Its log-probs are not of bounded rank, which breaks the bottleneck;
  the extra parameters are ``K (d^2 + d) + K d``, independent of ``E``.
- ``"mol"`` (mixture of logits, an ablation): ``z = sum_k pi_k(h) E f_k(h)``, non-linear in ``h``
  but still of the form ``E g(h)``, so still rank ``<= d``.

``"mos"`` with ``K = 1`` is a non-linear projection followed by a linear softmax (the spec's
"non-linearity without mixture" control); :func:`mixture_of_softmaxes` with ``K = 1`` is exactly
the linear softmax.

Scores returned by :func:`output_scores` rank objects (higher is better) and give the model's
categorical distribution through ``log_softmax(scores)`` (for ``"mos"`` they already are
log-probabilities, and ``log_softmax`` leaves them unchanged). For ``"sigmoid"`` that categorical
is the softmax of the logits, used only to report an NLL comparable with the others.

References:
  P4 (rank bottlenecks in KGEs, KGE-MoS); the mixture's detailed form is a reconstruction from
  Yang et al. 2018, "Breaking the softmax bottleneck" (specs.md section 4, Appendix A).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "OUTPUTS",
    "init_output",
    "mixture_of_softmaxes",
    "output_log_probs",
    "output_loss",
    "output_scores",
]

OUTPUTS = ("softmax", "sigmoid", "mos", "mol")


def _check_output(output: str) -> None:
    if output not in OUTPUTS:
        raise ValueError(f"unknown output layer {output!r}; choose one of {OUTPUTS}.")


def init_output(
    key: jax.Array,
    *,
    output: str,
    dim: int,
    num_components: int = 1,
    proj_init: str = "random",
    dtype: jnp.dtype = jnp.float32,
) -> dict[str, jax.Array]:
    """Parameters of an output layer (empty for the linear ones).

    Mixture layers: ``proj_kernel (K, d, d)``, ``proj_bias (K, d)`` zeros, ``prior_kernel (d, K)``
    zeros (uniform mixture weights at initialisation). ``proj_init="random"`` draws the kernels
    from ``N(0, 1/d)`` (Yang et al.); ``"identity"`` uses ``I + N(0, 0.01/d)``, so that at
    initialisation every component is ``tanh(h)``, close to the linear model for small ``h``.

    Args:
      key: PRNG key.
      output: one of ``"softmax"``, ``"sigmoid"``, ``"mos"``, ``"mol"``.
      dim: ``d``, the size of the query embeddings.
      num_components: ``K`` for the mixtures (must be 1 for the linear layers).
      proj_init: ``"random"`` or ``"identity"`` (mixtures only).
      dtype: parameter dtype.

    Returns:
      The parameter dict.
    """
    _check_output(output)
    if num_components < 1:
        raise ValueError(f"num_components must be >= 1; got {num_components}.")
    if output in ("softmax", "sigmoid"):
        if num_components != 1:
            raise ValueError(f"the linear {output!r} layer has one component; use 'mos' for K > 1.")
        return {}
    if proj_init not in ("random", "identity"):
        raise ValueError(f"proj_init must be 'random' or 'identity'; got {proj_init!r}.")
    noise = jax.random.normal(key, (num_components, dim, dim), dtype) / jnp.sqrt(dim)
    kernel = noise if proj_init == "random" else jnp.eye(dim, dtype=dtype) + 0.1 * noise
    return {
        "proj_kernel": kernel,
        "proj_bias": jnp.zeros((num_components, dim), dtype),
        "prior_kernel": jnp.zeros((dim, num_components), dtype),
    }


def mixture_of_softmaxes(component_logits: jax.Array, prior_logits: jax.Array) -> jax.Array:
    """Log-probabilities of a mixture of softmaxes.

    ``log P_o = logsumexp_k (log_softmax(prior)_k + log_softmax(z_k)_o)``.

    Args:
      component_logits: ``(b, K, E)`` logits ``z_k`` of each component.
      prior_logits: ``(b, K)`` unnormalised mixture weights.

    Returns:
      ``(b, E)`` log-probabilities (each row log-sums to 0).
    """
    if component_logits.ndim != 3 or prior_logits.shape != component_logits.shape[:2]:
        raise ValueError(
            "expected component_logits (b, K, E) and prior_logits (b, K); got "
            f"{component_logits.shape} and {prior_logits.shape}."
        )
    log_prior = jax.nn.log_softmax(prior_logits, axis=-1)
    log_comp = jax.nn.log_softmax(component_logits, axis=-1)
    return jax.nn.logsumexp(log_prior[:, :, None] + log_comp, axis=1)


def output_scores(
    params: dict[str, jax.Array], entity_emb: jax.Array, h: jax.Array, *, output: str
) -> jax.Array:
    """Scores of all objects, shape ``(b, E)`` (logits, or log-probs for ``"mos"``).

    Args:
      params: output-layer parameters from :func:`init_output`.
      entity_emb: ``(E, d)`` output entity table.
      h: ``(b, d)`` query embeddings.
      output: the layer kind.

    Returns:
      ``(b, E)`` scores; higher ranks first.
    """
    _check_output(output)
    if output in ("softmax", "sigmoid"):
        return h @ entity_emb.T
    proj = jnp.tanh(jnp.einsum("bi,kij->bkj", h, params["proj_kernel"]) + params["proj_bias"])
    prior_logits = h @ params["prior_kernel"]
    comp_logits = jnp.einsum("bkd,ed->bke", proj, entity_emb)
    if output == "mos":
        return mixture_of_softmaxes(comp_logits, prior_logits)
    prior = jax.nn.softmax(prior_logits, axis=-1)
    return jnp.einsum("bk,bke->be", prior, comp_logits)


def output_log_probs(scores: jax.Array, *, output: str) -> jax.Array:
    """The model's categorical log-distribution over objects, ``log_softmax(scores)``."""
    _check_output(output)
    return jax.nn.log_softmax(scores, axis=-1)


def output_loss(scores: jax.Array, labels: jax.Array, *, output: str) -> jax.Array:
    """Per-query training loss, shape ``(b,)``.

    Softmax family (``softmax``, ``mos``, ``mol``): cross-entropy against the label distribution
    ``y / sum(y)`` (PyKEEN's LCWA ``CrossEntropyLoss``),
    ``-sum_o y_o log P_o / sum_o y_o``. Sigmoid: mean over entities of the binary cross-entropy
    of the logits against ``y``.

    Args:
      scores: ``(b, E)`` from :func:`output_scores`.
      labels: ``(b, E)`` 0/1 multi-hot true objects (at least one per row).
      output: the layer kind.

    Returns:
      ``(b,)`` losses.
    """
    _check_output(output)
    if output == "sigmoid":
        losses = jnp.logaddexp(0.0, scores) - labels * scores  # -[y log s(z) + (1-y) log(1-s(z))]
        return jnp.mean(losses, axis=-1)
    log_p = jax.nn.log_softmax(scores, axis=-1)
    return -jnp.sum(labels * log_p, axis=-1) / jnp.maximum(jnp.sum(labels, axis=-1), 1.0)
