r"""A Hugging Face checkpoint's tokenizer and chat template, without ``transformers``.

``load_tokenizer(directory)`` reads ``tokenizer.json`` (through ``tokenizers``), the named special
tokens and ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json`` and
``special_tokens_map.json``, and the chat template (``chat_template.jinja``, as ``transformers`` 5
saves it, or the ``chat_template`` of ``tokenizer_config.json``). ``apply_chat_template`` renders a
conversation as ``transformers``' ``apply_chat_template(..., tokenize=False)`` does (the same
sandboxed Jinja environment and variables), and ``assistant_spans`` finds the characters the
assistant writes, for the loss masks of :mod:`lowrank_jax.data.text`.

References:
  Hugging Face ``tokenizers`` (``tokenizer.json``) and ``transformers``
  (``PreTrainedTokenizerBase.apply_chat_template``: the Jinja environment, its ``tojson``,
  ``raise_exception`` and ``strftime_now``, the ``{% generation %}`` tag).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "SPECIAL_TOKENS",
    "Tokenizer",
    "apply_chat_template",
    "assistant_spans",
    "check_messages",
    "load_tokenizer",
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


def check_messages(messages: Any) -> None:
    """Raises a ``ValueError`` saying what is wrong unless ``messages`` is a non-empty list of
    ``{"role": str, "content": str}`` objects."""
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
    check_messages(messages)
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


def assistant_spans(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of ``messages`` and the ``(start, end)`` character spans of what the
    assistant writes: the ``{% generation %}`` blocks when the template marks them, else each
    assistant turn's part of the rendering (the rendering up to it minus that of the turns
    before it with the generation prompt).

    Raises:
      ValueError: no template, malformed messages, or a template that rewrites earlier turns
        and marks no ``{% generation %}`` blocks.
    """
    messages = [dict(m) for m in messages]
    check_messages(messages)
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
