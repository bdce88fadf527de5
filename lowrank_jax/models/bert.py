"""A Flax linen BERT encoder (post-LN) whose projections are plain 2-D `nn.Dense` kernels.

It reproduces HuggingFace `transformers.BertModel` (absolute positions, exact-erf GELU) and loads
its safetensors weights with `convert_bert_weights`; `lowrank_jax.models.load_minilm` uses it for
the pretrained all-MiniLM-L6-v2.

Parameter paths of `BertEncoder` and the HuggingFace `BertModel` state-dict keys they come from
(i = 0..L-1; a HF `Linear.weight` (m, n) is stored here transposed, as `kernel` (n, m)):

    params/embeddings/word/embedding                      embeddings.word_embeddings.weight
    params/embeddings/position/embedding                  embeddings.position_embeddings.weight
    params/embeddings/token_type/embedding                embeddings.token_type_embeddings.weight
    params/embeddings/ln/{scale,bias}                     embeddings.LayerNorm.{weight,bias}
    params/encoder/layer_i/attention/query/{kernel,bias}  encoder.layer.i.attention.self.query.*
    params/encoder/layer_i/attention/key/{kernel,bias}    encoder.layer.i.attention.self.key.*
    params/encoder/layer_i/attention/value/{kernel,bias}  encoder.layer.i.attention.self.value.*
    params/encoder/layer_i/attention/out/{kernel,bias}    encoder.layer.i.attention.output.dense.*
    params/encoder/layer_i/ln_attention/{scale,bias}      encoder.layer.i.attention.output.LayerNorm.*
    params/encoder/layer_i/mlp/fc1/{kernel,bias}          encoder.layer.i.intermediate.dense.*
    params/encoder/layer_i/mlp/fc2/{kernel,bias}          encoder.layer.i.output.dense.*
    params/encoder/layer_i/ln_mlp/{scale,bias}            encoder.layer.i.output.LayerNorm.*
    params/pooler/dense/{kernel,bias}                     pooler.dense.*
    (a buffer, not a parameter: checked to be arange)     embeddings.position_ids

`BertClassifier` nests the encoder under `bert` (`params/bert/encoder/layer_0/...`), which maps
to the HF names with a `bert.` prefix, as in `BertForSequenceClassification`.
`peft_module_name` / `flax_path_from_peft` translate the kernel paths of the `nn.Dense`
projections (six per layer: query, key, value, out, fc1, fc2; and the pooler) to HF/PEFT module
names and back; PEFT's adapter keys are `base_model.model.<module name>.lora_A.weight` etc.

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
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.models.layers import FeedForward, SelfAttention

__all__ = [
    "BertClassifier",
    "BertConfig",
    "BertEncoder",
    "BertTopClassifier",
    "classifier_variables",
    "convert_bert_weights",
    "flax_path_from_peft",
    "mean_pool",
    "peft_module_name",
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
    `first_layer .. L-1` on them. Parameter paths are `params/layer_i/...` (those of
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


# --------------------------------------------------------------------------------------------
# Names: our kernel paths <-> HuggingFace / PEFT module names.

_PROJECTIONS = {
    "attention/query": "attention.self.query",
    "attention/key": "attention.self.key",
    "attention/value": "attention.self.value",
    "attention/out": "attention.output.dense",
    "mlp/fc1": "intermediate.dense",
    "mlp/fc2": "output.dense",
}
_PROJECTIONS_INV = {v: k for k, v in _PROJECTIONS.items()}
_PATH_RE = re.compile(
    r"^(?:params/)?(?P<prefix>(?:[A-Za-z0-9_]+/)*)"
    r"(?:encoder/layer_(?P<layer>\d+)/(?P<proj>" + "|".join(_PROJECTIONS) + r")"
    r"|(?P<pooler>pooler/dense))/kernel$"
)
_NAME_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>(?:[A-Za-z0-9_]+\.)*?)"
    r"(?:encoder\.layer\.(?P<layer>\d+)\.(?P<proj>"
    + "|".join(re.escape(v) for v in _PROJECTIONS_INV)
    + r")|(?P<pooler>pooler\.dense))$"
)


def peft_module_name(path: str) -> str:
    """HuggingFace/PEFT module name of one of our BERT projection kernels.

    The map (i a layer index; an optional leading `params/` is accepted; any module prefix such
    as `bert/` becomes a dotted prefix `bert.`):

        encoder/layer_i/attention/query/kernel  ->  encoder.layer.i.attention.self.query
        encoder/layer_i/attention/key/kernel    ->  encoder.layer.i.attention.self.key
        encoder/layer_i/attention/value/kernel  ->  encoder.layer.i.attention.self.value
        encoder/layer_i/attention/out/kernel    ->  encoder.layer.i.attention.output.dense
        encoder/layer_i/mlp/fc1/kernel          ->  encoder.layer.i.intermediate.dense
        encoder/layer_i/mlp/fc2/kernel          ->  encoder.layer.i.output.dense
        pooler/dense/kernel                     ->  pooler.dense

    The HF `Linear` weight is `<name>.weight` (m, n), the transpose of our kernel (n, m); PEFT
    LoRA keys are `base_model.model.<name>.lora_A.weight` (r, n) and `...lora_B.weight` (m, r).

    Args:
      path: '/'-joined parameter path of a kernel, e.g.
        `params/encoder/layer_0/attention/query/kernel`.

    Returns:
      The dotted module name, e.g. `encoder.layer.0.attention.self.query`.

    Raises:
      ValueError: if `path` is not the kernel of a BERT projection.
    """
    m = _PATH_RE.match(path)
    if m is None:
        raise ValueError(
            f"{path!r} is not a BERT projection kernel; expected "
            "'[params/][prefix/]encoder/layer_<i>/{attention/{query,key,value,out},"
            "mlp/{fc1,fc2}}/kernel' or '[params/][prefix/]pooler/dense/kernel'."
        )
    prefix = m["prefix"].replace("/", ".")
    if m["pooler"]:
        return f"{prefix}pooler.dense"
    return f"{prefix}encoder.layer.{int(m['layer'])}.{_PROJECTIONS[m['proj']]}"


def flax_path_from_peft(name: str) -> str:
    """Inverse of `peft_module_name`: our '/'-joined kernel path from an HF/PEFT module name.

    A leading `base_model.model.` (PEFT's wrapper prefix) is dropped; the returned path starts
    with `params/` (a path in the variables dict).

    Args:
      name: dotted module name, e.g. `encoder.layer.0.attention.output.dense`.

    Returns:
      e.g. `params/encoder/layer_0/attention/out/kernel`.

    Raises:
      ValueError: if `name` is not the module name of a BERT projection.
    """
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(
            f"{name!r} is not a BERT projection module name; expected "
            "'[prefix.]encoder.layer.<i>.{attention.self.{query,key,value},"
            "attention.output.dense,intermediate.dense,output.dense}' or '[prefix.]pooler.dense'."
        )
    prefix = m["prefix"].replace(".", "/")
    if m["pooler"]:
        return f"params/{prefix}pooler/dense/kernel"
    return f"params/{prefix}encoder/layer_{int(m['layer'])}/{_PROJECTIONS_INV[m['proj']]}/kernel"


# --------------------------------------------------------------------------------------------
# Weights: HuggingFace BertModel safetensors -> linen variables.


def _hf_key_map(config: BertConfig) -> dict[tuple[str, ...], tuple[str, bool]]:
    """Our param path (tuple) -> (HF key, transpose?) for every parameter of `BertEncoder`."""
    table: dict[tuple[str, ...], tuple[str, bool]] = {
        ("embeddings", "word", "embedding"): ("embeddings.word_embeddings.weight", False),
        ("embeddings", "position", "embedding"): ("embeddings.position_embeddings.weight", False),
        ("embeddings", "token_type", "embedding"): (
            "embeddings.token_type_embeddings.weight",
            False,
        ),
        ("embeddings", "ln", "scale"): ("embeddings.LayerNorm.weight", False),
        ("embeddings", "ln", "bias"): ("embeddings.LayerNorm.bias", False),
        ("pooler", "dense", "kernel"): ("pooler.dense.weight", True),
        ("pooler", "dense", "bias"): ("pooler.dense.bias", False),
    }
    for i in range(config.num_hidden_layers):
        layer = ("encoder", f"layer_{i}")
        hf = f"encoder.layer.{i}"
        for ours, theirs in _PROJECTIONS.items():
            table[(*layer, *ours.split("/"), "kernel")] = (f"{hf}.{theirs}.weight", True)
            table[(*layer, *ours.split("/"), "bias")] = (f"{hf}.{theirs}.bias", False)
        for ours, theirs in (
            ("ln_attention", "attention.output.LayerNorm"),
            ("ln_mlp", "output.LayerNorm"),
        ):
            table[(*layer, ours, "scale")] = (f"{hf}.{theirs}.weight", False)
            table[(*layer, ours, "bias")] = (f"{hf}.{theirs}.bias", False)
    return table


def convert_bert_weights(
    tensors: Mapping[str, np.ndarray], config: BertConfig, *, dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Converts a HuggingFace `BertModel` state dict into `BertEncoder` variables.

    Linear weights (m, n) are transposed to kernels (n, m); LayerNorm `weight` becomes `scale`.
    Every tensor must be used: `embeddings.position_ids` (a buffer, not a weight) is checked to
    equal `arange`, every other key must map to exactly one parameter, and every parameter of
    `BertEncoder(config)` must be present with the shape `init` would give it.

    Args:
      tensors: HF key -> array (e.g. `safetensors.numpy.load_file`).
      config: the architecture the weights belong to.
      dtype: dtype of the returned floating-point parameters.

    Returns:
      `{"params": nested dict}` of `dtype` jax arrays, the variables of `BertEncoder(config)`.

    Raises:
      ValueError: on unused tensors, missing tensors, wrong shapes or wrong position_ids.
    """
    remaining = dict(tensors)
    position_ids = remaining.pop("embeddings.position_ids", None)
    if position_ids is not None and not np.array_equal(
        np.asarray(position_ids).reshape(-1), np.arange(np.size(position_ids))
    ):
        raise ValueError("embeddings.position_ids is not arange; these are not BERT weights.")
    expected = jax.eval_shape(
        BertEncoder(config).init,
        jax.random.key(0),
        jnp.zeros((1, 1), jnp.int32),
        jnp.ones((1, 1), jnp.int32),
    )["params"]
    expected_flat = {
        tuple(k.key for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(expected)[0]
    }
    table = _hf_key_map(config)
    if set(table) != set(expected_flat):
        raise AssertionError(
            "internal: BERT key table out of sync with BertEncoder."
        )  # pragma: no cover
    missing = sorted(hf for hf, _ in table.values() if hf not in remaining)
    if missing:
        raise ValueError(f"missing BERT weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    params: dict[str, Any] = {}
    for path, (hf, transpose) in table.items():
        value = np.asarray(remaining.pop(hf))
        if transpose:
            value = value.T
        if value.shape != expected_flat[path]:
            raise ValueError(
                f"{hf} has shape {value.shape}{' (transposed)' if transpose else ''}; "
                f"{'/'.join(path)} needs {expected_flat[path]}. Check the config."
            )
        node = params
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = jnp.asarray(value, dtype=dtype)
    if remaining:
        raise ValueError(
            f"unused tensors (no BertEncoder parameter takes them): {sorted(remaining)[:8]}; "
            "these weights are not a plain BertModel."
        )
    return {"params": params}
