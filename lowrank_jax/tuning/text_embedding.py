"""Candidate embeddings from a frozen language model (LoRA-BO's discrete→continuous map).

Each candidate's text ``t(c) = prompt + " " + description(c)`` goes once through the frozen
all-MiniLM-L6-v2 encoder (a 6-layer BERT, :func:`lowrank_jax.models.load_minilm`). Two things are
kept per candidate:

* the sentence embedding (mean pool over all tokens, L2-normalised: the model's own pooling),
  reduced to its top ``pca_dim`` principal components over the candidate set and standardised:
  the fixed features ``f(c)``;
* the last-layer states of the description's word pieces (the tokens after the prompt), reduced
  to their top ``token_dim`` principal components: the states that the learnable residual token
  of :mod:`lowrank_jax.tuning.bo` attends over.

References:
  P15 LoRA-BO (arXiv 2602.11171). Reconstruction (specs §15): the paper feeds the learnable token
  through a (larger, decoder) LLM; here the frozen encoder runs once, offline, and the token reads
  its cached states afterwards (the spec's cheaper variant). Reimers & Gurevych 2019 (the
  MiniLM sentence encoder and its mean pooling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax import models
from lowrank_jax.models.bert import sentence_embedding
from lowrank_jax.tuning.bo import CandidateEmbedding
from lowrank_jax.tuning.lora_space import standardize_features

__all__ = ["embedding_from_states", "encode_texts", "minilm_embedding", "principal_components"]


def principal_components(x: np.ndarray, k: int) -> np.ndarray:
    """The projection of the rows of ``x`` (``(n, d)``) on their top ``min(k, n, d)`` principal
    directions (centered; float64 SVD), ``(n, min(k, n, d))``."""
    x = np.asarray(x, np.float64)
    xc = x - x.mean(0)
    _, _, vt = np.linalg.svd(xc, full_matrices=False)
    return xc @ vt[:k].T


def encode_texts(
    texts: Sequence[str],
    *,
    prompt: str = "",
    max_len: int = 96,
    batch_size: int = 64,
    minilm: tuple[Any, Any, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs the frozen MiniLM on ``prompt + " " + text`` for every text.

    Args:
      texts: ``c`` candidate descriptions.
      prompt: the shared domain prompt (may be empty).
      max_len: token length of the batch; must hold ``[CLS] prompt text [SEP]`` for every text.
      batch_size: texts per forward pass.
      minilm: ``(config, variables, tokenizer)`` from :func:`lowrank_jax.models.load_minilm`
        (None: load it).

    Returns:
      ``(sentence, tokens, mask)``: ``(c, 384)`` L2-normalised mean-pooled embeddings, ``(c, t,
      384)`` last-layer states of each description's word pieces (``t`` the longest description),
      ``(c, t)`` bool mask of real pieces.

    Raises:
      TypeError: ``texts`` is a string or holds non-strings.
      ValueError: a text does not fit in ``max_len`` tokens.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts) or not texts:
        raise TypeError("texts must be a non-empty sequence of strings.")
    config, variables, tokenizer = models.load_minilm() if minilm is None else minilm
    import tokenizers

    counter = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # unpadded, untruncated copy
    counter.no_padding()
    counter.no_truncation()
    n_prompt = len(counter.encode(prompt, add_special_tokens=False).ids) if prompt else 0
    lengths = [len(counter.encode(t, add_special_tokens=False).ids) for t in texts]
    need = n_prompt + max(lengths) + 2
    if need > max_len:
        raise ValueError(f"prompt + longest text need {need} tokens > max_len={max_len}; raise it.")
    full = [f"{prompt} {t}" if prompt else t for t in texts]
    encoder = models.BertEncoder(config)

    @jax.jit
    def forward(variables, ids, mask):  # weights as an argument, not folded as constants
        hidden = encoder.apply(variables, ids, mask)
        return sentence_embedding(hidden, mask), hidden

    t_max = max(lengths)
    sentence, tokens = [], []
    for s in range(0, len(full), batch_size):
        batch = models.tokenize(tokenizer, full[s : s + batch_size], max_len=max_len)
        real = len(batch["input_ids"])
        if real < batch_size and len(full) > batch_size:  # pad the last batch: one compilation
            batch = {k: np.pad(v, ((0, batch_size - real), (0, 0))) for k, v in batch.items()}
        emb, hidden = forward(
            variables, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
        )
        sentence.append(np.asarray(emb)[:real])
        start = 1 + n_prompt  # after [CLS] and the prompt's pieces
        tokens.append(np.asarray(hidden)[:real, start : start + t_max])
    mask = np.arange(t_max)[None, :] < np.asarray(lengths)[:, None]
    return np.concatenate(sentence), np.concatenate(tokens), mask


def minilm_embedding(
    texts: Sequence[str],
    *,
    prompt: str = "",
    pca_dim: int = 16,
    token_dim: int = 16,
    max_len: int = 96,
    batch_size: int = 64,
    minilm: tuple[Any, Any, Any] | None = None,
) -> CandidateEmbedding:
    """The LoRA-BO embedding of candidate texts: fixed MiniLM features plus token states.

    Args:
      texts, prompt, max_len, batch_size, minilm: as :func:`encode_texts`.
      pca_dim: ``p``, principal components kept of the sentence embeddings (standardised).
      token_dim: ``k``, principal components kept of the description's token states (scaled to
        unit average variance per component).

    Returns:
      :class:`lowrank_jax.tuning.CandidateEmbedding` with ``features (c, p)``, ``tokens (c, t, k)``
      and ``token_mask (c, t)``.

    Raises:
      ValueError: ``pca_dim`` or ``token_dim`` < 1, or a text too long (see :func:`encode_texts`).
    """
    if pca_dim < 1 or token_dim < 1:
        raise ValueError(f"pca_dim and token_dim must be >= 1; got {pca_dim}, {token_dim}.")
    sentence, tokens, mask = encode_texts(
        texts, prompt=prompt, max_len=max_len, batch_size=batch_size, minilm=minilm
    )
    return embedding_from_states(sentence, tokens, mask, pca_dim=pca_dim, token_dim=token_dim)


def embedding_from_states(
    sentence: np.ndarray, tokens: np.ndarray, mask: np.ndarray, *, pca_dim: int, token_dim: int
) -> CandidateEmbedding:
    """:func:`minilm_embedding` from the cached outputs of :func:`encode_texts`."""
    features = standardize_features(principal_components(sentence, pca_dim))
    c, t, d = tokens.shape
    real = np.asarray(mask, bool).reshape(-1)
    flat = np.asarray(tokens, np.float64).reshape(-1, d)
    mu = flat[real].mean(0)
    _, _, vt = np.linalg.svd(flat[real] - mu, full_matrices=False)
    proj = (flat - mu) @ vt[:token_dim].T
    proj = proj / np.sqrt(np.mean(proj[real] ** 2) + 1e-12)
    proj = np.where(real[:, None], proj, 0.0).reshape(c, t, -1).astype(np.float32)
    return CandidateEmbedding(jnp.asarray(features), jnp.asarray(proj), jnp.asarray(mask, bool))
