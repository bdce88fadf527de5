"""A jit-compiled KV-cache sampler for `DecoderLM`: greedy or temperature sampling.

One call compiles one program: a prefill of the (left-padded) prompt into an explicit `KVCache`
of `prompt_length + max_new_tokens` slots, then a `lax.scan` of one-token decode steps. Rows that
emit an end-of-sequence token continue with `pad_token_id`, as Hugging Face `generate` pads
finished rows (it stops early when all rows are done; this sampler always returns
`max_new_tokens` columns).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrank_jax.models.decoder import DecoderLM, init_cache

__all__ = ["generate"]


def _pick(logits: jax.Array, key: jax.Array | None, temperature: jax.Array | None) -> jax.Array:
    if temperature is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("model", "max_new_tokens", "eos", "pad", "forward", "greedy")
)
def _generate(
    variables, prompt, prompt_mask, key, temperature, *, model, max_new_tokens, eos, pad, forward,
    greedy
):  # fmt: skip
    apply = forward or model.apply
    b, t = prompt.shape
    cache = init_cache(model.config, b, t + max_new_tokens)
    logits, cache = apply(variables, prompt, prompt_mask, cache=cache)
    temp = None if greedy else temperature
    keys = jax.random.split(key, max_new_tokens) if key is not None else [None] * max_new_tokens
    first = _pick(logits[:, -1], keys[0], temp)
    eos_ids = jnp.asarray(eos if eos is not None else (-1,), jnp.int32)
    done = jnp.isin(first, eos_ids)

    def step(carry, k):
        tok, done, cache = carry
        logits, cache = apply(variables, tok[:, None], jnp.ones((b, 1), jnp.bool_), cache=cache)
        nxt = _pick(logits[:, 0], k, temp)
        nxt = jnp.where(done, jnp.int32(pad), nxt)
        return (nxt, done | jnp.isin(nxt, eos_ids), cache), nxt

    if max_new_tokens == 1:
        return first[:, None]
    rest_keys = keys[1:] if key is not None else None
    _, rest = jax.lax.scan(step, (first, done, cache), rest_keys, length=max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def _check_left_padded(prompt_mask: Any, shape: tuple[int, ...]) -> None:
    """Refuses a concrete mask that is not 0s then 1s in every row (a traced one is not checked)."""
    if isinstance(prompt_mask, jax.core.Tracer):
        return
    try:
        mask = np.asarray(prompt_mask).astype(bool)
    except jax.errors.TracerArrayConversionError:
        return
    if mask.shape != tuple(shape):
        raise ValueError(f"prompt_mask has shape {mask.shape}; the prompt has shape {shape}.")
    bad = np.flatnonzero(~mask[:, -1] | np.any(mask[:, :-1] & ~mask[:, 1:], axis=1))
    if bad.size:
        raise ValueError(
            f"prompt_mask is not left-padded in rows {bad[:8].tolist()} (padding after a token, "
            "or no token in the last column): pad prompts on the left (e.g. a tokenizer's "
            "padding_side='left'), as generate reads each row's last token from the last column."
        )


def generate(
    model: DecoderLM,
    variables: Any,
    prompt: jax.Array,
    prompt_mask: jax.Array | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    eos_token_id: int | tuple[int, ...] | None = None,
    pad_token_id: int = 0,
    forward: Callable[..., Any] | None = None,
) -> jax.Array:
    """Samples `max_new_tokens` tokens after each prompt with a KV cache, under `jit`.

    Step j picks `argmax_v p(v | prompt, y_<j)` (greedy, `temperature=0`) or samples from
    `softmax(logits / temperature)`.

    Args:
      model: the `DecoderLM` (its config fixes the cache shape; static under `jit`).
      variables: its variables (`{"params": ...}`), or whatever `forward` takes first.
      prompt: (b, T) token ids, **left**-padded (the last column must be a token).
      prompt_mask: (b, T), 1 for tokens, 0 for padding (default all ones): in every row 0s, then
        1s up to the last column. A concrete mask that is not is refused; a traced one (when
        `generate` runs inside a caller's `jit`) cannot be checked, and a row that is not
        left-padded then gets a wrong continuation.
      max_new_tokens: N >= 1.
      temperature: 0 for greedy decoding, else the sampling temperature (needs `key`).
      key: PRNG key for sampling.
      eos_token_id: id(s) after which a row emits `pad_token_id` (None: never stop).
      pad_token_id: the id emitted after end of sequence.
      forward: replaces `model.apply` with a function of the same signature, e.g. the
        adapted apply of `lowrank_jax.adapters.adapt` closed over adapters, or over a bank of
        adapters and per-row `adapter_ids` (`lowrank_jax.adapters.mixed`); pass the same object
        on every call to reuse the compilation.

    Returns:
      (b, N) int32 generated tokens.

    Raises:
      ValueError: a non-2-D or empty prompt, N < 1, a negative temperature, sampling without a
        key, or a prompt mask that is not left-padded (a 0 after a 1, or a 0 in the last column).

    Example:
      >>> out = generate(model, variables, prompt, mask, max_new_tokens=32)  # doctest: +SKIP
    """
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2:
        raise ValueError(f"prompt must be (b, T) token ids; got shape {prompt.shape}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}.")
    greedy = temperature == 0
    if not greedy and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key (key=...).")
    if prompt.shape[1] < 1:
        raise ValueError("the prompt has no columns; each row needs at least one token.")
    if prompt_mask is None:
        prompt_mask = jnp.ones(prompt.shape, jnp.bool_)
    else:
        _check_left_padded(prompt_mask, prompt.shape)
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    return _generate(
        variables,
        prompt,
        jnp.asarray(prompt_mask, jnp.bool_),
        None if greedy else key,
        None if greedy else jnp.float32(temperature),
        model=model,
        max_new_tokens=int(max_new_tokens),
        eos=tuple(eos) if eos is not None else None,
        pad=int(pad_token_id),
        forward=forward,
        greedy=greedy,
    )
