"""A Flax linen BERT encoder (post-LN) whose projections are plain 2-D `nn.Dense` kernels.

It reproduces HuggingFace `transformers.BertModel` (absolute positions, exact-erf GELU) and loads
its safetensors weights with `hf_bert.convert_bert_weights`; `lowrank_jax.models.load_minilm` uses it for
the pretrained all-MiniLM-L6-v2.

Its parameter paths, the HuggingFace `BertModel` state-dict keys they come from, and the HF/PEFT
module names of the projections are in `lowrank_jax.models.hf_bert` (`convert_bert_weights`,
`bert_module_name`, `bert_path_from_module`).

References:
  Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
  Understanding", NAACL 2019. Wang et al., "MiniLM: Deep Self-Attention Distillation for
  Task-Agnostic Compression of Pre-Trained Transformers", NeurIPS 2020. Reimers & Gurevych,
  "Sentence-BERT", EMNLP 2019 (mean pooling + L2 normalisation of all-MiniLM-L6-v2).
"""

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrank_jax.models.layers import FeedForward, SelfAttention

__all__ = [
    "BertClassifier",
    "BertConfig",
    "BertEncoder",
    "BertTopClassifier",
    "attention_inputs",
    "classifier_variables",
    "mean_pool",
    "sentence_embedding",
    "split_encoder",
]

_ACTIVATIONS = {
    "gelu": functools.partial(nn.gelu, approximate=False),  # HF "gelu" is the exact erf GELU.
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture of a BERT encoder (the fields of a HuggingFace `config.json` that matter).

    Defaults are those of all-MiniLM-L6-v2 (d = 384, 6 layers, 12 heads, MLP 1536).
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}."
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}."
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "BertConfig":
        """Builds a config from a HuggingFace `config.json` dict (unknown keys are ignored).

        Raises:
          ValueError: if the dict describes something other than an absolute-position BERT.
        """
        model_type = config.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"expected model_type 'bert'; got {model_type!r}.")
        position = config.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"only absolute position embeddings are supported; got {position!r}.")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "BertConfig":
        """Reads a HuggingFace `config.json`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _dense(features: int, config: BertConfig, dtype: Any, name: str) -> nn.Dense:
    init = nn.initializers.normal(stddev=config.initializer_range)
    return nn.Dense(features, kernel_init=init, dtype=dtype, name=name)


def _layer_norm(config: BertConfig, dtype: Any, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, name=name)


class _BertEmbeddings(nn.Module):
    config: BertConfig
    dtype: Any = None

    @nn.compact
    def __call__(
        self, input_ids: jax.Array, token_type_ids: jax.Array, *, deterministic: bool
    ) -> jax.Array:
        c = self.config
        init = nn.initializers.normal(stddev=c.initializer_range)

        def embed(n: int, name: str) -> nn.Embed:
            return nn.Embed(n, c.hidden_size, embedding_init=init, dtype=self.dtype, name=name)

        positions = jnp.arange(input_ids.shape[1])[None, :]
        x = (
            embed(c.vocab_size, "word")(input_ids)
            + embed(c.type_vocab_size, "token_type")(token_type_ids)
            + embed(c.max_position_embeddings, "position")(positions)
        )
        x = _layer_norm(c, self.dtype, "ln")(x)
        return nn.Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)


class _BertLayer(nn.Module):
    config: BertConfig
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        c = self.config
        drop = nn.Dropout(c.hidden_dropout_prob, deterministic=deterministic)
        init = nn.initializers.normal(stddev=c.initializer_range)
        y = SelfAttention(
            c.num_attention_heads,
            dropout_rate=c.attention_probs_dropout_prob,
            kernel_init=init,
            dtype=self.dtype,
            name="attention",
        )(x, mask, deterministic=deterministic)
        x = _layer_norm(c, self.dtype, "ln_attention")(x + drop(y))
        y = FeedForward(
            c.intermediate_size,
            activation=_ACTIVATIONS[c.hidden_act],
            kernel_init=init,
            dtype=self.dtype,
            name="mlp",
        )(x)
        return _layer_norm(c, self.dtype, "ln_mlp")(x + drop(y))


class _BertStack(nn.Module):
    config: BertConfig
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool) -> jax.Array:
        for i in range(self.config.num_hidden_layers):
            x = _BertLayer(self.config, self.dtype, name=f"layer_{i}")(
                x, mask, deterministic=deterministic
            )
        return x


class _BertPooler(nn.Module):
    config: BertConfig
    dtype: Any = None

    @nn.compact
    def __call__(self, first_token: jax.Array) -> jax.Array:
        return jnp.tanh(
            _dense(self.config.hidden_size, self.config, self.dtype, "dense")(first_token)
        )


class BertEncoder(nn.Module):
    """BERT encoder: embeddings, L post-LN transformer layers, and the (unused by default) pooler.

    Each layer computes, with x (b, t, d) and additive padding mask on the keys,

        x = LN(x + drop(attention(x)))          attention: query/key/value/out, 2-D kernels (d, d)
        x = LN(x + drop(fc2(gelu(fc1(x)))))     fc1 (d, mlp), fc2 (mlp, d)

    The pooler (`tanh(dense(hidden[:, 0]))`, HF's `pooler_output`) is not used by `__call__`; it
    exists so that every pretrained weight has a parameter (`pooled_output` computes it). Its
    parameters are created by `init`.

    Attributes:
      config: the architecture.
      dtype: computation dtype (None: inferred from inputs and params).

    Example:
      >>> config, variables, tokenizer = load_minilm()  # doctest: +SKIP
      >>> batch = tokenize(tokenizer, ["a sentence"])  # doctest: +SKIP
      >>> hidden = BertEncoder(config).apply(variables, **batch)  # doctest: +SKIP
      >>> emb = sentence_embedding(hidden, batch["attention_mask"])  # (1, 384)  # doctest: +SKIP
    """

    config: BertConfig
    dtype: Any = None

    def setup(self) -> None:
        self.embeddings = _BertEmbeddings(self.config, self.dtype)
        self.encoder = _BertStack(self.config, self.dtype)
        self.pooler = _BertPooler(self.config, self.dtype)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Encodes a padded batch of token ids.

        Args:
          input_ids: (b, t) integer token ids, t <= max_position_embeddings.
          attention_mask: (b, t), 1 for real tokens and 0 for padding.
          token_type_ids: optional (b, t) segment ids (default all 0).
          deterministic: disables dropout when True; otherwise needs a `dropout` rng.

        Returns:
          (b, t, d) last hidden states (HF's `last_hidden_state`).

        Raises:
          ValueError: on mismatched or wrongly typed inputs, or t > max_position_embeddings.
        """
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids must be integer (b, t); got {input_ids.dtype} {input_ids.shape}."
            )
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {attention_mask.shape} must have the shape of input_ids "
                f"{input_ids.shape}."
            )
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}; truncate the inputs."
            )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids, deterministic=deterministic)
        mask = (attention_mask > 0)[:, None, None, :]  # (b, 1, 1, t): keys that may be attended
        x = self.encoder(x, mask, deterministic=deterministic)
        if self.is_initializing():
            self.pooler(x[:, 0])
        return x

    def pooled_output(self, hidden: jax.Array) -> jax.Array:
        """HF `pooler_output`: `tanh(hidden[:, 0] W + b)`, (b, t, d) -> (b, d).

        Call as `model.apply(variables, hidden, method="pooled_output")`.
        """
        return self.pooler(hidden[:, 0])


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean of the hidden states over the non-padding tokens.

        pooled[b] = sum_t mask[b, t] hidden[b, t] / max(sum_t mask[b, t], 1e-9)

    Args:
      hidden: (b, t, d) hidden states.
      attention_mask: (b, t), 1 for real tokens and 0 for padding.

    Returns:
      (b, d) pooled features (the dtype of `hidden`).

    Raises:
      ValueError: if the shapes do not match.
    """
    if hidden.ndim != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden (b, t, d) and attention_mask (b, t); got {hidden.shape} and "
            f"{attention_mask.shape}."
        )
    mask = attention_mask.astype(hidden.dtype)[..., None]
    total = jnp.sum(hidden * mask, axis=1)
    count = jnp.maximum(jnp.sum(mask, axis=1), 1e-9)
    return total / count


def sentence_embedding(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Sentence-transformers embedding: mean pooling, then L2 normalisation.

        e[b] = p[b] / max(||p[b]||_2, 1e-12),   p = mean_pool(hidden, attention_mask)

    This is the all-MiniLM-L6-v2 pipeline (Transformer -> Pooling(mean) -> Normalize).

    Args:
      hidden: (b, t, d) hidden states.
      attention_mask: (b, t), 1 for real tokens and 0 for padding.

    Returns:
      (b, d) unit-norm embeddings.
    """
    pooled = mean_pool(hidden, attention_mask)
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)


class BertClassifier(nn.Module):
    """BERT encoder (`bert`), mean pooling, dropout and a linear classifier `head`.

    Parameter paths: `params/bert/...` (those of `BertEncoder`, see the module docstring) and
    `params/head/{kernel (d, num_classes), bias}`. Build its variables from pretrained encoder
    variables with `classifier_variables`.

    Attributes:
      config: encoder architecture.
      num_classes: number of classes.
      dtype: computation dtype (None: inferred from inputs and params).
    """

    config: BertConfig
    num_classes: int
    dtype: Any = None

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Maps (b, t) token ids and mask to logits (b, num_classes); see `BertEncoder`."""
        hidden = BertEncoder(self.config, self.dtype, name="bert")(
            input_ids, attention_mask, token_type_ids, deterministic=deterministic
        )
        pooled = mean_pool(hidden, attention_mask)
        pooled = nn.Dropout(self.config.hidden_dropout_prob)(pooled, deterministic=deterministic)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(pooled)


class BertTopClassifier(nn.Module):
    """The top layers of a BERT encoder, mean pooling and a linear `head`, on hidden states.

    For training adapters on the top of a frozen encoder: the bottom layers run once (the
    "prefix" of `split_encoder`) and their hidden states are cached; this module runs layers
    `first_layer..L-1` on them. Parameter paths are `params/layer_i/...` (those of
    `params/encoder/layer_i/...` in `BertEncoder`) and `params/head/{kernel, bias}`.

        logits = head(mean_pool(layer_{L-1}(... layer_{first_layer}(hidden))))

    Attributes:
      config: the full encoder's architecture (`num_hidden_layers` = L).
      first_layer: index of the first layer run here, in `[0, L)`.
      num_classes: number of classes.
      dtype: computation dtype (None: inferred from inputs and params).
    """

    config: BertConfig
    first_layer: int
    num_classes: int
    dtype: Any = None

    @nn.compact
    def __call__(
        self,
        hidden: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        deterministic: bool = True,
    ) -> jax.Array:
        """Maps hidden states (b, t, d) of layer `first_layer - 1` to logits (b, num_classes).

        Args:
          hidden: (b, t, d) hidden states (the output of the prefix encoder).
          attention_mask: optional (b, t), 1 for real tokens and 0 for padding (default: all 1).
          deterministic: disables dropout when True.

        Raises:
          ValueError: if `hidden` is not (b, t, hidden_size) or `first_layer` is out of range.
        """
        c = self.config
        if not 0 <= self.first_layer < c.num_hidden_layers:
            raise ValueError(
                f"first_layer={self.first_layer} must lie in [0, {c.num_hidden_layers})."
            )
        if hidden.ndim != 3 or hidden.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden must be (b, t, {c.hidden_size}); got {hidden.shape}.")
        if attention_mask is None:
            attention_mask = jnp.ones(hidden.shape[:2], jnp.int32)
        mask = (attention_mask > 0)[:, None, None, :]
        for i in range(self.first_layer, c.num_hidden_layers):
            hidden = _BertLayer(c, self.dtype, name=f"layer_{i}")(
                hidden, mask, deterministic=deterministic
            )
        pooled = mean_pool(hidden, attention_mask)
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(pooled)


def split_encoder(
    config: BertConfig, variables: Mapping[str, Any], first_layer: int
) -> tuple[BertConfig, dict[str, Any], dict[str, Any]]:
    """Splits a pretrained encoder into a frozen prefix and the top layers.

    Args:
      config: the encoder's architecture.
      variables: `{"params": ...}` of a `BertEncoder(config)`.
      first_layer: the first layer of the top part, in `[1, L)`.

    Returns:
      `(prefix_config, prefix_variables, top_params)`: `BertEncoder(prefix_config)` with
      `prefix_variables` computes the hidden states after layer `first_layer - 1` (embeddings and
      layers `0 .. first_layer-1`); `top_params` is `{"layer_i": ...}` for `i >= first_layer`,
      the body of a `BertTopClassifier`'s params (add a `head`).

    Raises:
      ValueError: if `first_layer` is out of range.
    """
    n = config.num_hidden_layers
    if not 1 <= first_layer < n:
        raise ValueError(f"first_layer={first_layer} must lie in [1, {n}) for {n} layers.")
    params = variables["params"]
    layers = params["encoder"]
    prefix = {
        **params,
        "encoder": {f"layer_{i}": layers[f"layer_{i}"] for i in range(first_layer)},
    }
    top = {f"layer_{i}": layers[f"layer_{i}"] for i in range(first_layer, n)}
    return dataclasses.replace(config, num_hidden_layers=first_layer), {"params": prefix}, top


def attention_inputs(
    config: BertConfig,
    variables: Mapping[str, Any],
    input_ids: jax.Array,
    attention_mask: jax.Array,
) -> list[tuple[jax.Array, dict[str, Any], dict[str, Any]]]:
    """What each attention layer of a `BertEncoder` sees: its input and where that came from.

    BERT is post-LN: layer 0's input is the embedding LayerNorm's output, layer `i > 0`'s the
    output LayerNorm (`ln_mlp`) of layer `i - 1`.

    Args:
      config: the architecture.
      variables: `{"params": ...}` of `BertEncoder(config)`.
      input_ids: `(b, t)` token ids.
      attention_mask: `(b, t)`, 1 on real tokens.

    Returns:
      One `(x (b, t, d), norm params {"scale", "bias"}, attention params)` per layer.
    """
    _, state = BertEncoder(config).apply(
        variables, input_ids, attention_mask, capture_intermediates=True, mutable=["intermediates"]
    )
    inter, params = state["intermediates"], variables["params"]
    layers = [params["encoder"][f"layer_{i}"] for i in range(config.num_hidden_layers)]
    inputs = [inter["embeddings"]["__call__"][0]]
    inputs += [inter["encoder"][f"layer_{i}"]["__call__"][0] for i in range(len(layers) - 1)]
    norms = [params["embeddings"]["ln"]] + [layer["ln_mlp"] for layer in layers[:-1]]
    return [(x, ln, layer["attention"]) for x, ln, layer in zip(inputs, norms, layers, strict=True)]


def classifier_variables(
    key: jax.Array, encoder_variables: Mapping[str, Any], *, num_classes: int
) -> dict[str, Any]:
    """Variables of a `BertClassifier` from pretrained `BertEncoder` variables and a fresh head.

    The head is initialised as `BertClassifier.init` would (LeCun-normal kernel, zero bias), in
    the dtype of the encoder's word embeddings.

    Args:
      key: PRNG key for the head.
      encoder_variables: `{"params": ...}` of a `BertEncoder` (e.g. from `load_minilm`).
      num_classes: number of classes.

    Returns:
      `{"params": {"bert": encoder params, "head": {"kernel": (d, num_classes), "bias": ...}}}`.

    Raises:
      ValueError: if `num_classes < 1` or the variables do not look like a `BertEncoder`'s.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1; got {num_classes}.")
    try:
        word = encoder_variables["params"]["embeddings"]["word"]["embedding"]
    except (KeyError, TypeError) as e:
        raise ValueError(
            "encoder_variables must be the {'params': ...} dict of a BertEncoder "
            "(params/embeddings/word/embedding missing)."
        ) from e
    d = word.shape[1]
    head = nn.Dense(num_classes, param_dtype=word.dtype).init(key, jnp.zeros((1, d), word.dtype))
    return {"params": {"bert": encoder_variables["params"], "head": head["params"]}}
