"""Prompt methods for a frozen multimodal transformer with missing modalities (P13 SPR).

A method is a value, ``PromptMethod(name, init, prompts, conditioned)`` of pure functions:
``init(key) -> params`` and ``prompts(params, missing, context) -> (P (b, L, T, d), mask (b, T))``
or ``None`` (no prompts: the linear probe). ``missing`` is the (b, M) boolean pattern and
``missing_type`` its id in [0, K), K = 2^M - 1. ``context`` (b, M, d) holds the available
modalities' features (``MultimodalTransformer.modality_features``: each modality's mean embedded
token, zeros where it is missing); *input-conditioned* methods (``conditioned=True``: DCP-like and
SPR) read it and raise without it, the others ignore it. Type-conditioned parts gather each
example's row of a (K, ...) table with a one-hot product, so every missing pattern runs through the
same jitted code (no Python branch per example).

* ``map_prompts`` (MAP, Lee et al. CVPR'23): one free prompt tensor per missing type; the prompts
  of two inputs with the same missing pattern are equal.
* ``modality_prompts`` (MSP, Jang, Wang, Kim ICASSP'24; reconstruction, the paper was not read):
  one prompt group per modality, (M, L, T, d), linear rather than exponential in M; group i is
  an active slot group when modality i is missing (it stands in for the absent modality), so a
  complete example sees no prompt.
* ``dcp_prompts`` (DCP-like, after Hu et al. NeurIPS'24): layer-0 prompts per missing type plus
  prompts generated layer by layer, ``P^l = P^{l-1} + MLP_l(LN(P^{l-1}))``, where the MLP (bottleneck
  r) acts on the *concatenation of the M modality groups' tokens* (DCP's correlated image/text
  generation), plus modality-common prompts ``C_l`` shared by all missing types, plus *dynamic*
  prompts generated from the input, ``D^l(x) = U_l GELU(W LN([c_1; ...; c_M]))`` from the available
  modalities' features ``c_i`` (a reconstruction: DCP's code splits the prompt length between
  static, dynamic and common prompts; here the three are summed over the same T slots).

References:
  Lee et al., CVPR 2023 (MAP); Hu et al., "Deep Correlated Prompting for Visual Recognition with
  Missing Modalities", NeurIPS 2024 (DCP); Jang, Wang, Kim, "Towards Robust Multimodal Prompting
  with Missing Modalities", ICASSP 2024 (MSP). SPR: :mod:`lowrank_jax.prompts.spr`.
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
]

Prompts = tuple[jax.Array, jax.Array] | None


class PromptMethod(NamedTuple):
    """A prompt method: ``init(key) -> params``,
    ``prompts(params, missing, context=None) -> (P, mask) | None``.

    ``P`` is (b, L, T, d), ``mask`` (b, T) bool (active slots); ``missing`` (b, M) bool;
    ``context`` (b, M, d) the available modalities' features, required where ``conditioned``.
    """

    name: str
    init: Callable[[jax.Array], Any]
    prompts: Callable[..., Prompts]
    conditioned: bool = False


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


def _check_context(name: str, context: Any, missing: jax.Array, dim: int) -> jax.Array:
    """``context`` as a (b, M, d) float array matching ``missing`` (b, M)."""
    if context is None:
        raise ValueError(
            f"{name} prompts are input-conditioned: pass context, the (b, M, d) modality "
            f"features (MultimodalTransformer.modality_features; prompts.prompted_logits does)."
        )
    context = jnp.asarray(context)
    if context.shape != (*missing.shape, dim) or not jnp.issubdtype(context.dtype, jnp.floating):
        raise ValueError(
            f"context must be a float array of shape (b, M, d) = {(*missing.shape, dim)}; got "
            f"{context.dtype} {context.shape}."
        )
    return context


def _gather(table: jax.Array, missing: jax.Array) -> jax.Array:
    """Row ``missing_type(missing)[b]`` of a (K, ...) table for every example: (b, ...)."""
    onehot = jax.nn.one_hot(missing_type(missing), table.shape[0], dtype=table.dtype)
    return jnp.tensordot(onehot, table, axes=1)


def _jit_init(module: nn.Module) -> Callable[[jax.Array], Any]:
    """``key -> module.init(key)["params"]``, jitted (one compilation instead of one small
    compilation per initialiser shape when run eagerly)."""
    return jax.jit(lambda key: module.init(key)["params"])


def _from_module(name: str, module: nn.Module, num_modalities: int) -> PromptMethod:
    """A PromptMethod whose (K, L, T, d) table is ``module.apply(params)`` (no input)."""

    init = _jit_init(module)

    def prompts(params: Any, missing: jax.Array, context: Any = None) -> Prompts:
        del context  # a fixed table per missing type
        missing = _check_missing(missing, num_modalities)
        p = _gather(module.apply({"params": params}), missing)
        return p, jnp.ones(p.shape[:1] + p.shape[2:3], bool)

    return PromptMethod(name, init, prompts)


def conditioned_method(
    name: str, module: nn.Module, *, num_modalities: int, dim: int
) -> PromptMethod:
    """An input-conditioned PromptMethod: ``P = module.apply(params, onehot, context)`` (b, L, T, d),
    with ``onehot`` (b, K) the one-hot missing types and ``context`` (b, M, d); every slot active.
    """
    k = num_missing_types(num_modalities)
    init = jax.jit(
        lambda key: module.init(
            key, jnp.zeros((1, k)), jnp.zeros((1, num_modalities, dim), jnp.float32)
        )["params"]
    )

    def prompts(params: Any, missing: jax.Array, context: Any = None) -> Prompts:
        missing = _check_missing(missing, num_modalities)
        context = _check_context(name, context, missing, dim)
        onehot = jax.nn.one_hot(missing_type(missing), k, dtype=context.dtype)
        p = module.apply({"params": params}, onehot, context)
        return p, jnp.ones(p.shape[:1] + p.shape[2:3], bool)

    return PromptMethod(name, init, prompts, conditioned=True)


class InputCode(nn.Module):
    """``z = GELU(W LN([c_1; ...; c_M]))`` (b, width): a code of the available modalities'
    features ``context`` (b, M, d) (a missing modality's ``c_i`` is zero)."""

    width: int

    @nn.compact
    def __call__(self, context: jax.Array) -> jax.Array:
        flat = context.reshape(context.shape[0], -1)
        return nn.gelu(nn.Dense(self.width, name="dense")(nn.LayerNorm(name="ln")(flat)))


def no_prompts(*, num_modalities: int) -> PromptMethod:
    """The linear probe: no prompt parameters, ``prompts(...) -> None``."""
    num_missing_types(num_modalities)

    def prompts(params: Any, missing: jax.Array, context: Any = None) -> Prompts:
        del params, context
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

    def prompts(params: Any, missing: jax.Array, context: Any = None) -> Prompts:
        del context  # one fixed group per modality
        missing = _check_missing(missing, num_modalities)
        groups = module.apply({"params": params})  # (M, L, T, d)
        m, layers, t, d = groups.shape
        p = jnp.transpose(groups, (1, 0, 2, 3)).reshape(layers, m * t, d)
        p = jnp.broadcast_to(p, (missing.shape[0], layers, m * t, d))
        return p, jnp.repeat(missing, t, axis=1)

    return PromptMethod("msp", init, prompts)


class _CorrelatedPrompts(nn.Module):
    """DCP-like: per-type layer-0 prompts, correlated layer-to-layer generation, common prompts,
    and dynamic prompts generated from the input; (b, L, T, d)."""

    num_types: int
    num_modalities: int
    num_layers: int
    num_tokens: int
    dim: int
    bottleneck: int

    @nn.compact
    def __call__(self, onehot: jax.Array, context: jax.Array) -> jax.Array:
        k, m, t, d = self.num_types, self.num_modalities, self.num_tokens, self.dim
        layers = self.num_layers
        p = self.param("prompts", nn.initializers.normal(0.02), (k, t, d))
        common = self.param("common", nn.initializers.zeros, (layers, t, d))
        out = [p + common[0]]
        for layer in range(1, layers):
            # The M modality groups of T/M tokens side by side: (K, T/M, M*d).
            joint = p.reshape(k, m, t // m, d).transpose(0, 2, 1, 3).reshape(k, t // m, m * d)
            h = nn.LayerNorm(name=f"ln_{layer}")(joint)
            h = nn.gelu(nn.Dense(self.bottleneck, name=f"down_{layer}")(h))
            h = nn.Dense(m * d, kernel_init=nn.initializers.zeros, name=f"up_{layer}")(h)
            h = h.reshape(k, t // m, m, d).transpose(0, 2, 1, 3).reshape(k, t, d)
            p = p + h
            out.append(p + common[layer])
        static = jnp.tensordot(onehot, jnp.stack(out, 1), axes=1)  # (b, L, T, d)
        z = InputCode(self.bottleneck, name="dynamic_code")(context)
        dynamic = nn.Dense(layers * t * d, kernel_init=nn.initializers.zeros, name="dynamic")(z)
        return static + dynamic.reshape(-1, layers, t, d)


def dcp_prompts(
    *, num_modalities: int, num_layers: int, num_tokens: int, dim: int, bottleneck: int = 16
) -> PromptMethod:
    """DCP-like correlated prompts with dynamic, input-conditioned prompts (see the module
    docstring for the recursion); ``prompts(params, missing, context)`` needs ``context``.

    Args:
      num_modalities, num_layers, num_tokens, dim: as in ``map_prompts``; ``num_tokens`` must
        be a multiple of M (T/M tokens per modality group).
      bottleneck: hidden width r of each layer's generator MLP and of the dynamic prompts'
        input code.

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
    return conditioned_method("dcp", module, num_modalities=num_modalities, dim=dim)
