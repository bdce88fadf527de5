"""HuggingFace and PEFT names of `BertEncoder`'s parameters: weight conversion and module names.

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
`bert_module_name` / `bert_path_from_module` translate the kernel paths of the `nn.Dense`
projections (six per layer: query, key, value, out, fc1, fc2; and the pooler) to HF/PEFT module
names and back; PEFT's adapter keys are `base_model.model.<module name>.lora_A.weight` etc.

References:
  HuggingFace `transformers.BertModel` (state-dict keys); HuggingFace PEFT (adapter key format).
"""

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.models.bert import BertConfig, BertEncoder

__all__ = ["bert_module_name", "bert_path_from_module", "convert_bert_weights"]


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
# Per-layer modules and model-level modules other than the projections: our path of the module's
# main parameter (kernel, LayerNorm scale, embedding table) and the HF module name.
_LAYER_OTHER = {
    "ln_attention/scale": "attention.output.LayerNorm",
    "ln_mlp/scale": "output.LayerNorm",
}
_TOP = {
    "pooler/dense/kernel": "pooler.dense",
    "embeddings/word/embedding": "embeddings.word_embeddings",
    "embeddings/position/embedding": "embeddings.position_embeddings",
    "embeddings/token_type/embedding": "embeddings.token_type_embeddings",
    "embeddings/ln/scale": "embeddings.LayerNorm",
}
_LAYER = {f"{k}/kernel": v for k, v in _PROJECTIONS.items()} | _LAYER_OTHER
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_PATH_RE = re.compile(
    r"^(?:params/)?(?P<prefix>(?:[A-Za-z0-9_]+/)*?)"
    r"(?:encoder/layer_(?P<layer>\d+)/(?P<proj>" + "|".join(_LAYER) + r")"
    r"|(?P<top>" + "|".join(_TOP) + r"))$"
)
_NAME_RE = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>(?:[A-Za-z0-9_]+\.)*?)"
    r"(?:encoder\.layer\.(?P<layer>\d+)\.(?P<proj>"
    + "|".join(re.escape(v) for v in _LAYER_INV)
    + r")|(?P<top>"
    + "|".join(re.escape(v) for v in _TOP_INV)
    + r"))$"
)


def bert_module_name(path: str) -> str:
    """HuggingFace/PEFT module name of one of our BERT modules, given its main parameter's path.

    The map (i a layer index; an optional leading `params/` is accepted; any module prefix such
    as `bert/` becomes a dotted prefix `bert.`):

        encoder/layer_i/attention/query/kernel  ->  encoder.layer.i.attention.self.query
        encoder/layer_i/attention/key/kernel    ->  encoder.layer.i.attention.self.key
        encoder/layer_i/attention/value/kernel  ->  encoder.layer.i.attention.self.value
        encoder/layer_i/attention/out/kernel    ->  encoder.layer.i.attention.output.dense
        encoder/layer_i/mlp/fc1/kernel          ->  encoder.layer.i.intermediate.dense
        encoder/layer_i/mlp/fc2/kernel          ->  encoder.layer.i.output.dense
        encoder/layer_i/ln_attention/scale      ->  encoder.layer.i.attention.output.LayerNorm
        encoder/layer_i/ln_mlp/scale            ->  encoder.layer.i.output.LayerNorm
        pooler/dense/kernel                     ->  pooler.dense
        embeddings/{word,position,token_type}/embedding -> embeddings.{word,...}_embeddings
        embeddings/ln/scale                     ->  embeddings.LayerNorm

    The embeddings and LayerNorms are named for PEFT's embedding LoRA, ``bias="all"`` and
    ``modules_to_save``. The HF `Linear` weight is `<name>.weight` (m, n), the transpose of our kernel (n, m); PEFT
    LoRA keys are `base_model.model.<name>.lora_A.weight` (r, n) and `...lora_B.weight` (m, r).

    Args:
      path: '/'-joined path of a module's kernel (LayerNorm: scale; embedding: embedding), e.g.
        `params/encoder/layer_0/attention/query/kernel`.

    Returns:
      The dotted module name, e.g. `encoder.layer.0.attention.self.query`.

    Raises:
      ValueError: if `path` is not the kernel of a BERT projection (or another module above).
    """
    m = _PATH_RE.match(path)
    if m is None:
        raise ValueError(
            f"{path!r} is not a BERT projection kernel; expected "
            "'[params/][prefix/]encoder/layer_<i>/{attention/{query,key,value,out},"
            "mlp/{fc1,fc2}}/kernel', '[params/][prefix/]pooler/dense/kernel' or the embedding "
            "table / LayerNorm scale of a BERT module."
        )
    prefix = m["prefix"].replace("/", ".")
    if m["top"]:
        return f"{prefix}{_TOP[m['top']]}"
    return f"{prefix}encoder.layer.{int(m['layer'])}.{_LAYER[m['proj']]}"


def bert_path_from_module(name: str) -> str:
    """Inverse of `bert_module_name`: our '/'-joined path of a module's kernel (LayerNorm: scale;
    embedding: embedding) from an HF/PEFT module name.

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
            "attention.output.dense,intermediate.dense,output.dense}', '[prefix.]pooler.dense', "
            "an embedding or a LayerNorm of BERT."
        )
    prefix = m["prefix"].replace(".", "/")
    if m["top"]:
        return f"params/{prefix}{_TOP_INV[m['top']]}"
    return f"params/{prefix}encoder/layer_{int(m['layer'])}/{_LAYER_INV[m['proj']]}"


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
