"""SPR (ICML'26 poster 64804): missing-type prompts refined, given the input, by three modules.

A reconstruction of specs.md §13 [R] (only the abstract is public). Per example, the base prompt
``P`` (L, T, d) is MAP's prompt of its missing type m; the input enters as ``z = GELU(W LN([c_1;
...; c_M]))``, a code of the available modalities' features (``context`` (b, M, d), zeros for a
missing modality; ``methods.InputCode``). The modules, each optional::

    GIF  P~ = P + W_o [h_fwd; h_bwd]                  bidirectional GRU along the layer axis L
                                                      (tokens as the batch), input [P_l; z] at
                                                      layer l,
    LFR  P^ = P~ + W_pw GELU(DWConv_3(P~) + W_z z)    depthwise kernel-3 conv along the token
                                                      axis T, shifted per channel by the input,
    CFS  P_out = P^ * g,  g = 2 sigmoid(W_2 GELU(W_1 [mean_T P^; e_m; z]))  in (0, 2)^{L x d},

with ``e_m`` a learned missing-type embedding. Every module reads the input, so two inputs with the
same missing pattern get different prompts (MAP's table cannot represent SPR). The spec writes
sigma for the gate; the factor 2 lets it *boost* channels (the abstract's wording) and makes g = 1
at initialisation. W_o, W_pw and W_2 start at zero, so an SPR at initialisation produces exactly
its MAP base prompts; ``gif=False`` ... switches a module off (the single-module ablations).

References:
  "SPR: A Structured Prompt Refinement Network for Modality Missing", ICML 2026 poster 64804
  (abstract only; module stack and input conditioning reconstructed); Lee et al., CVPR 2023 (MAP,
  the base prompts).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.prompts.methods import (
    InputCode,
    PromptMethod,
    _check_dims,
    conditioned_method,
)

__all__ = ["spr_prompts"]


class _SPRPrompts(nn.Module):
    """SPR's base prompts refined by GIF -> LFR -> CFS (each optional) given the input."""

    num_types: int
    num_layers: int
    num_tokens: int
    dim: int
    hidden: int
    gif: bool = True
    lfr: bool = True
    cfs: bool = True

    @nn.compact
    def __call__(self, onehot: jax.Array, context: jax.Array) -> jax.Array:
        k, layers, t, d, hid = (
            self.num_types,
            self.num_layers,
            self.num_tokens,
            self.dim,
            self.hidden,
        )
        table = self.param("prompts", nn.initializers.normal(0.02), (k, layers, t, d))
        p = jnp.tensordot(onehot, table, axes=1)  # (b, L, T, d)
        b = p.shape[0]
        z = InputCode(hid, name="input_code")(context)  # (b, hidden)
        zeros = nn.initializers.zeros
        if self.gif:  # bidirectional GRU along L; (b*T) sequences of length L, input [P_l; z]
            seq = p.transpose(0, 2, 1, 3).reshape(b * t, layers, d)
            zs = jnp.broadcast_to(z[:, None, None, :], (b, t, layers, hid))
            seq = jnp.concatenate([seq, zs.reshape(b * t, layers, hid)], -1)
            rnn = nn.Bidirectional(
                nn.RNN(nn.GRUCell(hid), name="gru_fwd"),
                nn.RNN(nn.GRUCell(hid), name="gru_bwd"),
                name="gif",
            )
            h = nn.Dense(d, kernel_init=zeros, name="gif_out")(rnn(seq))
            p = p + h.reshape(b, t, layers, d).transpose(0, 2, 1, 3)
        if self.lfr:  # depthwise conv along T (kernel 3) + input shift, GELU, point-wise, residual
            flat = p.reshape(b * layers, t, d)
            h = nn.Conv(d, (3,), padding="SAME", feature_group_count=d, name="lfr_dw")(flat)
            h = h.reshape(b, layers, t, d) + nn.Dense(d, name="lfr_input")(z)[:, None, None, :]
            p = p + nn.Dense(d, kernel_init=zeros, name="lfr_pw")(nn.gelu(h))
        if self.cfs:  # gate per (example, layer, channel): token mean, type embedding, input code
            e = jnp.tensordot(
                onehot, self.param("type_embed", nn.initializers.normal(0.02), (k, hid)), axes=1
            )
            h = jnp.concatenate(
                [
                    p.mean(axis=2),
                    jnp.broadcast_to(jnp.concatenate([e, z], -1)[:, None], (b, layers, 2 * hid)),
                ],
                -1,
            )
            h = nn.gelu(nn.Dense(hid, name="cfs_1")(h))
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
    """SPR (reconstruction of specs.md §13): MAP base prompts refined by GIF, LFR and CFS, each
    conditioned on the input (see the module docstring).

    Args:
      num_modalities, num_layers, num_tokens, dim: as in ``methods.map_prompts``.
      hidden: GRU width of GIF, width of the input code z, hidden and type-embedding width of CFS.
      gif, lfr, cfs: keep each module (False: the single-module ablations).

    Returns:
      A PromptMethod named ``spr`` (``spr-gif`` etc. with a module removed), ``conditioned``:
      ``prompts(params, missing, context)`` with ``context`` (b, M, d).

    Raises:
      ValueError: for non-positive sizes, and (from ``prompts``) a missing or misshapen context.

    Example:
      >>> method = spr_prompts(num_modalities=2, num_layers=3, num_tokens=4, dim=64)
      >>> params = method.init(jax.random.key(0))
      >>> context = jnp.ones((1, 2, 64))  # the modalities' features (zeros where missing)
      >>> p, mask = method.prompts(params, jnp.array([[False, True]]), context)
      >>> p.shape, mask.shape
      ((1, 3, 4, 64), (1, 4))
    """
    k = _check_dims(num_modalities, num_layers, num_tokens, dim)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be a positive int; got {hidden!r}.")
    name = "spr" + "".join(
        f"-{m}" for m, on in (("gif", gif), ("lfr", lfr), ("cfs", cfs)) if not on
    )
    module = _SPRPrompts(k, num_layers, num_tokens, dim, hidden, gif, lfr, cfs)
    return conditioned_method(name, module, num_modalities=num_modalities, dim=dim)
