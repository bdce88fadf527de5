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

References:
  Hugging Face ``tokenizers`` (``tokenizer.json``) and ``transformers``
  (``PreTrainedTokenizerBase.apply_chat_template``: the Jinja environment, its ``tojson``,
  ``raise_exception`` and ``strftime_now``, the ``{% generation %}`` tag); packing with segment
  ids as in T5 / ``seqio`` and MaxText.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "SPECIAL_TOKENS",
    "Example",
    "Tokenizer",
    "apply_chat_template",
    "encode_chat",
    "encode_jsonl",
    "encode_row",
    "load_tokenizer",
    "next_token_loss",
    "pack",
    "perplexity",
    "read_jsonl",
]

# The named special tokens of a Hugging Face tokenizer (passed to chat templates by name).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Private-use characters that mark `{% generation %}` blocks in a rendering (then removed).
_GEN_OPEN, _GEN_CLOSE = "\ue000", "\ue001"


class Example(NamedTuple):
    """One tokenized example.

    Attributes:
      tokens: (n,) int32 token ids.
      loss_mask: (n,) bool, True for the tokens the model is trained to write.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}): repair or re-save it."
        ) from e
    if not isinstance(out, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return out


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> Any:
    """The chat template compiled in the Jinja environment `transformers` renders it in."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a requirement
        raise ImportError("chat templates need jinja2: pip install 'jinja2>=3.1.6'") from e

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: marks the text the model writes."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _GEN_OPEN + caller() + _GEN_CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno}).") from e


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A Hugging Face checkpoint's tokenizer: ``tokenizer.json``, special tokens, chat template.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
      special_tokens: ``{"bos_token": "<s>", "eos_token": ..., ...}``, the named special tokens
        that are set (see ``SPECIAL_TOKENS``).
      chat_template: the Jinja chat template, or None.
      add_bos_token, add_eos_token: ``tokenizer_config.json``'s flags: ``encode`` with special
        tokens adds BOS / EOS when ``tokenizer.json``'s post-processor has not.
    """

    backend: Any
    special_tokens: Mapping[str, str]
    chat_template: str | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    _template: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, token in self.special_tokens.items():
            if self.backend.token_to_id(token) is None:
                raise ValueError(
                    f"the {name} {token!r} is not in the tokenizer's vocabulary: fix "
                    "tokenizer_config.json / special_tokens_map.json or tokenizer.json."
                )
        if self.chat_template is not None and self._template is None:
            object.__setattr__(self, "_template", _compile_template(self.chat_template))

    def token_id(self, name: str) -> int | None:
        """The id of a named special token (``"eos_token"``), or None when it is not set."""
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def pad_token_id(self) -> int:
        """The pad token's id; else EOS's; else 0 (padding is masked, so any id will do)."""
        for name in ("pad_token", "eos_token"):
            if (i := self.token_id(name)) is not None:
                return i
        return 0

    @property
    def vocab_size(self) -> int:
        """Ids are ``< vocab_size`` (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with the post-processor's special tokens (and the config's
        BOS/EOS flags) unless ``add_special_tokens=False``, as ``transformers`` encodes."""
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and ids[:1] != [bos]:
                ids.insert(0, bos)
            if self.add_eos_token and eos is not None and ids[-1:] != [eos]:
                ids.append(eos)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens dropped by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (no ``transformers`` needed).

    Reads ``tokenizer.json`` (with ``tokenizers``), the special tokens and ``add_bos_token`` /
    ``add_eos_token`` of ``tokenizer_config.json`` and ``special_tokens_map.json`` (the latter
    wins, as in ``transformers``), and the chat template: ``chat_template.jinja`` (as
    ``transformers`` 5 saves it) or the ``chat_template`` of ``tokenizer_config.json`` (a string,
    or a list of ``{"name", "template"}`` of which ``"default"`` is taken).

    Args:
      directory: a ``save_pretrained`` directory of a tokenizer (or of a model with its tokenizer).

    Returns:
      A :class:`Tokenizer`.

    Raises:
      FileNotFoundError: no ``tokenizer.json`` (a slow, sentencepiece-only tokenizer: convert it
        with ``AutoTokenizer.from_pretrained(dir).save_pretrained(dir)``).
      ValueError: a file that is not valid JSON, a special token not in the vocabulary, or a chat
        template that does not parse.

    Example:
      >>> tok = load_tokenizer("llama-dir")  # doctest: +SKIP
      >>> tok.decode(tok.encode("Hello"))  # doctest: +SKIP
      'Hello'
    """
    from tokenizers import Tokenizer as Backend

    directory = os.fspath(directory)
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory} has no tokenizer.json; a slow (sentencepiece) tokenizer can be converted "
            "with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)."
        )
    try:
        backend = Backend.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"{path} cannot be read ({e}): repair or re-save it.") from e
    config: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(directory, name)):
            config.update(_read_json(os.path.join(directory, name)))
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_content(config.get(k))) is not None}
    template = config.get("chat_template")
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            template = f.read()
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory}: the chat_template must be a string.")
    return Tokenizer(
        backend,
        special,
        chat_template=template,
        add_bos_token=bool(config.get("add_bos_token", False)),
        add_eos_token=bool(config.get("add_eos_token", False)),
    )


# ----------------------------------------------------------------------------------------------
# Chat templates.


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f'message {i} must be an object with a string "role"')
        if not isinstance(m.get("content"), str):
            raise ValueError(f'message {i} ({m["role"]}) must have a string "content"')


def _render(tokenizer: Tokenizer, messages: list, add_generation_prompt: bool) -> str:
    if tokenizer._template is None:
        raise ValueError(
            "the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json's "
            'chat_template): use {"text"} or {"prompt", "completion"} rows, or add a template.'
        )
    try:
        return tokenizer._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **tokenizer.special_tokens,
        )
    except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from e


def apply_chat_template(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]], *, add_generation_prompt=False
) -> str:
    """The conversation rendered by the tokenizer's chat template, as ``transformers`` renders it.

    Equals ``AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``: the same Jinja environment (sandboxed, ``trim_blocks``,
    ``lstrip_blocks``, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``) and
    variables (``messages``, ``add_generation_prompt`` and the named special tokens).

    Args:
      tokenizer: from :func:`load_tokenizer`.
      messages: ``[{"role": "user", "content": "..."}, ...]``.
      add_generation_prompt: end with the template's cue for the assistant's reply.

    Returns:
      The rendered text (with ``{% generation %}`` blocks unmarked).

    Raises:
      ValueError: no template, malformed messages, or the template raised.
    """
    messages = [dict(m) for m in messages]
    _check_messages(messages)
    text = _render(tokenizer, messages, add_generation_prompt)
    return text.replace(_GEN_OPEN, "").replace(_GEN_CLOSE, "")


def _generation_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without generation markers, and the (start, end) of each marked block."""
    out, spans, start, n = [], [], None, 0
    for ch in marked:
        if ch == _GEN_OPEN:
            start = n
        elif ch == _GEN_CLOSE:
            spans.append((start, n))
        else:
            out.append(ch)
            n += 1
    return "".join(out), spans


def _assistant_spans(tokenizer: Tokenizer, messages: list) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of ``messages`` and the character spans of its assistant turns."""
    marked = _render(tokenizer, messages, False)
    if _GEN_OPEN in marked:
        return _generation_spans(marked)
    text, spans = marked, []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(
                "the chat template does not render each turn as a prefix of the whole "
                "conversation (it rewrites earlier turns), so the assistant turns cannot be "
                "found: mark them with {% generation %}...{% endgeneration %} in the template."
            )
        spans.append((len(before), len(upto)))
    return text, spans


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
    _check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError('the conversation has no "assistant" message: nothing to train on')
    text, spans = _assistant_spans(tokenizer, messages)
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
        _check_messages(row["messages"])
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
