"""The frozen bottom layers of a split BERT encoder, run once over a data set.

When only the top layers of a pretrained encoder are trained (adapters on them, a head above), the
layers below never change: their hidden states can be computed once and become the data set that
:class:`~lowrank_jax.models.bert.BertTopClassifier` reads. :func:`encode_prefix` does that for
unpadded token sequences, chunk by chunk; :func:`prefix_encoder` is the one jitted program it runs.

Example::

  config, variables, tokenizer = load_minilm()
  batch = tokenize(tokenizer, texts, max_len=64)
  full = batch["attention_mask"].all(axis=1)  # keep the passages that need no padding
  hidden = encode_prefix(config, variables, batch["input_ids"][full], first_layer=4)
  _, _, top = split_encoder(config, variables, 4)  # train BertTopClassifier(config, 4, k) on hidden
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.models.bert import BertConfig, BertEncoder, split_encoder

__all__ = ["encode_prefix", "prefix_encoder"]


def prefix_encoder(
    prefix_config: BertConfig,
) -> Callable[[Mapping[str, Any], jax.Array], jax.Array]:
    """The jitted encoder of a split's bottom layers, for sequences without padding.

    Args:
      prefix_config: the first result of :func:`~lowrank_jax.models.bert.split_encoder`.

    Returns:
      ``encode(prefix_variables, input_ids (b, s) int) -> hidden (b, s, d)``:
      ``BertEncoder(prefix_config).apply`` with an all-ones attention mask, jitted.
    """
    encoder = BertEncoder(prefix_config)
    return jax.jit(lambda v, i: encoder.apply(v, i, jnp.ones_like(i)))


def encode_prefix(
    config: BertConfig,
    variables: Mapping[str, Any],
    input_ids: np.ndarray,
    *,
    first_layer: int,
    chunk_size: int = 64,
) -> np.ndarray:
    """Hidden states after layer ``first_layer - 1`` of unpadded token sequences, on the host.

    ``hidden[i] = BertEncoder(prefix_config).apply(prefix_variables, input_ids[i:i+1], 1)[0]``
    with ``(prefix_config, prefix_variables, _) = split_encoder(config, variables, first_layer)``,
    computed in consecutive chunks of ``chunk_size`` rows (the last one may be shorter).

    Args:
      config: the encoder's architecture.
      variables: ``{"params": ...}`` of a ``BertEncoder(config)``.
      input_ids: ``(N, s)`` integer token ids, every position a real token (no padding).
      first_layer: the first layer of the top part, in ``[1, L)``.
      chunk_size: rows per call of the jitted encoder.

    Returns:
      ``(N, s, d)`` hidden states as a NumPy array (the encoder's dtype).

    Raises:
      ValueError: if ``input_ids`` is not a non-empty 2-D integer array, ``chunk_size < 1`` or
        ``first_layer`` is out of range.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"input_ids must be a non-empty (N, s) integer array; got shape {ids.shape} and "
            f"dtype {ids.dtype}."
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}.")
    prefix_config, prefix_variables, _ = split_encoder(config, variables, first_layer)
    encode = prefix_encoder(prefix_config)
    return np.concatenate(
        [
            np.asarray(encode(prefix_variables, ids[i : i + chunk_size]))
            for i in range(0, len(ids), chunk_size)
        ]
    )
