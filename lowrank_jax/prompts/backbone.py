"""A frozen multimodal pre-LN transformer whose tokens are per-modality linear projections.

Each modality i (features x_i of width n_i) becomes T_i tokens of width d by one linear map,
``tokens_i = reshape(x_i W_i + c_i, (T_i, d))``; the sequence ``[CLS; tokens_0; ...; tokens_{M-1}]``
plus learned position embeddings goes through ``depth`` pre-LN blocks
(`lowrank_jax.models.layers.PreLNBlock`), a final LayerNorm, and a linear ``head`` on the CLS token.

A missing modality (``missing[b, i]`` True) is handled with ``jnp.where`` and masks only, so one
jitted function per ``missing_input`` mode serves every missing pattern. Its features are replaced
by zeros, the mean of standardised features: a fixed, non-informative input, the analogue of MAP's
blank image / empty text, whose tokens are the projection bias ``c_i`` plus position embeddings.
``missing_input`` then decides what the backbone does with them:

* ``"blank"`` (default, as MAP): the blank tokens stay in the attention like any others, so the
  frozen backbone, pre-trained on complete pairs, sees an input it never saw in training (the
  shift prompts are meant to correct).
* ``"drop"`` (an ablation): the tokens are removed from the attention keys (key mask False), so
  no other token reads them and the missing modality has no effect on the output.

``modality_features`` pools each modality's embedded tokens into one (b, M, d) summary (zeros for
a missing modality), the input that input-conditioned prompt methods read.

Prompts (``lowrank_jax.prompts.methods``) are ``P`` (b, L_p, T, d): deep, input-level prompts as
in MAP/VPT-deep. ``T`` prompt slots are prepended to the sequence; before block l < L_p the slots
are *set* to ``P[:, l]`` (the outputs of block l-1 in those slots are replaced); after block
L_p - 1 they propagate like other tokens. ``prompt_mask`` (b, T) turns slots on or off as
attention keys; with every slot off the CLS output equals that of the model without prompts.

Parameter paths::

    params/proj_<i>/{kernel (n_i, T_i*d), bias}     one per modality
    params/cls_token (1, 1, d), params/pos_embed (1, 1 + sum T_i, d)
    params/layers_<l>/...                            `PreLNBlock` parameters, l = 0..depth-1
    params/ln_final/{scale,bias}, params/head/{kernel (d, classes), bias}

References:
  Lee et al., "Multimodal Prompting with Missing Modalities for Visual Recognition", CVPR 2023
  (MAP: a frozen ViLT, missing modalities as blank inputs, prompts prepended at layers 0..5).
  Jia et al., "Visual Prompt Tuning", ECCV 2022 (deep prompts replaced at every layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.models.layers import PreLNBlock

__all__ = ["MISSING_INPUTS", "MultimodalTransformer"]

MISSING_INPUTS = ("blank", "drop")  # how a missing modality enters the backbone


class MultimodalTransformer(nn.Module):
    """Pre-LN transformer classifier over M modalities given as feature vectors.

    Attributes:
      modalities: modality names, in token order (the keys of ``features``).
      feature_dims: width n_i of each modality's features.
      tokens: number of tokens T_i each modality is projected to.
      dim: width d.
      depth: number of blocks.
      heads: attention heads (must divide d).
      mlp_dim: MLP hidden width.
      num_classes: width of the head.
      missing_input: ``"blank"`` (a missing modality enters as zero features, its tokens attended
        to) or ``"drop"`` (its tokens masked out of the attention keys); see the module doc.

    Example:
      >>> model = MultimodalTransformer(("img", "txt"), (240, 76), (8, 8), 64, 4, 4, 128, 10)
      >>> feats = {"img": jnp.zeros((2, 240)), "txt": jnp.zeros((2, 76))}
      >>> params = model.init(jax.random.key(0), feats)["params"]  # doctest: +SKIP
    """

    modalities: tuple[str, ...]
    feature_dims: tuple[int, ...]
    tokens: tuple[int, ...]
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_dim: int = 128
    num_classes: int = 10
    missing_input: str = "blank"

    def setup(self):
        if self.missing_input not in MISSING_INPUTS:
            raise ValueError(
                f"missing_input={self.missing_input!r} is invalid: use one of {MISSING_INPUTS}."
            )
        m = len(self.modalities)
        if m < 1 or len(self.feature_dims) != m or len(self.tokens) != m:
            raise ValueError(
                f"modalities {self.modalities}, feature_dims {self.feature_dims} and tokens "
                f"{self.tokens} must be non-empty and of equal length (one entry per modality)."
            )
        if len(set(self.modalities)) != m:
            raise ValueError(f"modality names must be distinct; got {self.modalities}.")
        self.proj = [nn.Dense(t * self.dim) for t in self.tokens]
        self.cls_token = self.param("cls_token", nn.initializers.zeros, (1, 1, self.dim))
        self.pos_embed = self.param(
            "pos_embed", nn.initializers.normal(0.02), (1, 1 + sum(self.tokens), self.dim)
        )
        self.layers = [
            PreLNBlock(num_heads=self.heads, mlp_dim=self.mlp_dim) for _ in range(self.depth)
        ]
        self.ln_final = nn.LayerNorm()
        self.head = nn.Dense(self.num_classes)

    def _check(self, features: Mapping[str, Any], missing: Any) -> tuple[list[jax.Array], Any]:
        if not isinstance(features, Mapping):
            raise TypeError(
                f"features must be a mapping {{modality name: (b, n_i) array}}; got "
                f"{type(features).__name__}."
            )
        unknown = sorted(set(features) - set(self.modalities))
        absent = [k for k in self.modalities if k not in features]
        if unknown or absent:
            raise ValueError(
                f"features must have exactly the modalities {self.modalities}; unknown "
                f"{unknown}, absent {absent}. Pass a missing modality as zeros and mark it in "
                f"`missing`."
            )
        xs = [jnp.asarray(features[k]) for k in self.modalities]
        b = xs[0].shape[0] if xs[0].ndim else None
        for k, x, n in zip(self.modalities, xs, self.feature_dims, strict=True):
            if x.ndim != 2 or x.shape != (b, n):
                raise ValueError(
                    f"features[{k!r}] must have shape (b, {n}) with the same b for every "
                    f"modality; got {x.shape}."
                )
        if missing is None:
            missing = jnp.zeros((b, len(xs)), bool)
        missing = jnp.asarray(missing)
        if missing.shape != (b, len(xs)) or missing.dtype != jnp.bool_:
            raise ValueError(
                f"missing must be a bool array of shape (b, M) = {(b, len(xs))}; got "
                f"{missing.dtype} {missing.shape}."
            )
        return xs, missing

    def embed(
        self, features: Mapping[str, jax.Array], missing: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Tokens ``(b, 1 + sum T_i, d)`` and their key mask ``(b, 1 + sum T_i)`` bool (all True
        with ``missing_input="blank"``; False on a missing modality's tokens with ``"drop"``).

        Args:
          features: ``{name: (b, n_i)}`` for every modality (values of missing ones are ignored:
            they become zeros, the blank input).
          missing: ``(b, M)`` bool, True where a modality is missing (None: all present).

        Raises:
          TypeError, ValueError: unknown or absent modalities, wrong widths or mask shape.
        """
        xs, missing = self._check(features, missing)
        b = xs[0].shape[0]
        parts = [jnp.broadcast_to(self.cls_token, (b, 1, self.dim))]
        masks = [jnp.ones((b, 1), bool)]
        for i, (x, proj, t) in enumerate(zip(xs, self.proj, self.tokens, strict=True)):
            x = jnp.where(missing[:, i : i + 1], 0.0, x)
            parts.append(proj(x).reshape(b, t, self.dim))
            keep = (
                ~missing[:, i : i + 1] if self.missing_input == "drop" else jnp.ones((b, 1), bool)
            )
            masks.append(jnp.broadcast_to(keep, (b, t)))
        return jnp.concatenate(parts, 1) + self.pos_embed, jnp.concatenate(masks, 1)

    def modality_features(self, x: jax.Array, missing: jax.Array) -> jax.Array:
        """The available modalities' features ``(b, M, d)``: modality i's mean embedded token
        (``x`` from ``embed``), zeros where ``missing[:, i]`` — the input that conditioned prompt
        methods (DCP-like, SPR) read."""
        starts = [1 + sum(self.tokens[:i]) for i in range(len(self.tokens))]
        means = [x[:, s : s + t].mean(1) for s, t in zip(starts, self.tokens, strict=True)]
        return jnp.where(missing[:, :, None], 0.0, jnp.stack(means, 1))

    def classify(self, h: jax.Array) -> jax.Array:
        """The head on CLS features ``(b, d)``: logits ``(b, num_classes)``."""
        return self.head(h)

    def encode(
        self,
        x: jax.Array,
        key_mask: jax.Array,
        prompts: jax.Array | None = None,
        prompt_mask: jax.Array | None = None,
    ) -> jax.Array:
        """The blocks and final LayerNorm over embedded tokens: the CLS feature ``(b, d)``.

        Args:
          x: ``(b, t, d)`` tokens from ``embed``, CLS first.
          key_mask: ``(b, t)`` bool, True for tokens other tokens may attend to.
          prompts: ``(b, L_p, T, d)`` deep prompts for blocks 0..L_p-1, or None.
          prompt_mask: ``(b, T)`` bool, True for active prompt slots (None: all active).

        Raises:
          ValueError: if ``prompts`` does not fit (L_p > depth, wrong width or batch).
        """
        b = x.shape[0]
        cls = 0
        if prompts is not None:
            if prompts.ndim != 4 or prompts.shape[0] != b or prompts.shape[3] != self.dim:
                raise ValueError(
                    f"prompts must have shape (b, L_p, T, d) = ({b}, L_p, T, {self.dim}); "
                    f"got {prompts.shape}."
                )
            _, lp, t, _ = prompts.shape
            if not 1 <= lp <= self.depth:
                raise ValueError(f"prompts cover L_p={lp} layers; the backbone has {self.depth}.")
            if prompt_mask is None:
                prompt_mask = jnp.ones((b, t), bool)
            if prompt_mask.shape != (b, t):
                raise ValueError(
                    f"prompt_mask must have shape (b, T) = {(b, t)}; got {prompt_mask.shape}."
                )
            x = jnp.concatenate([prompts[:, 0].astype(x.dtype), x], 1)
            key_mask = jnp.concatenate([prompt_mask, key_mask], 1)
            cls = t
        mask = key_mask[:, None, None, :]
        for layer, block in enumerate(self.layers):
            if prompts is not None and 0 < layer < prompts.shape[1]:
                x = x.at[:, :cls].set(prompts[:, layer].astype(x.dtype))
            x = block(x, mask)
        return self.ln_final(x[:, cls])

    def __call__(
        self,
        features: Mapping[str, jax.Array],
        missing: jax.Array | None = None,
        *,
        prompts: jax.Array | None = None,
        prompt_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Logits ``(b, num_classes)``: ``head(encode(*embed(features, missing), prompts))``."""
        x, key_mask = self.embed(features, missing)
        return self.head(self.encode(x, key_mask, prompts, prompt_mask))
