"""A user's checkpoint and data in miniature: a random tiny Llama saved by ``transformers``, a BPE
tokenizer trained with ``tokenizers`` on First Folio text, with a chat template, and JSONL files.

What ``configs/llm_sft.py:smoke`` fine-tunes when no ``--config.checkpoint`` is given, and what
the tests of :mod:`lowrank_jax.data.text` and of the fine-tuning job read (one builder for
both)::

    files = build(directory)   # {"checkpoint": dir, "train": jsonl, "valid": jsonl}

Building takes about two seconds (importing ``torch`` and ``transformers`` most of it) and needs
``transformers`` (the ``peers`` extra). The directory is written once: a second call with the same
arguments reads what is there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lowrank_jax import data

__all__ = [
    "CHAT_TEMPLATE",
    "LLAMA",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build",
    "rows",
    "train_tokenizer",
    "write_checkpoint",
    "write_jsonl",
    "write_tokenizer",
]

# A ChatML-style template (as Qwen2's), rendered by transformers' apply_chat_template.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = {"bos_token": "<|begin|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
_CONTROL = ("<|begin|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# The tiny Llama: LlamaConfig keyword arguments (the vocabulary is the tokenizer's).
LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
VOCAB_SIZE = 512  # the BPE vocabulary, control tokens included
_PLAYS = ("hamlet", "tempest", "macbeth")


def _lines(max_lines: int, seed: int) -> list[str]:
    """Lines of a few plays, in passages of 4 lines, shuffled by ``seed``."""
    ds = data.load_shakespeare(label="play", plays=_PLAYS, passage_lines=4, seed=seed)
    order = np.random.default_rng(seed).permutation(len(ds.x))
    return [line for i in order for line in ds.x[i].split("\n")][:max_lines]


def train_tokenizer(texts: Sequence[str], *, vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` with the control tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_CONTROL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(directory: str, backend: Any, *, chat_template: str = CHAT_TEMPLATE) -> None:
    """Saves ``backend`` with the special tokens and ``chat_template`` by ``transformers``'
    ``PreTrainedTokenizerFast.save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    fast.chat_template = chat_template
    fast.save_pretrained(directory)


def write_checkpoint(directory: str, *, vocab_size: int, seed: int = 0, **ids: int) -> None:
    """A random ``LlamaForCausalLM`` of :data:`LLAMA`'s size, saved by ``save_pretrained``;
    ``ids``: ``bos_token_id``, ``eos_token_id``, ``pad_token_id``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, **LLAMA, **ids)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def rows(lines: Sequence[str]) -> list[dict[str, Any]]:
    """JSONL rows of the three forms, in turn, from consecutive lines of verse: ``{"text"}`` (two
    lines), ``{"prompt", "completion"}`` (a line, the next) and ``{"messages"}`` (a user's line,
    the assistant's next line)."""
    out = []
    for i in range(0, len(lines) - 1, 2):
        a, b = lines[i], lines[i + 1]
        kind = (i // 2) % 3
        if kind == 0:
            out.append({"text": f"{a}\n{b}"})
        elif kind == 1:
            out.append({"prompt": f"{a}\n", "completion": b})
        else:
            out.append(
                {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
            )
    return out


def write_jsonl(path: str, records: Sequence[dict[str, Any]]) -> str:
    """One JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def build(
    directory: str | os.PathLike,
    *,
    train_rows: int = 192,
    valid_rows: int = 48,
    vocab_size: int = VOCAB_SIZE,
    seed: int = 0,
) -> dict[str, str]:
    """Writes (once) a tiny checkpoint with its tokenizer and train/valid JSONL files.

    Args:
      directory: created if missing; ``checkpoint/``, ``train.jsonl`` and ``valid.jsonl`` go in it.
      train_rows, valid_rows: rows of each file (the three forms in turn, from disjoint lines).
      vocab_size: the BPE vocabulary (control tokens included).
      seed: the lines' order and the model's weights.

    Returns:
      ``{"checkpoint", "train", "valid"}`` paths.
    """
    directory = os.fspath(directory)
    out = {
        "checkpoint": os.path.join(directory, "checkpoint"),
        "train": os.path.join(directory, "train.jsonl"),
        "valid": os.path.join(directory, "valid.jsonl"),
    }
    done = os.path.join(directory, "built.json")
    spec = dict(train_rows=train_rows, valid_rows=valid_rows, vocab_size=vocab_size, seed=seed)
    if os.path.isfile(done):
        with open(done) as f:
            if json.load(f) == spec:
                return out
    lines = _lines(2 * (train_rows + valid_rows) + 1, seed)
    backend = train_tokenizer(lines, vocab_size=vocab_size)
    os.makedirs(out["checkpoint"], exist_ok=True)
    write_tokenizer(out["checkpoint"], backend)
    token = {
        k.replace("_token", "_token_id"): backend.token_to_id(v) for k, v in SPECIAL_TOKENS.items()
    }
    write_checkpoint(out["checkpoint"], vocab_size=backend.get_vocab_size(), seed=seed, **token)
    write_jsonl(out["train"], rows(lines[: 2 * train_rows]))
    write_jsonl(out["valid"], rows(lines[2 * train_rows : 2 * (train_rows + valid_rows)]))
    with open(done, "w") as f:
        json.dump(spec, f)
    return out
