r"""Language-model data: a checkpoint's tokenizer and chat template, JSONL rows, packing, loss.

The pieces of a supervised fine-tune of a decoder LLM, usable from your own loop::

    from lowrank_jax import data, models
    from lowrank_jax.data import text

    tok = data.load_tokenizer("llama-dir")              # tokenizer.json + tokenizer_config.json
    examples = data.encode_jsonl(tok, "train.jsonl")    # [Example(tokens, loss_mask), ...]
    batch = data.pack(examples, max_length=512, pad_id=tok.pad_token_id)
    logits = models.DecoderLM(config).apply(
        variables, batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
    )
    total, count = text.next_token_loss(logits, batch["tokens"], batch["loss_mask"])
    print(data.perplexity(total / count))

**Rows** of a JSONL file (one JSON object per line; blank lines are skipped) take one of three
forms; the loss is on the tokens the model should learn to write:

* ``{"text": "..."}``: the tokenizer's special tokens (e.g. BOS), the text, then EOS; loss on
  every token;
* ``{"prompt": "...", "completion": "..."}``: the prompt (with the special tokens), the
  completion, then EOS, each part tokenized on its own; loss on the completion and EOS only;
* ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``: the
  conversation rendered by the checkpoint's chat template (``chat_template.jinja`` or the
  ``chat_template`` of ``tokenizer_config.json``, as ``transformers``' ``apply_chat_template``
  renders it); loss on the assistant turns only: the text inside ``{% generation %}`` blocks when
  the template marks them, else each assistant turn's part of the rendering (the rendering of
  the turns up to it minus that of the turns before it with the generation prompt), which
  includes the template's end-of-turn marker.

A row that fits none of these, or that the template cannot render, raises a ``ValueError`` that
names the file and line.

**Packing** (``pack``) concatenates examples, in order, into rows of ``max_length`` tokens:
``tokens`` (N, L) int32, ``segment_ids`` (N, L) int32 (1, 2, ... per example in a row, 0 for
padding), ``positions`` (N, L) int32 (from 0 in each example) and ``loss_mask`` (N, L) bool:
``loss_mask[i, t]`` says that token ``t`` is a target, predicted from the tokens before it in its
segment (never the first token of a segment, nor padding). ``DecoderLM(...)(tokens,
segment_ids=..., positions=...)`` keeps the segments of a row apart, so a packed row gives each
example the logits it would have alone; ``next_token_loss`` sums the negative log-likelihood of
the targets.

The tokenizer and the chat template are :mod:`lowrank_jax.data.tokenizer`'s.

References:
  Packing with segment ids as in T5 / ``seqio`` and MaxText; the rows' forms as TRL's
  ``SFTTrainer`` reads them (language modelling, prompt-completion, conversational).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lowrank_jax.data.tokenizer import Tokenizer, assistant_spans, check_messages

__all__ = [
    "Example",
    "encode_chat",
    "encode_jsonl",
    "encode_row",
    "next_token_loss",
    "pack",
    "perplexity",
    "read_jsonl",
]


class Example(NamedTuple):
    """One tokenized example.

    Attributes:
      tokens: (n,) int32 token ids.
      loss_mask: (n,) bool, True for the tokens the model is trained to write.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray


# ----------------------------------------------------------------------------------------------
# Conversations.


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> Example:
    """A conversation as token ids with the loss on the assistant turns (see the module doc).

    The rendering is tokenized without added special tokens (the template writes them), as
    ``apply_chat_template(..., tokenize=True)`` does; a token is a target when any of its
    characters lies in an assistant turn.

    Raises:
      ValueError: no template, malformed messages, no assistant message, or a template that
        rewrites earlier turns and marks no ``{% generation %}`` blocks.
    """
    messages = [dict(m) for m in messages]
    check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError('the conversation has no "assistant" message: nothing to train on')
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer.backend.encode(text, add_special_tokens=False)
    mask = np.zeros(len(enc.ids), bool)
    for i, (lo, hi) in enumerate(enc.offsets):
        mask[i] = any(lo < end and hi > start for start, end in spans)
    return Example(np.asarray(enc.ids, np.int32), mask)


# ----------------------------------------------------------------------------------------------
# Rows.

_FORMATS = ({"text"}, {"prompt", "completion"}, {"messages"})


def _check_row(row: Any) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, not {type(row).__name__}")
    keys = set(row)
    form = next((f for f in _FORMATS if f <= keys), None)
    if form is None or any(f <= keys for f in _FORMATS if f is not form):
        raise ValueError(
            f"a row must have exactly one of the keys text, prompt+completion or messages; "
            f"this one has {sorted(keys)}"
        )
    if form == {"messages"}:
        check_messages(row["messages"])
    else:
        for k in sorted(form):
            if not isinstance(row[k], str):
                raise ValueError(f'"{k}" must be a string, not {type(row[k]).__name__}')


def _read_rows(path: str) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of each non-blank line, each row checked."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                _check_row(row)
            except (json.JSONDecodeError, ValueError) as e:
                what = f"not valid JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else e
                raise ValueError(
                    f"{path}:{line_no}: {what}; each line must be one JSON object "
                    '{"text"}, {"prompt", "completion"} or {"messages"}: fix or remove the line.'
                ) from e
            rows.append((line_no, row))
    if not rows:
        raise ValueError(f"{path} has no rows: write one JSON object per line.")
    return rows


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file, each checked to be one of the three forms (module docstring).

    Raises:
      FileNotFoundError: no such file.
      ValueError: a line that is not JSON or not a valid row, as ``<path>:<line>: <what>; <what
        to do>``, or a file without rows.
    """
    return [row for _, row in _read_rows(os.fspath(path))]


def encode_row(tokenizer: Tokenizer, row: Mapping[str, Any]) -> Example:
    """One row (``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages"}``) as an Example.

    Raises:
      ValueError: a row of none of the forms, or one the chat template cannot render.
    """
    _check_row(row)
    eos = tokenizer.eos_token_id
    tail = [eos] if eos is not None else []
    if "messages" in row:
        return encode_chat(tokenizer, row["messages"])
    if "text" in row:
        ids = tokenizer.encode(row["text"])
        ids += tail if ids[-1:] != tail else []
        return Example(np.asarray(ids, np.int32), np.ones(len(ids), bool))
    prompt = tokenizer.encode(row["prompt"])
    if tokenizer.add_eos_token and prompt[-1:] == tail:  # the prompt does not end the sequence
        prompt = prompt[:-1]
    completion = tokenizer.encode(row["completion"], add_special_tokens=False) + tail
    mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(completion), bool)]
    return Example(np.asarray(prompt + completion, np.int32), mask)


def encode_jsonl(tokenizer: Tokenizer, path: str | os.PathLike) -> list[Example]:
    """The rows of a JSONL file as Examples (:func:`read_jsonl`, then :func:`encode_row`).

    Raises:
      ValueError: a bad row, named as ``<path>:<line>: ...`` with what to do.
    """
    path = os.fspath(path)
    out = []
    for line_no, row in _read_rows(path):
        try:
            out.append(encode_row(tokenizer, row))
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: {e}; fix or remove the line.") from e
    return out


# ----------------------------------------------------------------------------------------------
# Packing and the loss.


def pack(examples: Sequence[Example], *, max_length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Packs examples, in order, into rows of ``max_length`` tokens (see the module docstring).

    An example goes into the current row if it fits, else starts a new one; an example longer
    than ``max_length`` is cut to its first ``max_length`` tokens. The first token of each
    segment is not a target (nothing before it in its segment predicts it).

    Args:
      examples: :class:`Example` s (or ``(tokens, loss_mask)`` pairs).
      max_length: L, tokens per row.
      pad_id: the id written at padded positions (masked everywhere).

    Returns:
      ``{"tokens", "segment_ids", "positions"}`` (N, L) int32 and ``"loss_mask"`` (N, L) bool.

    Raises:
      ValueError: ``max_length < 2``, no examples, or an example whose tokens and mask differ
        in length.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2; got {max_length}.")
    if not examples:
        raise ValueError("pack needs at least one example.")
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for tokens, mask in examples:
        tokens, mask = np.asarray(tokens)[:max_length], np.asarray(mask, bool)[:max_length]
        if tokens.shape != mask.shape:
            raise ValueError(f"tokens {tokens.shape} and loss_mask {mask.shape} differ in shape.")
        if not len(tokens):
            continue
        if used + len(tokens) > max_length:
            rows.append([])
            used = 0
        rows[-1].append((tokens, mask))
        used += len(tokens)
    shape = (len(rows), max_length)
    out = {
        "tokens": np.full(shape, pad_id, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, bool),
    }
    for i, row in enumerate(rows):
        at = 0
        for seg, (tokens, mask) in enumerate(row, 1):
            n = len(tokens)
            out["tokens"][i, at : at + n] = tokens
            out["segment_ids"][i, at : at + n] = seg
            out["positions"][i, at : at + n] = np.arange(n)
            out["loss_mask"][i, at + 1 : at + n] = mask[1:]
            at += n
    return out


def next_token_loss(
    logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed next-token negative log-likelihood of the targets, and their count.

    ``total = Σ_{t ≥ 1} loss_mask[t] · −log softmax(logits[t-1])[tokens[t]]``; the mean loss is
    ``total / count`` (a batch's sums add up over a validation set).

    Args:
      logits: (b, L, V) logits of ``tokens``.
      tokens: (b, L) token ids.
      loss_mask: (b, L) targets (from :func:`pack`).

    Returns:
      ``(total, count)``, float32 scalars.
    """
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    )
    weight = loss_mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * weight), jnp.sum(weight)


def perplexity(mean_loss: float) -> float:
    """``exp(mean_loss)``: the perplexity per target token of a mean next-token loss (nats)."""
    return math.exp(float(mean_loss))
