"""KGE scorers written as *query encoders*: ``(s, r) -> h_{s,r} in R^d``, scored by ``E h``.

Every bilinear KGE here scores all objects at once as ``z = E h_{s,r}`` with the entity table
``E in R^{E x d}``. That is a linear output layer of rank at most ``d``, the bottleneck studied in
P4; :mod:`lowrank_jax.kge.outputs` puts a linear, sigmoid or mixture-of-softmaxes layer on top of
``h``.

- DistMult (Yang et al. 2015): ``h = e_s * w_r``.
- ComplEx (Trouillon et al. 2016), real-ified: with ``e = [Re e; Im e]`` of real size ``d`` (``d/2``
  complex numbers), ``Re <e_s, w_r, conj(e_o)> = h . e_o`` with
  ``h = [Re(e_s w_r); Im(e_s w_r)]``. ``d`` is the real dimension (PyKEEN's ``embedding_dim`` is
  ``d/2``).
- TuckER (Balazevic et al. 2019): ``h_k = sum_{i,j} W_{ijk} e_{s,i} w_{r,j}`` with a core tensor
  ``W in R^{d x d_r x d}``. The original's batch-norm and dropouts are left out: the score is the
  plain Tucker form.

Parameters are a dict ``{"entity": (E, d), "relation": (R', d_r), ["core": (d, d_r, d)]}``;
``R'`` counts inverse relations when they are used (pass ``2 R``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["SCORERS", "init_scorer", "query_embedding"]

SCORERS = ("distmult", "complex", "tucker")


def _check_scorer(scorer: str) -> None:
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; choose one of {SCORERS}.")


def init_scorer(
    key: jax.Array,
    *,
    scorer: str,
    num_entities: int,
    num_relations: int,
    dim: int,
    relation_dim: int | None = None,
    init_std: float | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> dict[str, jax.Array]:
    """Initialises the embeddings of a scorer.

    Entities and relations are drawn from ``N(0, init_std^2)``; the default ``init_std`` is
    ``d^{-1/4}`` for DistMult/ComplEx (initial scores ``sum_i e_s e_r e_o`` of variance about
    ``d^{-1/2}``, small but not vanishing) and ``d^{-1/2}`` for TuckER's embeddings, whose core is ``N(0, 1/(d d_r))``.

    Args:
      key: PRNG key.
      scorer: one of ``"distmult"``, ``"complex"``, ``"tucker"``.
      num_entities: ``E``.
      num_relations: ``R'``, the number of relation ids in use (``2 R`` with inverse relations).
      dim: real dimension ``d`` of entity embeddings and of ``h`` (even for ComplEx).
      relation_dim: TuckER's relation dimension ``d_r`` (default ``d``); must be ``d`` otherwise.
      init_std: standard deviation of the embeddings (see above for the default).
      dtype: parameter dtype.

    Returns:
      The parameter dict.

    Raises:
      ValueError: on an unknown scorer, a non-positive size, or an odd ``dim`` for ComplEx.
    """
    _check_scorer(scorer)
    if min(num_entities, num_relations, dim) < 1:
        raise ValueError("num_entities, num_relations and dim must be positive.")
    if scorer == "complex" and dim % 2:
        raise ValueError(
            f"ComplEx needs an even real dimension (real and imaginary halves); got {dim}."
        )
    d_r = dim if relation_dim is None else int(relation_dim)
    if scorer != "tucker" and d_r != dim:
        raise ValueError("relation_dim differs from dim only for TuckER.")
    if init_std is None:
        init_std = dim**-0.5 if scorer == "tucker" else dim**-0.25
    k_e, k_r, k_c = jax.random.split(key, 3)
    params = {
        "entity": init_std * jax.random.normal(k_e, (num_entities, dim), dtype),
        "relation": init_std * jax.random.normal(k_r, (num_relations, d_r), dtype),
    }
    if scorer == "tucker":
        params["core"] = jax.random.normal(k_c, (dim, d_r, dim), dtype) / jnp.sqrt(dim * d_r)
    return params


def query_embedding(
    params: dict[str, jax.Array], heads: jax.Array, relations: jax.Array, *, scorer: str
) -> jax.Array:
    """Query embeddings ``h_{s,r}``, shape ``(b, d)``, such that the scores are ``h @ E.T``.

    Args:
      params: scorer parameters from :func:`init_scorer`.
      heads: ``(b,)`` int subject ids.
      relations: ``(b,)`` int relation ids (inverse relations included in the table).
      scorer: one of ``"distmult"``, ``"complex"``, ``"tucker"``.

    Returns:
      ``(b, d)`` query embeddings.

    References:
      Yang et al. 2015 (DistMult); Trouillon et al. 2016 (ComplEx); Balazevic et al. 2019 (TuckER).
    """
    _check_scorer(scorer)
    e_s = params["entity"][heads]
    w_r = params["relation"][relations]
    if scorer == "distmult":
        return e_s * w_r
    if scorer == "complex":
        a_re, a_im = jnp.split(e_s, 2, axis=-1)
        b_re, b_im = jnp.split(w_r, 2, axis=-1)
        return jnp.concatenate([a_re * b_re - a_im * b_im, a_re * b_im + a_im * b_re], axis=-1)
    return jnp.einsum("bi,bj,ijk->bk", e_s, w_r, params["core"])
