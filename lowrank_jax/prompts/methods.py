"""Prompt methods for a frozen multimodal transformer with missing modalities (P13 SPR).

A method is a value, ``PromptMethod(name, init, prompts)`` of pure functions:
``init(key) -> params`` and ``prompts(params, missing) -> (P (b, L, T, d), mask (b, T))`` or
``None`` (no prompts: the linear probe). ``missing`` is the (b, M) boolean pattern and
``missing_type`` its id in [0, K), K = 2^M - 1. Type-conditioned methods build a table of K
prompt tensors (K, L, T, d) once per call and gather each example's row with a one-hot product,
so every missing pattern runs through the same jitted code (no Python branch per example).

* ``map_prompts`` (MAP, Lee et al. CVPR'23): one free prompt tensor per missing type.
* ``modality_prompts`` (MSP, Jang, Wang, Kim ICASSP'24; reconstruction, the paper was not read):
  one prompt group per modality, (M, L, T, d), linear rather than exponential in M; group i is
  an active slot group when modality i is missing (it stands in for the absent modality), so a
  complete example sees no prompt.
* ``dcp_prompts`` (DCP-like, after Hu et al. NeurIPS'24): layer-0 prompts per missing type plus
  prompts generated layer by layer, ``P^l = P^{l-1} + MLP_l(LN(P^{l-1}))``, where the MLP (bottleneck
  r) acts on the *concatenation of the M modality groups' tokens* (DCP's correlated image/text
  generation), plus modality-common prompts ``C_l`` shared by all missing types. DCP's dynamic
  (input-conditioned) prompts are left out.
* ``spr_prompts`` (SPR, ICML'26 poster 64804; a reconstruction, specs.md §13 [R], since only the
  abstract is public): per-type base prompts P_m (L, T, d) refined by::

    GIF  P~ = P + W_o [h_fwd; h_bwd]            (bidirectional GRU along the layer axis L,
                                                 tokens as the batch),
    LFR  P^ = P~ + W_pw GELU(DWConv_3(P~))      (depthwise kernel-3 conv along the token axis T),
    CFS  P_out = P^ * g_m,  g_m = 2 sigmoid(W_2 GELU(W_1 [mean_T P^; e_m]))  in (0, 2)^{L x d},

  with e_m a learned missing-type embedding. The spec writes sigma; the factor 2 lets the gate
  *boost* channels (the abstract's wording) and makes g = 1 at initialisation. W_o, W_pw and
  W_2 start at zero, so an SPR at initialisation produces exactly its MAP base prompts; each
  module can be switched off (``gif=False`` ...) for the single-module ablations.

References:
  Lee et al., CVPR 2023 (MAP); Hu et al., "Deep Correlated Prompting for Visual Recognition with
  Missing Modalities", NeurIPS 2024 (DCP); Jang, Wang, Kim, "Towards Robust Multimodal Prompting
  with Missing Modalities", ICASSP 2024 (MSP); "SPR: A Structured Prompt Refinement Network for
  Modality Missing", ICML 2026 poster 64804 (abstract only; module stack reconstructed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.prompts.missing import missing_type, num_missing_types

__all__ = [
    "PromptMethod",
    "dcp_prompts",
    "map_prompts",
    "modality_prompts",
    "no_prompts",
    "spr_prompts",
]

Prompts = tuple[jax.Array, jax.Array] | None


class PromptMethod(NamedTuple):
    """A prompt method: ``init(key) -> params``, ``prompts(params, missing) -> (P, mask) | None``.

    ``P`` is (b, L, T, d), ``mask`` (b, T) bool (active slots); ``missing`` (b, M) bool.
    """

    name: str
    init: Callable[[jax.Array], Any]
    prompts: Callable[[Any, jax.Array], Prompts]


def _check_dims(num_modalities: int, num_layers: int, num_tokens: int, dim: int) -> int:
    for name, v in (("num_layers", num_layers), ("num_tokens", num_tokens), ("dim", dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int; got {v!r}.")
    return num_missing_types(num_modalities)


def _check_missing(missing: jax.Array, num_modalities: int) -> jax.Array:
    missing = jnp.asarray(missing)
    if missing.ndim != 2 or missing.shape[1] != num_modalities or missing.dtype != jnp.bool_:
        raise ValueError(
            f"missing must be a (b, {num_modalities}) bool array; got {missing.dtype} "
            f"{missing.shape}."
        )
    return missing


def _gather(table: jax.Array, missing: jax.Array) -> jax.Array:
    """Row ``missing_type(missing)[b]`` of a (K, ...) table for every example: (b, ...)."""
    onehot = jax.nn.one_hot(missing_type(missing), table.shape[0], dtype=table.dtype)
    return jnp.tensordot(onehot, table, axes=1)


def _jit_init(module: nn.Module) -> Callable[[jax.Array], Any]:
    """``key -> module.init(key)["params"]``, jitted (one compilation instead of one small
    compilation per initialiser shape when run eagerly)."""
    return jax.jit(lambda key: module.init(key)["params"])


def _from_module(
    name: str, module: nn.Module, num_modalities: int, mask_fn: Callable | None = None
) -> PromptMethod:
    """A PromptMethod whose (K, L, T, d) table is ``module.apply(params)``."""

    init = _jit_init(module)

    def prompts(params: Any, missing: jax.Array) -> Prompts:
        missing = _check_missing(missing, num_modalities)
        table = module.apply({"params": params})
        p = _gather(table, missing)
        mask = jnp.ones(p.shape[:1] + p.shape[2:3], bool) if mask_fn is None else mask_fn(missing)
        return p, mask

    return PromptMethod(name, init, prompts)


def no_prompts(*, num_modalities: int) -> PromptMethod:
    """The linear probe: no prompt parameters, ``prompts(...) -> None``."""
    num_missing_types(num_modalities)

    def prompts(params: Any, missing: jax.Array) -> Prompts:
        del params
        _check_missing(missing, num_modalities)
        return None

    return PromptMethod("probe", lambda key: {}, prompts)


class _TypePrompts(nn.Module):
    """A free (K, L, T, d) table: MAP's prompts, one per missing type."""

    shape: tuple[int, int, int, int]

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("prompts", nn.initializers.normal(0.02), self.shape)


def map_prompts(*, num_modalities: int, num_layers: int, num_tokens: int, dim: int) -> PromptMethod:
    """MAP: a free prompt tensor (L, T, d) per missing type, K = 2^M - 1 of them.

    ``prompts(params, missing)[0][b] = params["prompts"][missing_type(missing)[b]]``.

    Args:
      num_modalities: M.
      num_layers: L, the prompted blocks 0..L-1.
      num_tokens: T prompt tokens per layer.
      dim: width d of the backbone.

    Raises:
      ValueError: for non-positive sizes.
    """
    k = _check_dims(num_modalities, num_layers, num_tokens, dim)
    module = _TypePrompts((k, num_layers, num_tokens, dim))
    return _from_module("map", module, num_modalities)


def modality_prompts(
    *, num_modalities: int, num_layers: int, num_tokens: int, dim: int
) -> PromptMethod:
    """MSP-style modality-specific prompts: group i (L, T, d) is active iff modality i is missing.

    The prompt is the concatenation of the M groups along the token axis, (b, L, M*T, d); the
    mask (b, M*T) switches group i on where ``missing[:, i]``. Reconstruction (see module doc).

    Raises:
      ValueError: for non-positive sizes.
    """
    _check_dims(num_modalities, num_layers, num_tokens, dim)
    module = _TypePrompts((num_modalities, num_layers, num_tokens, dim))

    init = _jit_init(module)

    def prompts(params: Any, missing: jax.Array) -> Prompts:
        missing = _check_missing(missing, num_modalities)
        groups = module.apply({"params": params})  # (M, L, T, d)
        m, layers, t, d = groups.shape
        p = jnp.transpose(groups, (1, 0, 2, 3)).reshape(layers, m * t, d)
        p = jnp.broadcast_to(p, (missing.shape[0], layers, m * t, d))
        return p, jnp.repeat(missing, t, axis=1)

    return PromptMethod("msp", init, prompts)


class _CorrelatedPrompts(nn.Module):
    """DCP-like: per-type layer-0 prompts, correlated layer-to-layer generation, common prompts."""

    num_types: int
    num_modalities: int
    num_layers: int
    num_tokens: int
    dim: int
    bottleneck: int

    @nn.compact
    def __call__(self) -> jax.Array:
        k, m, t, d = self.num_types, self.num_modalities, self.num_tokens, self.dim
        p = self.param("prompts", nn.initializers.normal(0.02), (k, t, d))
        common = self.param("common", nn.initializers.zeros, (self.num_layers, t, d))
        out = [p + common[0]]
        for layer in range(1, self.num_layers):
            # The M modality groups of T/M tokens side by side: (K, T/M, M*d).
            joint = p.reshape(k, m, t // m, d).transpose(0, 2, 1, 3).reshape(k, t // m, m * d)
            h = nn.LayerNorm(name=f"ln_{layer}")(joint)
            h = nn.gelu(nn.Dense(self.bottleneck, name=f"down_{layer}")(h))
            h = nn.Dense(m * d, kernel_init=nn.initializers.zeros, name=f"up_{layer}")(h)
            h = h.reshape(k, t // m, m, d).transpose(0, 2, 1, 3).reshape(k, t, d)
            p = p + h
            out.append(p + common[layer])
        return jnp.stack(out, 1)  # (K, L, T, d)


def dcp_prompts(
    *, num_modalities: int, num_layers: int, num_tokens: int, dim: int, bottleneck: int = 16
) -> PromptMethod:
    """DCP-like correlated prompts (see the module docstring for the recursion).

    Args:
      num_modalities, num_layers, num_tokens, dim: as in ``map_prompts``; ``num_tokens`` must
        be a multiple of M (T/M tokens per modality group).
      bottleneck: hidden width r of each layer's generator MLP.

    Raises:
      ValueError: for non-positive sizes or T not a multiple of M.
    """
    k = _check_dims(num_modalities, num_layers, num_tokens, dim)
    if num_tokens % num_modalities or bottleneck < 1:
        raise ValueError(
            f"num_tokens={num_tokens} must be a multiple of num_modalities={num_modalities} "
            f"and bottleneck={bottleneck} >= 1."
        )
    module = _CorrelatedPrompts(k, num_modalities, num_layers, num_tokens, dim, bottleneck)
    return _from_module("dcp", module, num_modalities)


class _SPRPrompts(nn.Module):
    """SPR's base prompts refined by GIF -> LFR -> CFS (each optional), as a (K, L, T, d) table."""

    num_types: int
    num_layers: int
    num_tokens: int
    dim: int
    hidden: int
    gif: bool = True
    lfr: bool = True
    cfs: bool = True

    @nn.compact
    def __call__(self) -> jax.Array:
        k, layers, t, d = self.num_types, self.num_layers, self.num_tokens, self.dim
        p = self.param("prompts", nn.initializers.normal(0.02), (k, layers, t, d))
        zeros = nn.initializers.zeros
        if self.gif:  # bidirectional GRU along L; (K*T) sequences of length L
            seq = p.transpose(0, 2, 1, 3).reshape(k * t, layers, d)
            rnn = nn.Bidirectional(
                nn.RNN(nn.GRUCell(self.hidden), name="gru_fwd"),
                nn.RNN(nn.GRUCell(self.hidden), name="gru_bwd"),
                name="gif",
            )
            h = nn.Dense(d, kernel_init=zeros, name="gif_out")(rnn(seq))
            p = p + h.reshape(k, t, layers, d).transpose(0, 2, 1, 3)
        if self.lfr:  # depthwise conv along T (kernel 3), GELU, point-wise linear, residual
            flat = p.reshape(k * layers, t, d)
            h = nn.Conv(d, (3,), padding="SAME", feature_group_count=d, name="lfr_dw")(flat)
            h = nn.Dense(d, kernel_init=zeros, name="lfr_pw")(nn.gelu(h))
            p = p + h.reshape(k, layers, t, d)
        if self.cfs:  # gate per (type, layer, channel) from the token mean and a type embedding
            e = self.param("type_embed", nn.initializers.normal(0.02), (k, self.hidden))
            e = jnp.broadcast_to(e[:, None, :], (k, layers, self.hidden))
            h = jnp.concatenate([p.mean(axis=2), e], -1)
            h = nn.gelu(nn.Dense(self.hidden, name="cfs_1")(h))
            g = 2.0 * jax.nn.sigmoid(nn.Dense(d, kernel_init=zeros, name="cfs_2")(h))
            p = p * g[:, :, None, :]
        return p


def spr_prompts(
    *,
    num_modalities: int,
    num_layers: int,
    num_tokens: int,
    dim: int,
    hidden: int = 32,
    gif: bool = True,
    lfr: bool = True,
    cfs: bool = True,
) -> PromptMethod:
    """SPR (reconstruction of specs.md §13): MAP base prompts refined by GIF, LFR and CFS.

    Args:
      num_modalities, num_layers, num_tokens, dim: as in ``map_prompts``.
      hidden: GRU width of GIF, and hidden width and type-embedding width of CFS.
      gif, lfr, cfs: keep each module (False: the single-module ablations).

    Returns:
      A PromptMethod named ``spr`` (``spr-gif`` etc. with a module removed).

    Raises:
      ValueError: for non-positive sizes.

    Example:
      >>> method = spr_prompts(num_modalities=2, num_layers=3, num_tokens=4, dim=64)
      >>> params = method.init(jax.random.key(0))
      >>> p, mask = method.prompts(params, jnp.array([[False, True]]))
      >>> p.shape, mask.shape
      ((1, 3, 4, 64), (1, 4))
    """
    k = _check_dims(num_modalities, num_layers, num_tokens, dim)
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1; got {hidden}.")
    name = "spr" + "".join(
        f"-{m}" for m, on in (("gif", gif), ("lfr", lfr), ("cfs", cfs)) if not on
    )
    module = _SPRPrompts(k, num_layers, num_tokens, dim, hidden, gif, lfr, cfs)
    return _from_module(name, module, num_modalities)
